"""Request priority (vLLM's semantics: `params.priority`, lower first) through the engine: the queue is
served in priority order (arrival order within one), the starvation guard lets a waiting request be
overtaken only MAX_OVERTAKES times, and with `priority_preemption` a high-priority request that does not
fit preempts a lower-priority one, which resumes later with its output unchanged; every block comes back
(the conftest checks each engine's pools after each test)."""

from __future__ import annotations

import pytest

import widebeam.sched.scheduler as scheduler_module
from widebeam.engine import LLMEngine
from widebeam.params import BeamSearchParams, SamplingParams

T = 4
WIDE = {"beam_width": 8, "max_new_tokens": 8, "min_new_tokens": 8}


def engine_of(model_dir, **kwargs) -> LLMEngine:
    # about 40 blocks of 4 tokens: one W=8 search over 20 tokens at a time
    return LLMEngine(str(model_dir), device="cpu", tokens_per_block=T, kv_cache_memory=40 * T * 512,
                     max_beam_width=8, **kwargs)


def prompt(seed: int) -> dict:
    return {"prompt_token_ids": [(7 * i + seed) % 120 + 3 for i in range(20)]}


def run(engine: LLMEngine) -> tuple[list[str], dict[str, list[int]]]:
    """(request ids in the order they finished, each one's best tokens)."""
    order, outputs = [], {}
    while engine.has_unfinished():
        for delta in engine.step():
            if delta.finished:
                order.append(delta.request_id)
                outputs[delta.request_id] = delta.output.outputs[0].token_ids
    return order, outputs


def alone(model_dir, seed: int, **params) -> list[int]:
    engine = engine_of(model_dir)
    engine.add_request("alone", prompt(seed), BeamSearchParams(**{**WIDE, **params}))
    return run(engine)[1]["alone"]


def test_the_queue_is_served_in_priority_order(tiny_llama_dir):
    engine = engine_of(tiny_llama_dir)
    engine.add_request("low-1", prompt(1), BeamSearchParams(**WIDE, priority=5))
    engine.step()  # low-1 runs; the pool holds one at a time
    engine.add_request("low-2", prompt(2), BeamSearchParams(**WIDE, priority=5))
    engine.add_request("high", prompt(3), BeamSearchParams(**WIDE, priority=-1))
    engine.add_request("low-3", prompt(4), BeamSearchParams(**WIDE, priority=5))
    assert [r.request_id for r in engine.scheduler.waiting] == ["high", "low-2", "low-3"]
    assert engine.stats()["queue"]["waiting_by_priority"] == {-1: 1, 5: 2}
    order, _ = run(engine)
    assert order == ["low-1", "high", "low-2", "low-3"]  # no preemption by default: low-1 finishes first


def test_a_waiting_request_is_overtaken_at_most_max_overtakes_times(tiny_llama_dir, monkeypatch):
    monkeypatch.setattr(scheduler_module, "MAX_OVERTAKES", 2)
    engine = engine_of(tiny_llama_dir)
    greedy = {"max_new_tokens": 2, "temperature": 0}
    engine.add_request("old", prompt(1), SamplingParams(**greedy, priority=9))
    for i in range(4):
        engine.add_request(f"urgent-{i}", prompt(2 + i), SamplingParams(**greedy, priority=0))
    assert [r.request_id for r in engine.scheduler.waiting] == ["urgent-0", "urgent-1", "old", "urgent-2",
                                                                "urgent-3"]
    run(engine)


@pytest.mark.parametrize("policy", ["guaranteed_no_evict", "max_utilization"])
def test_priority_preemption_lets_the_urgent_request_in_and_loses_nothing(tiny_llama_dir, policy):
    engine = engine_of(tiny_llama_dir, priority_preemption=True, scheduling_policy=policy)
    engine.add_request("background", prompt(1), BeamSearchParams(**WIDE, priority=10))
    for _ in range(3):
        engine.step()  # the background search is decoding
    engine.add_request("urgent", prompt(2), BeamSearchParams(**WIDE, priority=0))
    order, outputs = run(engine)
    if policy == "guaranteed_no_evict":  # the urgent head preempts the background search
        assert order == ["urgent", "background"]
        assert engine.stats()["scheduling"]["preemptions"] >= 1
    # resumed by recomputation: the same output as alone, and the urgent one's too
    assert outputs["background"] == alone(tiny_llama_dir, 1)
    assert outputs["urgent"] == alone(tiny_llama_dir, 2)


