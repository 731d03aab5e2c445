"""A request's reported peak (`RequestOutput.peak_blocks`: the most blocks it held at once, per pool) is
the most over every life it had: a preemption gives its blocks back and it resumes in fresh ones, but
what it held before still counts. Checked both ways where the peak is known exactly: a width schedule
that starts wide, driven to its bound (tests/unit/test_schedule_tightness_engine.py), holds
`required_blocks` at its first decode step and far fewer after; preempted once or twice after that step,
its resumed lives hold fewer, and the peak it reports is still `required_blocks`, the unpreempted run's.
"""

from __future__ import annotations

import pytest
from test_schedule_tightness_engine import spread

from widebeam.kv.schedule_budget import scheduled_blocks
from widebeam.llm import LLM
from widebeam.params import BeamSearchParams

SCHEDULE = (8, 2)  # 8 beams at the first step, 2 after
PROMPT = list(range(10, 18))  # P = 8: two whole blocks of T = 4, shared by every beam
N = 8


def run(llm, preempt_when_generated=()):
    """The request alone; preempted before the step where it has generated each count listed (once
    each). Returns (its output, the peak its last life held, the counts it was preempted at)."""
    engine = llm.engine
    engine.add_request("tight", {"prompt_token_ids": PROMPT},
                       BeamSearchParams(beam_width_schedule=list(SCHEDULE), max_new_tokens=N),
                       logits_processors=[spread(SCHEDULE)])
    request = engine._requests["tight"]
    pending, preempted, output = sorted(preempt_when_generated), [], None
    while engine.has_unfinished():
        if pending and request.prompt_done and request.decoder.num_generated_tokens >= pending[0]:
            preempted.append(request.decoder.num_generated_tokens)
            assert engine.scheduler.preempt("tight")
            pending.pop(0)
        for delta in engine.step():
            assert delta.error is None, delta.error
            if delta.finished:
                output = delta.output
    assert not pending
    return output, request.kv.peak_blocks(), preempted


@pytest.fixture(scope="module", params=["guaranteed_no_evict", "max_utilization"])
def llm(request, tiny_llama_dir):
    return LLM(str(tiny_llama_dir), dtype="float32", device="cpu", tokens_per_block=4, kv_cache_memory="4MiB",
               max_beam_width=8, enable_prefix_caching=False, scheduling_policy=request.param)


@pytest.mark.parametrize("preempt_when_generated", [(), (3,), (3, 5), (2, 3, 6)],
                         ids=["never", "once", "twice", "three-times"])
def test_a_preempted_request_reports_the_peak_of_every_life(llm, preempt_when_generated):
    output, last_life, preempted = run(llm, preempt_when_generated)
    assert preempted == list(preempt_when_generated)
    # 2 shared prompt blocks and one own block per beam for the first token: 8 beams at once
    required = scheduled_blocks(len(PROMPT), N, SCHEDULE, 4)
    assert required == 2 + 8
    assert output.required_blocks == {"self": required}
    assert output.peak_blocks == {"self": required}  # reached, and not more: both ways
    assert [len(c.token_ids) for c in output.outputs] == [N] * SCHEDULE[-1]
    if preempted:
        # the last life alone (2 beams re-fed into blocks of their own) held far fewer
        assert last_life["self"] < required
