"""Both capacity policies under random workloads (issue #21): the prefix-reuse simulator of
tests/unit/test_prefix_cache_traces.py, its requests able to be preempted and to resume by
recomputation as `widebeam/request.py` does (prompt prefilled again, each live beam's generated tokens
re-fed, `max_feed_tokens` a step, nothing chosen meanwhile), run by the engine's scheduler of either
policy (`make_scheduler`). Under both:
- no hang, no leak (every block back), no false rejection (a rejected request does not fit alone);
- every admitted request finishes; no allocation ever runs out of blocks (`OutOfBlocksError` would
  fail the run), every request holds at most its `required_blocks`, every read block holds the
  sequence's own tokens (re-fed tokens included);
- the beams each request ends with are the same under both policies (preemption changes no output);
- under `max_utilization` no request is preempted more than K times, and a request under its
  guaranteed reservation is never preempted.
Designed cases show that a small pool does preempt, and that the starvation guard (K) lets a request
preempted K times finish before anything newer is admitted.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_prefix_cache_traces import SimRequest, Simulator, make_cache, run_random_workload

from widebeam.sched.preemption import make_scheduler

POLICIES = ["guaranteed_no_evict", "max_utilization"]


class PreemptibleRequest(SimRequest):
    """A simulated request that can be preempted: its beams (generated tokens) stay, its blocks go."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.num_preemptions = 0
        self.num_fed = 0  # generated tokens of each live beam whose K/V are in the cache
        self.max_feed_tokens = None
        self.resuming = False  # the prompt is being prefilled again

    @property
    def num_feed_tokens(self):
        pending = len(self.beams[0]) - self.num_fed if self.beams else 0
        if self.max_feed_tokens is None:
            return pending
        return min(pending, max(1, self.max_feed_tokens // len(self.beams)))

    def num_step_tokens(self, num_draft_tokens=0):
        return self.num_feed_tokens * len(self.beams)

    def preempt(self, max_feed_tokens=None):
        dropped = self.num_prefilled_tokens + self.num_fed * len(self.beams)
        self.kv.free()
        self.kv = self.kv.renew()
        self.num_prefilled_tokens = 0
        self.num_fed = 0
        self.max_feed_tokens = max_feed_tokens
        self.resuming = bool(self.beams)
        self.num_preemptions += 1
        return dropped


class PolicySimulator(Simulator):
    def __init__(self, cache, max_num_batched_tokens, rng, policy, max_preemptions=3):
        super().__init__(cache, max_num_batched_tokens, rng)
        self.scheduler = make_scheduler(policy, cache, max_num_batched_tokens, max_preemptions)
        self.max_preemptions = max_preemptions
        self.preempted: list[str] = []
        # each preemption: was it the newest non-guaranteed request?
        self.victims_were_newest: list[bool] = []
        preempt = self.scheduler._preempt

        def watched(request):
            guaranteed = getattr(self.scheduler, "guaranteed", ())
            assert request not in guaranteed, "a guaranteed request was preempted"
            newest = [r for r in self.scheduler.running if r not in guaranteed][-1]
            self.victims_were_newest.append(request is newest)
            self.preempted.append(request.request_id)
            preempt(request)
            ahead = list(self.scheduler.waiting)[:list(self.scheduler.waiting).index(request)]
            # back at the head of the queue, behind only requests preempted K times
            assert all(r.num_preemptions >= max_preemptions for r in ahead), "not requeued at the head"

        self.scheduler._preempt = watched

    def step(self, abort_probability=0.0):
        schedule = self.scheduler.schedule()
        fed = sum(s.num_prompt_tokens or s.request.num_step_tokens() for s in schedule.scheduled)
        assert fed <= self.scheduler.max_num_batched_tokens or len(schedule.scheduled) == 1
        work = []
        for item in schedule.scheduled:
            request = item.request
            if item.num_prompt_tokens:
                start = request.num_prefilled_tokens
                slots = request.kv.prefill_slots(item.num_prompt_tokens)
                request.num_prefilled_tokens += item.num_prompt_tokens
                work.append((request, [(0, slots, start)], 0))
            else:
                num_tokens = request.num_feed_tokens
                position = len(request.prompt) + request.num_fed
                slots = request.kv.decode_slots(num_tokens)
                work.append((request, [(i, s, position) for i, s in enumerate(slots)], num_tokens))
            self.check_counts()
        self.apply_copies()
        for request, seqs, _ in work:  # the forward pass: write every token, then read
            for seq, slots, position in seqs:
                self.write(request, seq, slots, position)
            for seq, slots, position in seqs:
                self.check_reads(request, seq, position + len(next(iter(slots.values()), [])))
        for request, _, num_fed in work:
            request.kv.register_computed(request.num_prefilled_tokens)
            if self.rng.random() < abort_probability:
                self.finish(request, aborted=True)
                continue
            if not request.prompt_done:
                continue
            if request.resuming:  # the prompt is back: fork it into the live beams, to re-feed them
                request.resuming = False
                request.kv.reorder([0] * len(request.beams))
                continue
            request.num_fed += num_fed
            if request.beams and request.num_fed < len(request.beams[0]):
                continue  # re-feeding: these tokens were chosen before
            self.advance(request)
            request.num_fed = len(request.beams[0]) - 1 if request.beams else 0
        self.check_counts()

    def run(self, max_steps=20_000, abort_probability=0.0):
        super().run(max_steps, abort_probability)
        counts = {i: self.preempted.count(i) for i in set(self.preempted)}
        if self.scheduler.policy == "max_utilization":
            assert max(counts.values(), default=0) <= self.max_preemptions, counts


def run_workload(policy, seed, tokens_per_block, window_tokens, with_sliding, num_full_blocks,
                 num_sliding_blocks, chunk, num_pins, abort_probability, max_preemptions):
    """test_prefix_cache_traces.py's random workload (its checks included) under `policy`, with
    preemptible requests; None if the pin does not fit, else (simulator, admitted, rejected)."""
    def new_simulator(cache, chunk, rng):
        return PolicySimulator(cache, chunk, rng, policy, max_preemptions)

    return run_random_workload(seed, tokens_per_block, window_tokens, with_sliding, num_full_blocks,
                               num_sliding_blocks, chunk, num_pins, abort_probability, new_simulator,
                               PreemptibleRequest)


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), tokens_per_block=st.sampled_from([1, 2, 4, 8]),
       window_tokens=st.integers(2, 24), with_sliding=st.booleans(), num_full_blocks=st.integers(8, 80),
       num_sliding_blocks=st.integers(6, 40), chunk=st.integers(3, 48), num_pins=st.integers(0, 1),
       abort_probability=st.sampled_from([0.0, 0.05]), max_preemptions=st.integers(0, 3))
