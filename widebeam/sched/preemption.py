"""The `max_utilization` capacity policy: admit on the next step's blocks, preempt when a step runs short.

`guaranteed_no_evict` (sched/scheduler.py) reserves every request's worst case (W beams x N tokens),
which beams that end early never use. Here, as in TensorRT-LLM's MAX_UTILIZATION, vLLM and SGLang:
- a waiting request is admitted when its first step's blocks (`RequestKV.first_step_blocks`: its prefix hit
  and first prompt chunk) fit in what is free (cached-evictable blocks count as free) after the
  running requests' own next steps and the remaining reservations of guaranteed requests (below);
- when the running requests' next steps (`RequestKV.step_blocks`) do not fit what is free, the most recently
  admitted request is preempted, as a whole (all beams of a beam request together), until they fit:
  its blocks go back, it waits at the head of the queue and resumes by recomputation
  (`Request.preempt`: prompt prefilled again, the prefix cache often still holding it, then each live
  beam's generated tokens re-fed; the decoder's beams, scores and random generator are untouched, so
  outputs do not change);
- no request is preempted forever: one preempted `max_preemptions` times (K) waits at the head of
  the queue, before any newer request, until its whole worst case (`required_blocks`) fits beside
  the reservations of the other guaranteed requests (preempting newer non-guaranteed ones to make
  room), and from then on it is never preempted. The guaranteed requests' worst cases always fit the
  pools together, so preempting every other request always gives them their blocks.
Never-fit requests are rejected at admission under both policies (sched/admission.py).
"""

from __future__ import annotations

from collections import Counter

from widebeam.kv.cache import KVCache
from widebeam.sched.scheduler import SchedulableRequest, ScheduledRequest, Scheduler, SchedulerOutput


def make_scheduler(policy: str, cache: KVCache, max_num_batched_tokens: int, max_preemptions: int,
                   num_draft_tokens: int = 0, priority_preemption: bool = False,
                   priority_yield: int = 0) -> Scheduler:
    """The scheduler of a capacity `policy` (config.py: SCHEDULING_POLICIES)."""
    if policy == MaxUtilizationScheduler.policy:
        return MaxUtilizationScheduler(cache, max_num_batched_tokens, max_preemptions, num_draft_tokens,
                                       priority_preemption, priority_yield)
    if policy != Scheduler.policy:
        raise ValueError(f"unknown scheduling policy {policy!r}")
    return Scheduler(cache, max_num_batched_tokens, num_draft_tokens, priority_preemption, max_preemptions,
                     priority_yield)


def _fits(need: dict[str, int], free: dict[str, int]) -> bool:
    return all(blocks <= free[pool] for pool, blocks in need.items())


