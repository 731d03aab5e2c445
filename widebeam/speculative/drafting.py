"""The engine's side of speculative decoding: its drafter, what earlier requests learned about drafting
(`DraftShapes`), a `RequestDraft` for each request, and each step as the draft policy sees it
(`DraftStep`): whether it is plain, the draft model's catch-up budget, the drafting pass, and the
step's wall time shared among the requests' rounds (speculative/policy.py weighs it)."""

from __future__ import annotations

import time
from collections.abc import Sequence

from widebeam.config import EngineConfig
from widebeam.kv.cache import KVCache
from widebeam.kv.spec import FullAttentionSpec
from widebeam.model.runner import SequenceInput
from widebeam.speculative.drafter import ModelDrafter, NgramDrafter
from widebeam.speculative.policy import DraftShapes, StepShare
from widebeam.speculative.request_draft import DraftPrompts, RequestDraft
from widebeam.speculative.round import SequenceRound


class Drafting:
    def __init__(self, engine_config: EngineConfig, drafter: ModelDrafter | NgramDrafter | None,
                 cache: KVCache):
        self.config = config = engine_config.speculative  # None: the engine does not speculate
        self.drafter = drafter
        self.num_draft_tokens = config.num_speculative_tokens if config else 0  # D
        self.max_num_batched_tokens = engine_config.scheduler.max_num_batched_tokens
        self.shapes = DraftShapes()
        # A draft model's pools; it may lag behind the target (fed only in rounds that draft) when all
        # are full-attention pools: a sliding window's released blocks could not take missed tokens.
        self.pools: tuple[str, ...] = ()
        if isinstance(drafter, ModelDrafter):
            self.pools = tuple(drafter.worker.pool_names.values())
        self.lazy = bool(self.pools) and all(type(cache[name].spec) is FullAttentionSpec
                                             for name in self.pools)
        self.prompts = DraftPrompts()
        # refed_tokens: tokens a round fed beyond each sequence's last chosen one: accepted drafts whose
        # K/V were not kept, and re-fed tokens after a preemption
        self.counts = {"rounds": 0, "steps": 0, "drafted_tokens": 0, "accepted_tokens": 0, "refed_tokens": 0}

    def new_request(self, beam_width: int, max_new_tokens: int, scoring: bool,
                    num_engine_seqs: int) -> RequestDraft | None:
        """A new request's drafting (None without speculation). A scoring request's rows are forced:
        it drafts nothing, though a draft model still holds its tokens. `num_engine_seqs`: the beams
        of every request in the engine now, so its share of the steps it will run in is known."""
        if self.config is None:
            return None
        length = None
        if not scoring:
            length = self.shapes.new_length(self.config.method, beam_width, self.num_draft_tokens,
                                            self.config.adaptive, max_new_tokens=max_new_tokens,
                                            sequences_share=beam_width / (beam_width + num_engine_seqs))
        return RequestDraft(length, self.pools, self.lazy, self.prompts)

    def step(self, scheduled: Sequence, started_s: float) -> DraftStep:
        """The step about to run `scheduled` (`ScheduledRequest`s), timed from `started_s`
        (`time.perf_counter()`, taken before scheduling)."""
        return DraftStep(self, scheduled, started_s)

    def stats(self) -> dict:
        """`{"speculative": ...}` for the engine's stats (empty without speculative decoding)."""
        if self.config is None:
            return {}
        return {"speculative": {"method": self.config.method, "model": self.config.model,
                                "num_speculative_tokens": self.num_draft_tokens, **self.counts}}


class DraftStep:
    def __init__(self, drafting: Drafting, scheduled: Sequence, started_s: float):
        self.drafting = drafting
        self.started_s = started_s
        # A draft model's first pass holds what lagging drafts missed (and, for an eager draft, the
        # step's prompt chunks) within the step's token budget, which its activation reserve is sized for.
        self.catch_up_budget = drafting.max_num_batched_tokens - (0 if drafting.lazy else sum(
            item.num_prompt_tokens for item in scheduled))
        # A request due for a measured plain round makes the whole step plain: a round's time is a
        # plain step's only when nobody in the step drafts (speculative/policy.py).
        self.plain = any(item.request.draft is not None and item.request.draft.wants_plain_round()
                         for item in scheduled if not item.num_prompt_tokens)

    def begin_round(self, request) -> list[SequenceRound]:
        """`request.begin_round` within what is left of the step's catch-up budget."""
        rounds, num_catch_up_tokens = request.begin_round(self.catch_up_budget, self.plain)
        self.catch_up_budget -= num_catch_up_tokens
        return rounds

    def draft(self, rounds: list[SequenceRound], prefills: list[tuple[object, SequenceInput]]) -> None:
        """Fill the rounds' trees (nothing without a drafter). An eager draft model holds every prompt
        too; a lazy one catches a prompt up when it first drafts."""
        if self.drafting.drafter is None:
            return
        draft_prefills = [request.draft.prefill_input(seq) for request, seq in prefills]
        self.drafting.drafter.draft(rounds, [seq for seq in draft_prefills if seq is not None])

    def end(self, rounds_by_request: list[tuple[object, list[SequenceRound]]], ran_prefills: bool) -> None:
        """Count the rounds and tell each request's policy how its round went. The policy weighs a
        round's wall time: a step that also ran prompt chunks says nothing of it, nor one where
        others drafted of a round that drafted nothing."""
        if self.drafting.drafter is None:
            return
        for request, request_rounds in rounds_by_request:
            self._count(request.last_round_steps, request_rounds)
        round_s = None if ran_prefills else time.perf_counter() - self.started_s
        drafted = [any(len(rnd.tree) for rnd in request_rounds) for _, request_rounds in rounds_by_request]
        rounds = [rnd for _, request_rounds in rounds_by_request for rnd in request_rounds]
        num_seqs, num_nodes = len(rounds), sum(len(rnd.tree) for rnd in rounds) or 1
        for (request, request_rounds), request_drafted in zip(rounds_by_request, drafted):
            share = StepShare(len(request_rounds) / num_seqs,
                              sum(len(rnd.tree) for rnd in request_rounds) / num_nodes)
            request.draft.record_round(request.last_round_steps,
                                       round_s if request_drafted or not any(drafted) else None, share)

    def _count(self, num_steps: int, rounds: list[SequenceRound]) -> None:
        counts = self.drafting.counts
        counts["rounds"] += 1
        counts["steps"] += num_steps
        counts["drafted_tokens"] += sum(len(rnd.tree) for rnd in rounds)
        counts["accepted_tokens"] += max(num_steps - 1, 0) * len(rounds)
        counts["refed_tokens"] += sum(rnd.num_pending - 1 for rnd in rounds)