def test_random_workloads_under_both_policies(seed, tokens_per_block, window_tokens, with_sliding,
                                              num_full_blocks,
                                              num_sliding_blocks, chunk, num_pins, abort_probability,
                                              max_preemptions):
    args = (seed, tokens_per_block, window_tokens, with_sliding, num_full_blocks, num_sliding_blocks, chunk,
            num_pins, abort_probability, max_preemptions)
    results = {policy: run_workload(policy, *args) for policy in POLICIES}
    if results["guaranteed_no_evict"] is None:
        return  # the pin itself does not fit this tiny cache: nothing to test
    (guaranteed, admitted_g, rejected_g), (utilized, admitted_u, rejected_u) = results.values()
    assert [r.request_id for r in admitted_g] == [r.request_id for r in admitted_u]  # the same rejections
    assert rejected_g == rejected_u
    assert guaranteed.scheduler.num_preemptions == 0
    if not abort_probability:  # each request's beams come from its own generator: preemption changes none
        assert utilized.outputs == guaranteed.outputs


def crowd(cache, num_requests, prompt_len, new_tokens, width):
    return [PreemptibleRequest(f"r{i}", cache, [100 * i + j for j in range(prompt_len)], new_tokens, width,
                               random.Random(i)) for i in range(num_requests)]


def test_a_small_pool_preempts_and_every_request_finishes():
    cache = make_cache(40, 0, 4, 8, 64)
    sim = PolicySimulator(cache, 64, random.Random(0), "max_utilization", max_preemptions=3)
    sim.early_finish_probability = 0.0
    requests = crowd(cache, 6, 6, 12, 4)  # each needs 2 + 3 * 4 = 14 blocks at worst: 2 at once by that count
    for request in requests:
        sim.add(request)
    sim.run()
    assert sim.scheduler.stats()["preemptions"] > 0 and sim.scheduler.num_recomputed_tokens > 0
    assert all(sim.victims_were_newest), "the policy preempts the most recently admitted request first"
    assert all(request.finished for request in requests)
    assert max(request.num_preemptions for request in requests) <= 3
    assert cache["self"].pool.num_free_blocks == 40


@pytest.mark.parametrize("max_preemptions", [1, 2])
def test_a_request_preempted_k_times_runs_under_its_reservation_and_finishes(max_preemptions):
    """The oldest request, preempted K times by forced preemptions, is admitted next under its worst
    case (newer ones preempted to make room, none admitted before it), never preempted again, and
    finishes."""
    cache = make_cache(40, 0, 4, 8, 64)
    sim = PolicySimulator(cache, 64, random.Random(0), "max_utilization", max_preemptions=max_preemptions)
    sim.early_finish_probability = 0.0
    old, *newer = crowd(cache, 5, 6, 12, 4)
    for request in (old, *newer):
        sim.add(request)
    scheduler = sim.scheduler
    while old.num_preemptions < max_preemptions:
        sim.step()
        if old in scheduler.running and old.beams:
            scheduler.preempt(old.request_id)
    assert old in scheduler.waiting
    sim.step()
    assert old in scheduler.guaranteed, "starving: admitted under its reservation first"
    while not old.finished:
        sim.step()
        assert old.num_preemptions == max_preemptions, "a guaranteed request was preempted"
    sim.run()
    assert all(request.finished for request in newer)
    assert scheduler.stats()["guaranteed_admissions"] >= 1
