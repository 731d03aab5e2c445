"""Preemption and speculative decoding together (one step loop: a re-fed round drafts nothing, and
the draft model's pools are freed and refilled with the target's): under both capacity policies,
forced preemptions and the policy's own give the outputs of a plain engine, with prompt lookup and
with a draft model. Every engine ends with all its blocks back (tests/conftest.py)."""

from __future__ import annotations

import pytest
from test_preemption_outputs import CROWD, FORCED, POLICIES, assert_same, make, requests_for, run

SPECULATION = {
    "ngram": lambda draft_dir: {"speculative_method": "ngram", "num_speculative_tokens": 3},
    "draft": lambda draft_dir: {"speculative_model": str(draft_dir), "num_speculative_tokens": 3},
}


@pytest.fixture(scope="module")
def plain_reference(tiny_llama_dir):
    outputs, _, _ = run(make(tiny_llama_dir, "guaranteed_no_evict"), requests_for(width_cap=8))
    return outputs


@pytest.mark.parametrize("speculation", sorted(SPECULATION))
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("when", ["right after prefill", "mid-decode", "twice"])
def test_forced_preemptions_of_speculative_requests_change_no_output(tiny_llama_dir, plain_reference, speculation,
                                                                     policy, when):
    llm = make(tiny_llama_dir, policy, speculative_adaptive=False, **SPECULATION[speculation](tiny_llama_dir))
    plan = {request_id.replace("beam32", "beam8"): states for request_id, states in FORCED[when].items()}
    outputs, forced, _ = run(llm, requests_for(width_cap=8), plan=plan)
    assert len(forced) == sum(len(states) for states in plan.values())
    assert llm.stats()["speculative"]["rounds"] > 0
    assert_same(outputs, plain_reference)


@pytest.mark.parametrize("speculation", sorted(SPECULATION))
def test_max_utilization_preempts_speculative_requests_on_its_own_and_matches(tiny_llama_dir, speculation):
    """A pool too small for every worst case at once: the policy preempts (each round's drafted
    slots counted in the step's need) and the outputs are a plain engine's."""
    small = {"kv_cache_memory": 64 * 2048, "max_num_batched_tokens": 64}
    reference, _, _ = run(make(tiny_llama_dir, "guaranteed_no_evict", **small), CROWD)
    llm = make(tiny_llama_dir, "max_utilization", max_preemptions=2, speculative_adaptive=False, **small,
               **SPECULATION[speculation](tiny_llama_dir))
    outputs, _, _ = run(llm, CROWD)
    assert llm.stats()["scheduling"]["preemptions"] > 0
    assert_same(outputs, reference)
