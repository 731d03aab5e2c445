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


class StepClock:
    """The scheduler's clock, advanced by the test after each step: `cost_s(ids)` of the requests that
    chose a token in it, so what `priority_yield` books does not depend on this machine's speed."""

    def __init__(self, cost_s):
        self.now_s, self.cost_s = 0.0, cost_s

    def __call__(self) -> float:
        return self.now_s

    def trace(self, engine: LLMEngine) -> tuple[list[set[str]], dict[str, list[int]]]:
        steps, outputs = [], {}
        while engine.has_unfinished():
            deltas = engine.step()
            steps.append({d.request_id for d in deltas})
            self.now_s += self.cost_s(steps[-1])
            outputs.update({d.request_id: d.output.outputs[0].token_ids for d in deltas if d.finished})
        return steps, outputs


@pytest.mark.parametrize("policy", ["guaranteed_no_evict", "max_utilization"])
@pytest.mark.parametrize(("priority_yield", "background_step_s", "shared"), [
    (0, 1.0, 12),  # off: the background shares every step of the urgent one's 12
    (3, 1.0, 4),   # steps of equal cost: one in three, from its first (the step it is admitted in)
    (3, 4.0, 1),   # a background step costs four urgent ones: 2 x 4 urgent-only steps between two
])
def test_priority_yield_gives_the_others_one_part_in_n_of_the_time(tiny_llama_dir, policy, priority_yield,
                                                                    background_step_s, shared):
    """Two W=2 searches fit the pool (120 blocks) at once. With `priority_yield=3` the background one
    takes at most a third of the time while the urgent one runs (0: every step); both give their
    outputs alone."""
    engine = LLMEngine(str(tiny_llama_dir), device="cpu", tokens_per_block=T, kv_cache_memory=120 * T * 512,
                       max_beam_width=8, priority_yield=priority_yield, scheduling_policy=policy)
    clock = StepClock(lambda ids: background_step_s if "background" in ids else 1.0)
    engine.scheduler.clock = clock
    narrow = {"beam_width": 2, "max_new_tokens": 12, "min_new_tokens": 12}
    longer = {"beam_width": 2, "max_new_tokens": 20, "min_new_tokens": 20}  # it outlives the urgent one
    engine.add_request("background", prompt(1), BeamSearchParams(**longer, priority=10))
    engine.step()  # its prompt and first token
    clock.now_s += background_step_s
    engine.add_request("urgent", prompt(2), BeamSearchParams(**narrow, priority=0))
    steps, outputs = clock.trace(engine)
    urgent_steps = [ids for ids in steps if "urgent" in ids]
    assert len(urgent_steps) == 12  # it never waits a step
    last = max(i for i, ids in enumerate(steps) if "urgent" in ids)
    assert sum("background" in ids for ids in steps[:last + 1]) == shared
    assert outputs["background"] == alone(tiny_llama_dir, 1, **longer)
    assert outputs["urgent"] == alone(tiny_llama_dir, 2, **narrow)


def test_priority_yield_is_0_or_at_least_2():
    from widebeam.config import EngineConfig
    from widebeam.errors import InvalidParameterError

    with pytest.raises(InvalidParameterError, match="priority_yield"):
        EngineConfig.from_kwargs("m", priority_yield=1)
