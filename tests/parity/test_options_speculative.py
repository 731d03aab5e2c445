"""The decoding options under speculative decoding (a draft model: the target itself with noise, and
prompt lookup): the outputs equal those without a drafter, since every round replays the decoder on the
target's scores (speculative/replay.py) and the options' processors read the same history. Scoring runs
with nothing drafted on a speculating engine and gives the same log-probs."""

from __future__ import annotations

import pytest
import torch
from tiny_models import save_noisy_copy

from widebeam.llm import LLM
from widebeam.params import BeamSearchParams, SamplingParams

ENGINE = {"dtype": "float32", "device": "cpu", "tokens_per_block": 4, "kv_cache_memory": "16MiB",
          "max_num_batched_tokens": 128, "max_beam_width": 8}
PROMPTS = [[5, 17, 33, 9, 100, 3, 8], [7, 7, 9] * 6]
PARAMS = [
    SamplingParams(temperature=0, max_new_tokens=12, no_repeat_ngram_size=2, bad_words_ids=[[9, 7]]),
    BeamSearchParams(beam_width=4, max_new_tokens=12, no_repeat_ngram_size=3, bad_words_ids=[[9, 7], [4]]),
    BeamSearchParams(beam_width=4, max_new_tokens=12, patience=2.0, stop_token_ids=[5, 9]),
    BeamSearchParams(beam_width=4, max_new_tokens=8, decoder_prefix=[40, 41], prefix_bias_beta=0.5),
    # (a hard decoder_prefix is refused on this decoder-only model: the soft one above is not)
    BeamSearchParams(beam_width=4, max_new_tokens=8, return_alternatives=True),
]


@pytest.fixture(scope="module")
def engines(tiny_llama_dir, tmp_path_factory):
    draft = tmp_path_factory.mktemp("noisy-draft")
    save_noisy_copy(tiny_llama_dir, draft, noise=0.02)
    # Drafting every round: the options under drafts are under test, and the adaptive policy (which
    # remembers per shape that drafting lost) could leave a request undrafted.
    return {"plain": LLM(str(tiny_llama_dir), **ENGINE),
            "draft": LLM(str(tiny_llama_dir), speculative_model=str(draft), num_speculative_tokens=3,
                         speculative_adaptive=False, **ENGINE),
            "ngram": LLM(str(tiny_llama_dir), speculative_method="ngram", num_speculative_tokens=3,
                         speculative_adaptive=False, **ENGINE)}


@pytest.mark.parametrize("drafter", ["draft", "ngram"])
@pytest.mark.parametrize("index", range(len(PARAMS)))
def test_options_give_the_same_outputs_when_speculating(engines, drafter, index):
    params = PARAMS[index]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    plain = engines["plain"].generate(prompts, params, use_tqdm=False)
    drafted = engines[drafter].stats()["speculative"]["drafted_tokens"]
    speculated = engines[drafter].generate(prompts, params, use_tqdm=False)
    assert engines[drafter].stats()["speculative"]["drafted_tokens"] > drafted  # rounds did draft
    for a, b in zip(plain, speculated):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        for x, y in zip(a.outputs, b.outputs):
            assert x.cumulative_logprob == pytest.approx(y.cumulative_logprob, abs=1e-4)


def test_scoring_on_a_speculating_engine(engines):
    continuations = [[4, 5, 6], [4, 5], [9]]
    plain = engines["plain"].score({"prompt_token_ids": PROMPTS[0]}, continuations)
    speculated = engines["draft"].score({"prompt_token_ids": PROMPTS[0]}, continuations)
    for a, b in zip(plain, speculated):
        torch.testing.assert_close(a.token_logprobs, b.token_logprobs, atol=1e-4, rtol=0)
