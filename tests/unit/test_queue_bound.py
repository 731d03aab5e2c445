"""The bounded waiting queue (sched/queue_bound.py) through the engine: past `max_waiting_requests` or
`max_waiting_blocks` a valid request is refused with `QueueFullError` naming the setting, nothing of it
is queued or held, the queued ones run as before, and the bound frees as the queue drains. Retry-After
is the queue's drain time at the recent finish rate."""

from __future__ import annotations

import pytest

from widebeam.engine import LLMEngine
from widebeam.errors import QueueFullError
from widebeam.params import BeamSearchParams, SamplingParams
from widebeam.sched.queue_bound import MAX_RETRY_AFTER_S, WaitingQueueBound

GREEDY = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)


def run_all(engine: LLMEngine) -> dict[str, list[int]]:
    outputs = {}
    while engine.has_unfinished():
        for delta in engine.step():
            if delta.finished:
                outputs[delta.request_id] = delta.output.outputs[0].token_ids
    return outputs


def test_past_max_waiting_requests_a_request_is_refused_and_holds_nothing(tiny_llama_dir):
    engine = LLMEngine(str(tiny_llama_dir), device="cpu", kv_cache_memory="2MiB", max_waiting_requests=2)
    free_before = {name: pool["free_blocks"] for name, pool in engine.stats()["pools"].items()}
    engine.add_request("a", {"prompt_token_ids": [5, 6, 7]}, GREEDY)
    engine.add_request("b", {"prompt_token_ids": [8, 9]}, GREEDY)
    with pytest.raises(QueueFullError, match="max_waiting_requests=2") as refused:
        engine.add_request("c", {"prompt_token_ids": [10, 11]}, GREEDY)
    assert refused.value.setting == "max_waiting_requests" and refused.value.retry_after_s >= 1
    stats = engine.stats()
    assert stats["waiting"] == 2 and stats["queue"]["refused"] == 1
    assert {name: pool["free_blocks"] for name, pool in stats["pools"].items()} == free_before
    outputs = run_all(engine)
    assert set(outputs) == {"a", "b"}
    engine.add_request("c", {"prompt_token_ids": [10, 11]}, GREEDY)  # the queue drained: room again
    assert set(run_all(engine)) == {"c"}


def test_max_waiting_blocks_weighs_what_the_waiting_requests_will_reserve(tiny_llama_dir):
    engine = LLMEngine(str(tiny_llama_dir), device="cpu", kv_cache_memory="2MiB", tokens_per_block=4,
                       max_waiting_blocks=40)
    wide = BeamSearchParams(beam_width=8, max_new_tokens=8)  # reserves more than a greedy request
    engine.add_request("wide", {"prompt_token_ids": list(range(3, 23))}, wide)
    need = engine.scheduler.waiting[0].admission.required_blocks["self"]
    assert need <= 40  # a request alone always waits
    with pytest.raises(QueueFullError, match="max_waiting_blocks=40") as refused:
        engine.add_request("wide-2", {"prompt_token_ids": list(range(30, 50))}, wide)
    assert refused.value.setting == "max_waiting_blocks" and str(need) in str(refused.value)
    engine.add_request("small", {"prompt_token_ids": [5, 6]}, GREEDY)  # a small one still fits beside it
    assert set(run_all(engine)) == {"wide", "small"}


def test_unbounded_by_default(tiny_llama_dir):
    engine = LLMEngine(str(tiny_llama_dir), device="cpu", kv_cache_memory="2MiB")
    for i in range(50):
        engine.add_request(f"r{i}", {"prompt_token_ids": [5 + i % 7, 6]}, GREEDY)
    assert engine.stats()["queue"] == {"waiting_by_priority": {0: 50}, "max_waiting_requests": None,
                                       "max_waiting_blocks": None, "refused": 0}
    assert len(run_all(engine)) == 50


@pytest.mark.parametrize("finish_times_s, num_waiting, expected_s", [
    ([], 10, 1),                              # nothing finished yet: 1 s
    ([5.0], 10, 1),                           # one finish is no rate
    ([float(t) for t in range(11)], 5, 5),    # 1 a second: 5 waiting drain in 5 s
    ([t / 4 for t in range(9)], 7, 2),        # 4 a second: 7 waiting in 1.75 s, rounded up
    ([float(t) for t in range(3)], 1000, MAX_RETRY_AFTER_S),  # capped
])
def test_retry_after_is_the_drain_time_at_the_recent_finish_rate(finish_times_s, num_waiting, expected_s):
    bound = WaitingQueueBound(max_waiting_requests=1)
    for t in finish_times_s:
        bound.record_finish(t)
    assert bound.retry_after_s(num_waiting) == expected_s


def test_metrics_show_the_queue_by_priority_and_the_refusals():
    from widebeam.server.metrics import _EngineCollector

    stats = {"running": 1, "waiting": 3, "pools": {},
             "queue": {"waiting_by_priority": {-1: 1, 5: 2}, "refused": 4}}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in _EngineCollector(lambda: stats).collect() for s in family.samples}
    assert samples[("widebeam_requests_waiting_by_priority", (("priority", "-1"),))] == 1
    assert samples[("widebeam_requests_waiting_by_priority", (("priority", "5"),))] == 2
    assert samples[("widebeam_requests_queue_full_total", ())] == 4
