"""Log-probs (`logprobs=k`, `prompt_logprobs=k`) against a plain reference: the log-softmax of
transformers' logits for the same tokens (teacher-forced over prompt + generated tokens), on a tiny
random Llama. Greedy, sampled and beam search (every returned beam: its own history, however the beams
were reordered), with penalties (still the raw model's log-probs), chunked prefill and the prefix cache."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from widebeam.llm import LLM
from widebeam.logprobs import Logprob
from widebeam.params import BeamSearchParams, SamplingParams

PROMPTS = [[5, 17, 33, 9, 100, 3, 8], list(range(3, 40)), [11, 12]]
TOP = 5
ATOL = 2e-4


@pytest.fixture(scope="module")
def models(tiny_llama_dir):
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    # 16-token prefill chunks: the 37-token prompt is prefilled in three steps
    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", tokens_per_block=4, kv_cache_memory="16MiB",
              max_num_batched_tokens=16, max_beam_width=16)
    return llm, hf


def _reference(hf, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """log_softmax of HF's logits at every position of prompt + generated [len, vocab]."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + generated])).logits[0]
    return torch.log_softmax(logits.double(), dim=-1)


def _check_entry(entry: dict[int, Logprob], token: int, ref_row: torch.Tensor, top: int, where: str) -> None:
    assert next(iter(entry)) == token, f"{where}: the chosen token comes first"
    assert entry[token].logprob == pytest.approx(float(ref_row[token]), abs=ATOL), where
    assert entry[token].rank == int((ref_row > ref_row[token] + ATOL).sum()) + 1, where
    ref_values, ref_tokens = torch.topk(ref_row, top)
    alternatives = sorted(entry.items(), key=lambda item: item[1].rank)
    ranked = {t: lp for t, lp in alternatives if lp.rank <= top}
    assert len(ranked) == top, where
    assert sorted(lp.logprob for lp in ranked.values()) == pytest.approx(sorted(ref_values.tolist()),
                                                                         abs=ATOL), where
    assert set(ranked) == set(ref_tokens.tolist()), where  # the tiny model has no near-ties in its top 5
    for t, lp in entry.items():
        assert lp.logprob == pytest.approx(float(ref_row[t]), abs=ATOL), where
        assert isinstance(lp.decoded_token, str), where


def _check_completion(hf, prompt, completion, top, where):
    assert completion.logprobs is not None and len(completion.logprobs) == len(completion.token_ids), where
    ref = _reference(hf, prompt, completion.token_ids)
    for i, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        _check_entry(entry, token, ref[len(prompt) - 1 + i], top, f"{where} token {i}")


@pytest.mark.parametrize("params", [SamplingParams(max_new_tokens=10, temperature=0, logprobs=TOP),
                                    SamplingParams(max_new_tokens=10, temperature=0.9, seed=3, logprobs=TOP),
                                    SamplingParams(max_new_tokens=10, temperature=0.7, top_k=5, seed=4,
                                                   repetition_penalty=1.6, logprobs=TOP)],
                         ids=["greedy", "sampled", "sampled-top-k-penalty"])
def test_sampled_logprobs_are_the_models_log_softmax(models, params):
    llm, hf = models
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs):
        completion = output.outputs[0]
        _check_completion(hf, prompt, completion, TOP, f"prompt {prompt[:3]}")
        if params.repetition_penalty == 1.0:  # the cumulative is over the same log-probs
            total = sum(entry[t].logprob for t, entry in zip(completion.token_ids, completion.logprobs))
            assert total == pytest.approx(completion.cumulative_logprob, abs=1e-3)


@pytest.mark.parametrize("width, penalty", [(1, 1.0), (4, 1.0), (16, 1.0), (4, 1.5)])
def test_each_beam_carries_its_own_history(models, width, penalty):
    llm, hf = models
    params = BeamSearchParams(beam_width=width, max_new_tokens=10, logprobs=3, repetition_penalty=penalty)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs):
        assert len(output.outputs) == width
        for beam in output.outputs:
            _check_completion(hf, prompt, beam, 3, f"W={width} prompt {prompt[:3]} beam {beam.index}")
            total = sum(entry[t].logprob for t, entry in zip(beam.token_ids, beam.logprobs))
            if penalty == 1.0:  # no processor changed a score: the beam's cumulative is the sum
                assert total == pytest.approx(beam.cumulative_logprob, abs=1e-3)
    pool = llm.stats()["pools"]["self"]
    assert pool["free_blocks"] == pool["total_blocks"]


def test_logprobs_off_by_default_and_zero_is_the_chosen_token_only(models):
    llm, _ = models
    prompt = {"prompt_token_ids": PROMPTS[0]}
    plain = llm.generate([prompt], SamplingParams(max_new_tokens=4, temperature=0), use_tqdm=False)[0]
    assert plain.outputs[0].logprobs is None and plain.prompt_logprobs is None
    zero = llm.generate([prompt], SamplingParams(max_new_tokens=4, temperature=0, logprobs=0),
                        use_tqdm=False)[0]
    assert [list(entry) for entry in zero.outputs[0].logprobs] == [[t] for t in zero.outputs[0].token_ids]
    assert zero.outputs[0].token_ids == plain.outputs[0].token_ids


@pytest.mark.parametrize("beam", [False, True])
def test_prompt_logprobs_over_chunks_and_past_the_prefix_cache(models, beam):
    llm, hf = models
    prompt = PROMPTS[1]  # 37 tokens: three prefill chunks of at most 16
    make = (lambda **kw: BeamSearchParams(beam_width=4, max_new_tokens=3, **kw)) if beam else (
        lambda **kw: SamplingParams(max_new_tokens=3, temperature=0, **kw))
    llm.generate([{"prompt_token_ids": prompt}], make(), use_tqdm=False)  # the prompt's blocks are cached now
    output = llm.generate([{"prompt_token_ids": prompt}], make(prompt_logprobs=2), use_tqdm=False)[0]
    assert output.num_cached_tokens == 0  # every prompt token computed, as in vLLM
    entries = output.prompt_logprobs
    assert len(entries) == len(prompt) and entries[0] is None
    ref = _reference(hf, prompt, [])
    for i in range(1, len(prompt)):
        _check_entry(entries[i], prompt[i], ref[i - 1], 2, f"prompt token {i}")
        assert entries[i][prompt[i]].decoded_token is not None
    plain = llm.generate([{"prompt_token_ids": prompt}], make(), use_tqdm=False)[0]
    assert [c.token_ids for c in output.outputs] == [c.token_ids for c in plain.outputs]
