"""Scheduling promises a user sees, through the engine (found by the mutation check, `make mutation`):
a request is admitted as soon as it fits beside what running requests may still take; no step feeds
more than `max_num_batched_tokens` (under both capacity policies); the prefix cache's counters in
`stats()` count what was asked and what was found."""

from __future__ import annotations

import pytest

from widebeam.llm import LLM
from widebeam.params import BeamSearchParams, SamplingParams

BYTES_PER_BLOCK = 4 * 2 * 2 * 2 * 16 * 4  # T=4 tokens x K,V x 2 layers x 2 kv heads x 16 head_dim x float32


def make_llm(path, num_blocks, **kwargs):
    llm = LLM(str(path), device="cpu", tokens_per_block=4, max_beam_width=16,
              kv_cache_memory=num_blocks * BYTES_PER_BLOCK, **kwargs)
    assert llm.stats()["pools"]["self"]["total_blocks"] == num_blocks
    return llm


def run_all(engine):
    outputs = {}
    while engine.has_unfinished():
        for delta in engine.step():
            if delta.finished:
                outputs[delta.request_id] = delta.output
    return outputs


def test_a_request_that_fits_beside_the_remaining_worst_case_is_admitted_at_once(tiny_llama_dir):
    # A: P=10, N=6, W=4 -> 2 + ceil((2 + 6) / 4) * 4 = 10 blocks, 3 held after its prefill, 7 still to
    # come; B: P=7, N=1 -> 2 blocks. A pool of 12: B fits beside A's remaining 7 in the 9 free.
    llm = make_llm(tiny_llama_dir, 12, enable_prefix_caching=False)
    engine = llm.engine
    engine.add_request("a", {"prompt_token_ids": list(range(3, 13))},
                       BeamSearchParams(beam_width=4, max_new_tokens=6, ignore_eos=True))
    engine.step()
    assert engine.stats()["pools"]["self"]["free_blocks"] == 12 - 3
    engine.add_request("b", {"prompt_token_ids": list(range(20, 27))},
                       SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True))
    finished = [d.request_id for d in engine.step() if d.finished]
    assert finished == ["b"], "B ran in the step after it arrived, beside A"
    outputs = run_all(engine)
    assert outputs["a"].peak_blocks["self"] <= outputs["a"].required_blocks["self"] == 10


@pytest.mark.parametrize("policy", ["guaranteed_no_evict", "max_utilization"])
def test_no_step_feeds_more_than_the_token_budget(tiny_llama_dir, policy):
    llm = make_llm(tiny_llama_dir, 400, max_num_batched_tokens=16, enable_prefix_caching=False,
                   scheduling_policy=policy)
    engine = llm.engine
    scheduled = []
    schedule = engine.scheduler.schedule

    def spy():
        out = schedule()
        fed = sum(s.num_prompt_tokens for s in out.scheduled) + sum(
            s.request.num_step_tokens() for s in out.scheduled if s.num_prompt_tokens == 0)
        scheduled.append((out.num_batched_tokens, fed))
        return out

    engine.scheduler.schedule = spy
    for i in range(6):
        engine.add_request(f"r{i}", {"prompt_token_ids": [3 + i] * (5 + 3 * i)},
                           BeamSearchParams(beam_width=2, max_new_tokens=4, ignore_eos=True))
    outputs = run_all(engine)
    assert len(outputs) == 6
    assert all(fed == batched <= 16 for batched, fed in scheduled), scheduled
    assert max(batched for batched, _ in scheduled) == 16  # the budget is used, not just respected


def test_prefix_cache_counters_count_queried_and_found_tokens(tiny_llama_dir, tiny_marian_dir):
    llm = make_llm(tiny_llama_dir, 200)
    prompt = {"prompt_token_ids": list(range(3, 24))}  # 21 tokens: 5 whole blocks, a hit leaves 1 to compute
    params = SamplingParams(max_new_tokens=2, temperature=0, ignore_eos=True)
    for _ in range(3):
        llm.generate([prompt], params, use_tqdm=False)
    counters = llm.stats()["prefix_cache"]
    assert (counters["queried_tokens"], counters["hit_tokens"]) == (3 * 21, 2 * 20)
    assert counters["hit_rate"] == 40 / 63
    # an encoder-decoder's source counts too: queried = decoder prompt (the start token) + source
    marian = LLM(str(tiny_marian_dir), device="cpu", tokens_per_block=4, kv_cache_memory="4MiB")
    for _ in range(2):
        marian.generate([{"prompt_token_ids": list(range(3, 12))}], params, use_tqdm=False)
    counters = marian.stats()["prefix_cache"]
    assert counters["queried_tokens"] == 2 * (1 + 9)
    assert counters["hit_tokens"] == 9  # the second request finds the encoder output whole