class MaxUtilizationScheduler(Scheduler):
    policy = "max_utilization"

    def __init__(self, cache: KVCache, max_num_batched_tokens: int, max_preemptions: int,
                 num_draft_tokens: int = 0, priority_preemption: bool = False, priority_yield: int = 0):
        super().__init__(cache, max_num_batched_tokens, num_draft_tokens, priority_preemption,
                         max_preemptions, priority_yield)
        if max_preemptions < 0:
            raise ValueError(f"max_preemptions must be >= 0, got {max_preemptions}")
        self.guaranteed: set[SchedulableRequest] = set()  # running under their worst-case reservation
        self.num_guaranteed_admissions = 0

    def remove(self, request: SchedulableRequest) -> None:
        super().remove(request)
        self.guaranteed.discard(request)

    def stats(self) -> dict:
        return {**super().stats(), "max_preemptions": self.max_preemptions,
                "guaranteed_admissions": self.num_guaranteed_admissions}

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        urgent = self._yielding_to()
        self._schedule_running(out, urgent)
        self._fit_running(out)
        budget = self.max_num_batched_tokens - sum(self._tokens(item) for item in out.scheduled)
        pending = self._pending_prompt_blocks()
        while self.waiting and budget > 0:
            head = self.waiting[0]
            if urgent is not None and head.priority > urgent:  # a step the urgent run alone
                break
            hit = head.kv.find_hit()
            if head.kv.gains_by_waiting(hit, pending):
                break
            if self._starving(head):
                # its whole worst case; room is made by preempting newer requests, and if even that
                # is not enough the guaranteed ones finish first (nothing newer is admitted meanwhile)
                while (not _fits(self._reservation(head, hit), self._available(out))
                       and self._victim() is not None):
                    self._preempt_scheduled(out, self._victim())
                    hit = head.kv.find_hit()  # the victim's blocks may be cached now, no longer shared
                if not _fits(self._reservation(head, hit), self._available(out)):
                    break
                self.guaranteed.add(head)
                self.num_guaranteed_admissions += 1
            else:
                chunk = min(head.num_prompt_tokens_left - hit.num_tokens, budget)
                if not _fits(head.kv.first_step_blocks(hit, chunk), self._available(out)):
                    break
            budget -= self._admit(out, hit, pending, budget)
        out.num_batched_tokens = self.max_num_batched_tokens - budget
        return out

    # -- preemption -------------------------------------------------------------------------------
    def _fit_running(self, out: SchedulerOutput) -> None:
        """Preempt the most recently admitted non-guaranteed requests until the scheduled steps'
        blocks fit what is free. With none left to preempt, the steps go as they are: guaranteed
        requests' blocks are there by their reservations."""
        while True:
            need: Counter[str] = Counter()
            for item in out.scheduled:
                need.update(self._step_need(item))
            if _fits(need, self.cache.num_free_blocks()):
                return
            victim = self._victim()
            if victim is None:
                return
            self._preempt_scheduled(out, victim)

    def _preempt_scheduled(self, out: SchedulerOutput, victim: SchedulableRequest) -> None:
        self._preempt(victim)
        out.scheduled = [item for item in out.scheduled if item.request is not victim]

    def _victim(self) -> SchedulableRequest | None:
        """The running request that is not guaranteed of the lowest priority, the most recently
        admitted among equals (with one priority: the most recently admitted)."""
        candidates = [request for request in reversed(self.running) if request not in self.guaranteed]
        return max(candidates, key=lambda request: request.priority) if candidates else None

    def _make_room_for_head(self) -> None:
        """max_utilization makes room for the head its own way (`_fit_running`, the starving head)."""

    def _starving(self, request: SchedulableRequest) -> bool:
        return request.num_preemptions >= self.max_preemptions

    def _requeue_index(self, request: SchedulableRequest) -> int:
        """At the head of its priority, behind the starving requests already there."""
        index = super()._requeue_index(request)
        while index < len(self.waiting) and self._starving(self.waiting[index]):
            index += 1
        return index

    # -- blocks -----------------------------------------------------------------------------------
    def _available(self, out: SchedulerOutput) -> dict[str, int]:
        """Free blocks (cached-evictable included) less the scheduled steps of non-guaranteed
        requests and the remaining worst cases of guaranteed ones (their steps included)."""
        free = self.cache.num_free_blocks()
        for item in out.scheduled:
            if item.request not in self.guaranteed:
                for pool, blocks in self._step_need(item).items():
                    free[pool] -= blocks
        for request in self.guaranteed:
            for pool, blocks in request.kv.remaining_blocks(request.admission.required_blocks).items():
                free[pool] -= blocks
        return free

    def _step_need(self, item: ScheduledRequest) -> dict[str, int]:
        request = item.request
        if request.split is not None:
            return {}  # a split round's later parts: its first took every sequence's slot
        # a round takes its drafted nodes' slots too (rolled back after, but held during the step)
        return request.kv.step_blocks(item.num_prompt_tokens
                                      or request.num_round_tokens(self.num_draft_tokens))

    def _tokens(self, item: ScheduledRequest) -> int:
        if item.num_prompt_tokens:
            return item.num_prompt_tokens
        return (item.num_rows or item.request.num_splittable_rows(self.num_draft_tokens)
                or item.request.num_step_tokens(self.num_draft_tokens))
