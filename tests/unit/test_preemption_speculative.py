"""Preemption and speculative decoding together (one step loop: a re-fed round drafts nothing, and
the draft model's pools are freed and refilled with the target's): under both capacity policies,
forced preemptions and the policy's own give the outputs of the same engine unpreempted, with prompt
lookup and with a draft model (seeded sampling included: a preempted request re-feeds its tokens
without drawing from its generator). Every engine ends with all its blocks back (tests/conftest.py)."""

from __future__ import annotations

import pytest
from test_preemption_outputs import ALL, CROWD, POLICIES, assert_same, make, requests_for, run

SPECULATION = {
    "ngram": lambda draft_dir: {"speculative_method": "ngram", "num_speculative_tokens": 3},
    "draft": lambda draft_dir: {"speculative_model": str(draft_dir), "num_speculative_tokens": 3},
}


@pytest.fixture(scope="module")
def speculative_reference(tiny_llama_dir):
    """Per drafter: the outputs of an unpreempted run (sampling with a drafter draws its tokens by
    rejection, so its samples are its own; greedy and beams equal plain decoding: test_speculative_exact)."""
    references = {}

    def get(speculation: str):
        if speculation not in references:
            llm = make(tiny_llama_dir, "guaranteed_no_evict", speculative_adaptive=False,
                       **SPECULATION[speculation](tiny_llama_dir))
            references[speculation], _, _ = run(llm, requests_for(width_cap=8))
        return references[speculation]

    return get


# Before step i, preempt these requests (those running then): right after the prefills, mid-decode, twice.
SCHEDULES = {"early": {4: ALL}, "mid-decode": {7: ALL}, "twice": {4: ALL, 9: ALL}}


@pytest.mark.parametrize("speculation", sorted(SPECULATION))
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("when", sorted(SCHEDULES))
def test_forced_preemptions_of_speculative_requests_change_no_output(tiny_llama_dir, speculative_reference,
                                                                     speculation, policy, when):
    llm = make(tiny_llama_dir, policy, speculative_adaptive=False, **SPECULATION[speculation](tiny_llama_dir))
    outputs, forced, _ = run(llm, requests_for(width_cap=8), preempt_at=SCHEDULES[when])
    assert len(forced) >= 2, forced
    assert llm.stats()["speculative"]["rounds"] > 0
    assert_same(outputs, speculative_reference(speculation))


@pytest.mark.parametrize("speculation", sorted(SPECULATION))
def test_speculative_requests_preempted_every_few_steps_still_match(tiny_llama_dir, speculative_reference,
                                                                   speculation):
    """Preempted again and again, sometimes before the re-fed tokens are all back."""
    llm = make(tiny_llama_dir, "max_utilization", max_preemptions=100, speculative_adaptive=False,
               **SPECULATION[speculation](tiny_llama_dir))
    schedule = {step: ["beam8", "sampled", "greedy", "beam4"] for step in range(2, 60, 3)}
    outputs, forced, _ = run(llm, requests_for(width_cap=8), schedule)
    assert len(forced) >= 8, forced
    assert_same(outputs, speculative_reference(speculation))


# CROWD's shape with N = 20: each worst case (D = 3 drafted slots per beam included) fits the pool
# alone, not all at once.
CROWD20 = {request_id: (prompt, params.replace(max_new_tokens=20))
           for request_id, (prompt, params) in CROWD.items()}


@pytest.mark.parametrize("speculation", sorted(SPECULATION))
def test_max_utilization_preempts_speculative_requests_on_its_own_and_matches(tiny_llama_dir, speculation):
    """A pool too small for every worst case at once: the policy preempts (each round's drafted
    slots counted in the step's need) and the outputs are a plain engine's (greedy and beams only)."""
    # a draft model's pool shares the budget: twice the memory gives the target's pool 64 blocks too
    memory = 64 * 2048 * (2 if speculation == "draft" else 1)
    small = {"kv_cache_memory": memory, "max_num_batched_tokens": 256}  # room for every round at once
    reference, _, _ = run(make(tiny_llama_dir, "guaranteed_no_evict", **small), CROWD20)
    llm = make(tiny_llama_dir, "max_utilization", max_preemptions=2, speculative_adaptive=False, **small,
               **SPECULATION[speculation](tiny_llama_dir))
    assert llm.stats()["pools"]["self"]["total_blocks"] == 64
    outputs, _, _ = run(llm, CROWD20)
    assert llm.stats()["scheduling"]["preemptions"] > 0
    assert_same(outputs, reference)