def test_without_priority_preemption_the_urgent_request_waits(tiny_llama_dir):
    engine = engine_of(tiny_llama_dir)
    engine.add_request("background", prompt(1), BeamSearchParams(**WIDE, priority=10))
    for _ in range(3):
        engine.step()
    engine.add_request("urgent", prompt(2), BeamSearchParams(**WIDE, priority=0))
    order, _ = run(engine)
    assert order == ["background", "urgent"] and engine.stats()["scheduling"]["preemptions"] == 0


def test_a_request_is_preempted_for_priority_at_most_max_preemptions_times(tiny_llama_dir):
    engine = engine_of(tiny_llama_dir, priority_preemption=True, max_preemptions=1)
    engine.add_request("background", prompt(1), BeamSearchParams(**WIDE, priority=10))
    engine.step()
    preemptions_seen = []
    for i in range(3):  # three urgent arrivals, each while the background search is running again
        engine.add_request(f"urgent-{i}", prompt(2 + i), BeamSearchParams(**WIDE, priority=0))
        while any(r.request_id.startswith("urgent") for r in (*engine.scheduler.running,
                                                             *engine.scheduler.waiting)):
            engine.step()
        running = {r.request_id for r in engine.scheduler.running}
        while engine.has_unfinished() and "background" not in running:
            engine.step()
            running = {r.request_id for r in engine.scheduler.running}
        preemptions_seen.append(engine.stats()["scheduling"]["preemptions"])
    run(engine)
    assert preemptions_seen[-1] == 1  # preempted once, then it ran on beside (or before) the others


def trace(engine: LLMEngine) -> tuple[list[set[str]], dict[str, list[int]]]:
    """(the requests that chose a token, step by step; each one's best tokens)."""
    steps, outputs = [], {}
    while engine.has_unfinished():
        deltas = engine.step()
        steps.append({d.request_id for d in deltas})
        outputs.update({d.request_id: d.output.outputs[0].token_ids for d in deltas if d.finished})
    return steps, outputs


@pytest.mark.parametrize("policy", ["guaranteed_no_evict", "max_utilization"])
@pytest.mark.parametrize("priority_yield", [0, 3])
def test_priority_yield_runs_the_urgent_request_alone_n_minus_1_steps_in_n(tiny_llama_dir, policy,
                                                                           priority_yield):
    """Two W=2 searches fit the pool (120 blocks) at once. With `priority_yield=3` the background one
    decodes one step in three while the urgent one runs (0: every step); both give their outputs alone."""
    engine = LLMEngine(str(tiny_llama_dir), device="cpu", tokens_per_block=T, kv_cache_memory=120 * T * 512,
                       max_beam_width=8, priority_yield=priority_yield, scheduling_policy=policy)
    narrow = {"beam_width": 2, "max_new_tokens": 12, "min_new_tokens": 12}
    longer = {"beam_width": 2, "max_new_tokens": 20, "min_new_tokens": 20}  # it outlives the urgent one
    engine.add_request("background", prompt(1), BeamSearchParams(**longer, priority=10))
    engine.step()  # its prompt and first token
    engine.add_request("urgent", prompt(2), BeamSearchParams(**narrow, priority=0))
    steps, outputs = trace(engine)
    urgent_steps = [ids for ids in steps if "urgent" in ids]
    assert len(urgent_steps) == 12  # it never waits a step
    last = max(i for i, ids in enumerate(steps) if "urgent" in ids)
    shared = sum("background" in ids for ids in steps[:last + 1])
    # every step, or the step it was admitted in and one in three of the 11 after it
    assert shared == (12 if priority_yield == 0 else 4)
    assert outputs["background"] == alone(tiny_llama_dir, 1, **longer)
    assert outputs["urgent"] == alone(tiny_llama_dir, 2, **narrow)


def test_priority_yield_is_0_or_at_least_2():
    from widebeam.config import EngineConfig
    from widebeam.errors import InvalidParameterError

    with pytest.raises(InvalidParameterError, match="priority_yield"):
        EngineConfig.from_kwargs("m", priority_yield=1)
