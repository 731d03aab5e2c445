"""Continuous batching without eviction of anything in use.

Every step the scheduler fills a token budget (`max_num_batched_tokens`): first one decode token
per live sequence of the running requests, then the next chunk of prompts still being prefilled,
then new requests from the waiting queue in FCFS order. A waiting request is admitted only when
its `required_blocks` fit in every pool beside the *remaining* worst case of every running request
(its required blocks minus the distinct blocks its beam tree holds now), so a running request can
always take the blocks it may still need and nothing in use is ever evicted (only cached prompt
blocks no request holds, which count as free: kv/block_pool.py). A request whose prompt is cached
takes those blocks at admission; the ones other requests already hold cost it nothing (pools that
copy in-use hits excepted: kv/pool_manager.py: `PoolManager.shares_hits`). The queue head waits when it
does not fit; it is never skipped, never dropped, and never spins: requests that can never fit are
rejected at admission, before they are queued.

This is the `guaranteed_no_evict` policy; `max_utilization` (sched/preemption.py) builds on it. Under
either, `preempt` takes a running request's blocks back: it waits at the head of its priority in the
queue and resumes by recomputation (`Request.preempt`), its outputs unchanged.

Priorities (vLLM's semantics: `params.priority`, lower first): the queue is kept in priority order,
arrival order within one. The starvation guard: a waiting request is overtaken by later arrivals of
a higher priority at most `MAX_OVERTAKES` times; after that nothing newer goes ahead of it. With
`priority_preemption` on, a queue head that does not fit preempts running requests of a lower
priority (the lowest first, the most recently admitted among equals) until it fits; a request is
preempted so at most `max_preemptions` times, then runs to its end. Admission then counts the
re-feed a preempted request needs (`refeeds_after_preemption`), so a resumed request always fits.

Priority covers compute too, with `priority_yield` N: in continuous batching a small request shares every
step with the wide searches beside it, so its tokens come at their step's pace. While requests of more
than one priority run, steps that run only the most urgent priority (and admit nobody less urgent) take
N - 1 parts in N of the time, and steps that run everyone the rest: after a step that ran the others,
urgent-only steps follow until they have taken N - 1 times that step's duration. Time, not a count of
steps, because a wide search's step costs twenty or more of a greedy request's; the urgent requests'
tokens then come at most about N / (N - 1) times slower than alone. The others keep their blocks and
state; what it costs them: while urgent work runs, they advance at about 1/N of their pace
(docs/scheduling-and-capacity.md measures it).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from widebeam.kv.cache import KVCache
from widebeam.kv.prefix import PrefixHit
from widebeam.kv.request_kv import RequestKV
from widebeam.sched.admission import Admission

# A waiting request lets at most this many later arrivals of a higher priority go ahead of it.
MAX_OVERTAKES = 32


class SchedulableRequest(Protocol):
    """What the scheduler reads of a request (widebeam/request.py's `Request` is one). Its blocks
    it asks of the request's `RequestKV` directly; `take_prefix_hit` and `preempt` are the
    request's own lifecycle."""

    request_id: str
    priority: int  # lower is served first
    admission: Admission
    kv: RequestKV
    num_preemptions: int  # times the scheduler took its blocks back
    split: object | None  # a round being fed over several steps (request.py: `SplitRound`), or None

    @property
    def prompt_done(self) -> bool: ...

    @property
    def num_prompt_tokens_left(self) -> int: ...

    @property
    def num_feed_tokens(self) -> int:
        """Tokens each live sequence feeds in its next decode step."""
        ...

    def num_step_tokens(self, num_draft_tokens: int = 0) -> int: ...

    def num_round_tokens(self, num_draft_tokens: int = 0) -> int:
        """Tokens per live sequence its next round takes slots for (drafted ones included)."""
        ...

    def num_splittable_rows(self, num_draft_tokens: int = 0) -> int:
        """Rows (one token each) its round still has to feed when they may be fed over several steps;
        0: the round goes whole."""
        ...

    def take_prefix_hit(self, hit: PrefixHit) -> None: ...

    def preempt(self, max_feed_tokens: int | None = None) -> int: ...


@dataclass
class ScheduledRequest:
    request: SchedulableRequest
    num_prompt_tokens: int  # > 0: a prefill chunk of that many prompt tokens; 0: decode
    num_rows: int | None = None  # a decode of only this many of its round's rows; None: all left


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_batched_tokens: int = 0


class Scheduler:
    policy = "guaranteed_no_evict"

    def __init__(self, cache: KVCache, max_num_batched_tokens: int, num_draft_tokens: int = 0,
                 priority_preemption: bool = False, max_preemptions: int = 3, priority_yield: int = 0,
                 clock: Callable[[], float] = time.monotonic):
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        self.cache = cache
        self.max_num_batched_tokens = max_num_batched_tokens
        self.num_draft_tokens = num_draft_tokens  # D drafted tokens per sequence each speculative step
        self.priority_preemption = priority_preemption
        self.max_preemptions = max_preemptions
        self.priority_yield = priority_yield
        # `priority_yield`'s account: the previous step's start and whether it ran only the urgent, the
        # duration of the last step that ran everyone, the urgent-only time since.
        self.clock = clock
        self._step_started_s: float | None = None
        self._step_yielded = False
        self._everyone_step_s = 0.0
        self._urgent_only_s = 0.0
        self.waiting: deque[SchedulableRequest] = deque()
        self._overtakes: dict[str, int] = {}  # request id -> later arrivals let ahead of it
        self.running: list[SchedulableRequest] = []  # in the order they were admitted
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0  # tokens computed again by preempted requests (prefix hits excepted)
        # A resumed request re-feeds its generated tokens this many a step in all (one per sequence
        # where a pool's bound assumes one token per sequence a step: a sliding window).
        self.max_refeed_tokens = cache.max_refeed_tokens(max_num_batched_tokens)

    def add(self, request: SchedulableRequest) -> None:
        """Queue a new request behind every waiting one of the same or a higher priority, and behind any
        that was overtaken MAX_OVERTAKES times (the starvation guard)."""
        index = len(self.waiting)
        while index > 0:
            before = self.waiting[index - 1]
            guarded = self._overtakes.get(before.request_id, 0) >= MAX_OVERTAKES
            if before.priority <= request.priority or guarded:
                break
            index -= 1
        for overtaken in list(self.waiting)[index:]:
            self._overtakes[overtaken.request_id] = self._overtakes.get(overtaken.request_id, 0) + 1
        self.waiting.insert(index, request)

    def remove(self, request: SchedulableRequest) -> None:
        self._overtakes.pop(request.request_id, None)
        if request in self.waiting:
            self.waiting.remove(request)
        if request in self.running:
            self.running.remove(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def stats(self) -> dict:
        return {"policy": self.policy, "preemptions": self.num_preemptions,
                "recomputed_tokens": self.num_recomputed_tokens}

    def preempt(self, request_id: str) -> bool:
        """Take a running request's blocks back now (a test's or an operator's choice; the
        `max_utilization` policy does it when a step runs short). It waits at the head of the queue
        and resumes by recomputation, its outputs unchanged. False if no such request is running."""
        for request in self.running:
            if request.request_id == request_id:
                self._preempt(request)
                return True
        return False

    def _preempt(self, request: SchedulableRequest) -> None:
        self.running.remove(request)
        self.num_recomputed_tokens += request.preempt(self.max_refeed_tokens)
        self.num_preemptions += 1
        self.waiting.insert(self._requeue_index(request), request)

    def _requeue_index(self, request: SchedulableRequest) -> int:
        """Where a preempted request waits: at the head of its priority (behind higher ones)."""
        index = 0
        while index < len(self.waiting) and self.waiting[index].priority < request.priority:
            index += 1
        return index

    def _make_room_for_head(self) -> None:
        """`priority_preemption`: preempt running requests of a lower priority than the queue's head,
        the lowest first, until the head's reservation fits (or none is left to preempt)."""
        while self.priority_preemption and self.waiting:
            head = self.waiting[0]
            if self._fits_now(head):
                return
            victims = [r for r in self.running if r.priority > head.priority
                       and r.num_preemptions < self.max_preemptions]
            if not victims:
                return
            # the lowest priority; among equals the most recently admitted (the last in `running`)
            self._preempt(max(reversed(victims), key=lambda r: r.priority))

    def _yielding_to(self) -> int | None:
        """With `priority_yield` N: the most urgent running priority when this step runs it alone, else
        None. The previous step's duration (from its schedule to this one) is booked first; urgent-only
        steps run until they have taken N - 1 times the duration of the last step that ran everyone."""
        if not self.priority_yield:
            return None
        now = self.clock()
        # (A span that includes idle time ends a step that ran everyone, and the next step, which finds
        # nothing running, runs everyone too and replaces it.)
        if self._step_started_s is not None:
            took_s = now - self._step_started_s
            if self._step_yielded:
                self._urgent_only_s += took_s
            else:
                self._everyone_step_s, self._urgent_only_s = took_s, 0.0
        self._step_started_s = now
        self._step_yielded = False
        priorities = {r.priority for r in self.running}
        # (the prefix lookup in _fits_now only where the head would add a priority)
        if (self.running and self.waiting and self.waiting[0].priority not in priorities
                and self._fits_now(self.waiting[0])):
            # An urgent arrival's first step (its prompt and first token) is already one it runs alone.
            priorities.add(self.waiting[0].priority)
        if len(priorities) < 2 or self._urgent_only_s >= (self.priority_yield - 1) * self._everyone_step_s:
            return None
        self._step_yielded = True
        return min(priorities)

    def _fits_now(self, request: SchedulableRequest) -> bool:
        need, free = self._reservation(request, request.kv.find_hit()), self._unreserved_blocks()
        return all(blocks <= free[pool] for pool, blocks in need.items())

    def schedule(self) -> SchedulerOutput:
        self._make_room_for_head()
        out = SchedulerOutput()
        urgent = self._yielding_to()
        budget = self._schedule_running(out, urgent)
        free = self._unreserved_blocks()
        # Prompt blocks that requests still prefilling (or admitted below) are about to compute: a
        # head that shares the next of them waits a step and takes them as a hit instead of
        # computing them too (SGLang's in-batch prefix deferral).
        pending = self._pending_prompt_blocks()
        while self.waiting and budget > 0:
            head = self.waiting[0]
            if urgent is not None and head.priority > urgent:  # a step the urgent run alone
                break
            # Cached prompt blocks count as held; those already in use cost no free block, those
            # cached-evictable leave the free count as the head takes them (see _unreserved_blocks).
            hit = head.kv.find_hit()
            if head.kv.gains_by_waiting(hit, pending):
                break
            need = self._reservation(head, hit)
            if any(blocks > free[pool] for pool, blocks in need.items()):
                break
            for pool, blocks in need.items():
                free[pool] -= blocks
            budget -= self._admit(out, hit, pending, budget)
        out.num_batched_tokens = self.max_num_batched_tokens - budget
        return out

    @staticmethod
    def _reservation(request: SchedulableRequest, hit: PrefixHit) -> dict[str, int]:
        """A request's worst case less the prefix blocks it would share: what admission reserves."""
        return {pool: blocks - hit.credit_blocks.get(pool, 0)
                for pool, blocks in request.admission.required_blocks.items()}

    def _admit(self, out: SchedulerOutput, hit: PrefixHit, pending: set[bytes], budget: int) -> int:
        """Move the queue's head to the running requests with its prefix `hit` and schedule its
        first prompt chunk; returns the chunk's tokens."""
        head = self.waiting.popleft()
        self._overtakes.pop(head.request_id, None)
        head.take_prefix_hit(hit)
        self.cache.record_lookup(head.kv.key, hit)  # the hit rate counts admitted requests
        if head.num_preemptions:
            self.num_recomputed_tokens -= hit.num_tokens  # the cache still held these
        pending.update(head.kv.unnamed_prompt_blocks())
        self.running.append(head)
        chunk = min(head.num_prompt_tokens_left, budget)
        out.scheduled.append(ScheduledRequest(head, chunk))
        return chunk

    def _pending_prompt_blocks(self) -> set[bytes]:
        return {h for r in self.running if not r.prompt_done for h in r.kv.unnamed_prompt_blocks()}

    def _schedule_running(self, out: SchedulerOutput, urgent: int | None = None) -> int:
        """Schedule the running requests (only those of priority `urgent` when given: the others keep
        their blocks and wait the step); returns the token budget left."""
        budget = self.max_num_batched_tokens
        running = self.running if urgent is None else [r for r in self.running if r.priority == urgent]
        # Decodes first, those that cannot split before those that can. A round wider than what is left
        # of the budget is split: its rows are fed over several steps (one token each) and it chooses
        # once all are scored, so no step passes the budget and a narrow request beside a wide search
        # gets its token every step. A round that cannot split (drafts, re-feeds) goes whole or waits,
        # but the first one always goes, so every request makes progress.
        prefilling = [request for request in running if not request.prompt_done]
        decoding = sorted((request for request in running if request.prompt_done),
                          key=lambda request: request.num_splittable_rows(self.num_draft_tokens) > 0)
        for request in decoding:
            splittable = request.num_splittable_rows(self.num_draft_tokens)
            cost = splittable or request.num_step_tokens(self.num_draft_tokens)
            if cost <= budget or (not out.scheduled and not splittable):
                out.scheduled.append(ScheduledRequest(request, 0))
                budget -= cost
            elif splittable and budget > 0:
                out.scheduled.append(ScheduledRequest(request, 0, num_rows=budget))
                budget = 0
        for request in prefilling:
            if budget <= 0:
                break
            chunk = min(request.num_prompt_tokens_left, budget)
            out.scheduled.append(ScheduledRequest(request, chunk))
            budget -= chunk
        return budget

    def headroom_blocks(self) -> dict[str, int]:
        """Per pool, what a request arriving now could count on: the unreserved blocks less what every
        waiting request will reserve when admitted (the exact-fit router's report)."""
        room = self._unreserved_blocks()
        for request in self.waiting:
            for pool, blocks in request.admission.required_blocks.items():
                room[pool] -= blocks
        return room

    def _unreserved_blocks(self) -> dict[str, int]:
        """Blocks not in use per pool (free and cached-evictable: taking one evicts it) minus what
        running requests may still take (their required blocks minus the distinct blocks they hold,
        cache hits included)."""
        free = self.cache.num_free_blocks()
        for request in self.running:
            for pool, blocks in request.kv.remaining_blocks(request.admission.required_blocks).items():
                free[pool] -= blocks
        return free
