"""`LLM.score`: the log-prob of given continuations, exact against transformers' log-softmax of the forced
sequence (1e-4 per token and summed), decoder-only (tiny Llama) and encoder-decoder (tiny Marian, with
and without a decoder prefix); the prompt is computed once for all of a prompt's continuations (the
forward passes' tokens counted), also across the requests a wide candidate list is split into."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import record_schedules
from tiny_models import TINY_MARIAN_EOS, TINY_MARIAN_PAD
from transformers import AutoModelForCausalLM, MarianMTModel

from widebeam.errors import InvalidParameterError
from widebeam.llm import LLM
from widebeam.score_params import ScoreParams

ENGINE = {"dtype": "float32", "device": "cpu", "tokens_per_block": 4, "kv_cache_memory": "16MiB",
          "max_num_batched_tokens": 64}
PROMPTS = [[5, 17, 33, 9, 100, 3, 8], [7, 7, 9] * 6, [11]]


def candidates(seed: int, count: int, max_len: int = 4, vocab: int = 128) -> list[list[int]]:
    """Random continuations, many sharing prefixes (a small first-token alphabet)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 9)] + [rng.randrange(vocab) for _ in range(rng.randrange(max_len))]
            for _ in range(count)]


def counting_steps(llm) -> list[int]:
    """Record the tokens of every forward pass the engine runs from now on."""
    counts: list[int] = []
    step, schedules = llm.engine.step, record_schedules(llm.engine)

    def counted():
        deltas = step()
        counts.append(schedules[-1].num_batched_tokens)
        return deltas

    llm.engine.step = counted
    return counts


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    return LLM(str(tiny_llama_dir), max_beam_width=64, **ENGINE), hf


@pytest.fixture(scope="module")
def marian(tiny_marian_dir):
    hf = MarianMTModel.from_pretrained(str(tiny_marian_dir), dtype=torch.float32).eval()
    return LLM(str(tiny_marian_dir), max_beam_width=16, **ENGINE), hf


def assert_scores(output, expected_row_logprobs, continuation):
    expected = [float(expected_row_logprobs[j, t]) for j, t in enumerate(continuation)]
    assert output.token_ids == list(continuation)
    torch.testing.assert_close(output.token_logprobs, expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(output.logprob, sum(expected), atol=1e-4, rtol=0)


def test_decoder_only_scores_are_transformers_log_softmax(llama):
    llm, hf = llama
    prompts, continuations = [], []
    for k, prompt in enumerate(PROMPTS):
        for c in candidates(k, 12):
            prompts.append({"prompt_token_ids": prompt})
            continuations.append(c)
    outputs = llm.score(prompts, continuations)
    assert len(outputs) == len(continuations)
    for prompt, c, output in zip(prompts, continuations, outputs):
        ids = prompt["prompt_token_ids"]
        with torch.no_grad():
            logprobs = torch.log_softmax(hf(torch.tensor([ids + c])).logits[0].float(), -1)
        assert output.prompt_token_ids == ids
        assert_scores(output, logprobs[len(ids) - 1:], c)


@pytest.mark.parametrize("prefix", [(), (40, 41)])
def test_encoder_decoder_scores_are_transformers_log_softmax(marian, prefix):
    llm, hf = marian
    sources = [[5, 17, 33, 9, 100, 3, TINY_MARIAN_EOS], [11, TINY_MARIAN_EOS]]
    for k, source in enumerate(sources):
        continuations = candidates(10 + k, 20) + [[7, TINY_MARIAN_EOS]]
        outputs = llm.score({"prompt_token_ids": source}, continuations, decoder_prefix=list(prefix))
        for c, output in zip(continuations, outputs):
            decoder_ids = [TINY_MARIAN_PAD, *prefix, *c]
            with torch.no_grad():
                logits = hf(input_ids=torch.tensor([source]),
                            decoder_input_ids=torch.tensor([decoder_ids])).logits
            logprobs = torch.log_softmax(logits[0].float(), -1)
            # raw scores: Marian's pad ban (generation config) applies to generation, not to scoring
            assert_scores(output, logprobs[len(prefix):], c)


def test_the_prompt_is_computed_once_for_all_its_candidates(llama):
    llm, hf = llama
    prompt = list(range(3, 43))  # 40 tokens: 10 full blocks
    continuations = candidates(7, 60, max_len=3)
    counts = counting_steps(llm)
    try:
        outputs = llm.score({"prompt_token_ids": prompt}, continuations)
    finally:
        del llm.engine.step
    # the prompt once, then each distinct prefix of a continuation once (its last token is never fed)
    distinct_prefixes = {tuple(c[:d]) for c in continuations for d in range(1, len(c))}
    assert sum(counts) == len(prompt) + len(distinct_prefixes)
    assert len(distinct_prefixes) < sum(len(c) - 1 for c in continuations)  # shared prefixes fed once
    with torch.no_grad():
        for c, output in list(zip(continuations, outputs))[:5]:
            logprobs = torch.log_softmax(hf(torch.tensor([prompt + c])).logits[0].float(), -1)
            assert_scores(output, logprobs[len(prompt) - 1:], c)


def test_more_candidates_than_max_beam_width_share_the_prompt_through_the_cache(marian, tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), max_beam_width=8, **ENGINE)
    llm.engine.reset_prefix_cache()
    prompt = list(range(3, 43))
    continuations = candidates(8, 30, max_len=3)  # 4 requests of at most 8
    counts = counting_steps(llm)
    outputs = llm.score({"prompt_token_ids": prompt}, continuations)
    num_requests = 4
    fed = sum(len({tuple(c[:d]) for c in continuations[s:s + 8] for d in range(1, len(c))})
              for s in range(0, 30, 8))
    # each later request recomputes at most one block of the prompt (the prefill needs its last token)
    assert sum(counts) <= len(prompt) + (num_requests - 1) * 4 + fed
    reference = LLM(str(tiny_llama_dir), max_beam_width=64, **ENGINE).score({"prompt_token_ids": prompt},
                                                                            continuations)
    for a, b in zip(outputs, reference):
        torch.testing.assert_close(a.token_logprobs, b.token_logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("continuations", [[], [[]], [[3, -1]], ["" ], [[3], "ab", 5]])
def test_bad_continuations_are_refused_naming_the_field(continuations):
    with pytest.raises(InvalidParameterError) as excinfo:
        ScoreParams(continuations)
    assert excinfo.value.param == "continuations"


def test_engine_side_refusals(llama):
    llm, _ = llama
    with pytest.raises(InvalidParameterError) as excinfo:
        llm.score({"prompt_token_ids": [5, 6]}, [[3, 10**6]])
    assert excinfo.value.param == "continuations"
    with pytest.raises(InvalidParameterError) as excinfo:
        llm.score({"prompt_token_ids": [5, 6]}, ["text"])  # the tiny model has no tokenizer
    assert excinfo.value.param == "continuations"
    with pytest.raises(InvalidParameterError) as excinfo:
        llm.score([{"prompt_token_ids": [5, 6]}] * 2, [[3]])
    assert excinfo.value.param == "prompts"
    with pytest.raises(InvalidParameterError) as excinfo:
        llm.engine.add_request("x", [5, 6], ScoreParams([[3]]), logits_processors=[lambda s, n: None])
    assert excinfo.value.param == "logits_processors"
