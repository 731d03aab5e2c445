"""One request's drafting: how many nodes its next round drafts (its `DraftLength`), what a draft
model holds of it, and what the draft policy hears of each round. The engine makes one per request
when it speculates (speculative/drafting.py); `Request.draft` is None otherwise.

A draft model's cache is lazy when all its pools are full-attention: a round that drafts nothing
does not feed the draft, whose cache then lags at `tokens` tokens per live sequence (the same for
all: beams fork from sequences that had it, and share their blocks up to there); the next round
that drafts feeds each sequence what it missed first (`_feed`). Eager: every round feeds the draft
its pending tokens (a draft with sliding-window pools: blocks behind its window are released, so
missed tokens could not be written later).
"""

from __future__ import annotations

from collections.abc import Callable

from widebeam.kv.request_kv import RequestKV
from widebeam.model.runner import SequenceInput
from widebeam.speculative.policy import ALONE, DraftLength, StepShare
from widebeam.speculative.replay import ReplayedRound
from widebeam.speculative.round import SequenceRound

# what the draft's first pass feeds each sequence this round: positions [start, end), None: nothing
CatchUpRanges = list[tuple[int, int] | None]


class DraftPrompts:
    """Whether the draft model holds the K/V of every prompt in the prefix cache: true until a lazy
    draft first skips a prompt (`RequestDraft.prefill_input`); from then a prefix hit's blocks may
    hold no draft K/V, so a request's draft holds none of a hit and catches it up if it drafts."""

    def __init__(self) -> None:
        self.whole = True


class RequestDraft:
    def __init__(self, length: DraftLength | None, pools: tuple[str, ...] = (), lazy: bool = False,
                 prompts: DraftPrompts | None = None):
        self.length = length  # how many nodes to draft next round (None: it drafts nothing, e.g. scoring)
        self.pools = pools  # the draft model's pools (empty: no draft model)
        self.lazy = lazy
        self.tokens = 0  # positions of every live sequence the draft holds
        # Leading prompt positions the draft holds (fed to it, or in prefix-cache blocks, which hold the
        # draft's K/V of every prompt fed to it): a lazy draft skips the prompt of a request that starts
        # backed off (`prefill_input`).
        self._prompt_tokens = 0
        self.prompts = prompts or DraftPrompts()  # the engine's: shared by its requests
        self._ranges: CatchUpRanges | None = None  # what the round being built feeds a lagging draft
        self._tokens_after: int | None = None  # `tokens` once the round being run ends
        self._round_timed = True  # whether the latest round's wall time says what drafting costs
        self._unrecorded_nodes: int | None = None  # the latest round's drafted nodes, for the policy

    # -- the prompt ----------------------------------------------------------------------------------
    def take_hit(self, num_tokens: int) -> None:
        """The request starts from `num_tokens` cached prompt tokens: the draft holds them too unless
        a lazy draft skipped some prompt (`DraftPrompts`)."""
        self._prompt_tokens = num_tokens if self.prompts.whole else 0

    def prefill_input(self, chunk: SequenceInput) -> SequenceInput | None:
        """Prompt chunk `chunk` if the draft model takes it, else None. An eager draft takes every
        chunk; a lazy one skips the prompt of a request that starts backed off (earlier requests of
        its shape lost by drafting: speculative/policy.py), which then catches the prompt up if it
        ever drafts, so a request that never drafts costs the draft nothing."""
        if not self.pools:
            return None
        takes = not self.lazy or (chunk.num_computed_tokens == self._prompt_tokens
                                  and not (self.length and self.length.backed_off))
        if not takes:
            self.prompts.whole = False
            return None
        self._prompt_tokens = chunk.num_computed_tokens + len(chunk.token_ids)
        return chunk

    def prompt_done(self) -> None:
        self.tokens = self._prompt_tokens

    def reset(self) -> None:
        """Preempted: every block went, the draft's with them."""
        self.tokens = self._prompt_tokens = 0

    # -- a round ---------------------------------------------------------------------------------------
    def wants_plain_round(self) -> bool:
        """Whether the draft policy measures a plain round next (the engine then runs a plain step)."""
        return self.length is not None and self.length.wants_plain_round()

    def plan_round(self, kv: RequestKV, committed: int, num_fed: int, num_seqs: int, *, refeeding: bool,
                   plain: bool, may_draft: bool, max_catch_up_tokens: int | None) -> tuple[int, int]:
        """(nodes to draft per sequence, missed tokens a lagging draft catches up) for the next round,
        before its slots are taken: nothing is drafted while re-feeding after a preemption, in a
        `plain` step (another request measures a plain round), or where `may_draft` is false (the
        last token's round: no catch-up for it either, its D slots taken as counted). A lagging draft
        catches up at most `max_catch_up_tokens` (all sequences together; None: no limit) and drafts
        nothing until it has caught up."""
        num_nodes = 0 if self.length is None or refeeding else self.length.next_num_nodes()
        if plain:
            num_nodes = 0
        self._round_timed, self._tokens_after, self._ranges = True, None, None
        num_catch_up_tokens = 0
        if self.lazy and num_nodes and may_draft:
            self._ranges, num_catch_up_tokens = self._catch_up_ranges(kv, committed, num_fed, num_seqs,
                                                                      max_catch_up_tokens)
            if self._ranges is None or self._ranges[0][1] <= committed:
                # Too far behind for this step's budget: it catches up what fits (if anything) and
                # drafts nothing; a round that fed the draft is not a plain round's time either.
                num_nodes, self._round_timed = 0, self._ranges is None
        return num_nodes, num_catch_up_tokens

    def feed(self, rounds: list[SequenceRound], kv: RequestKV, history: Callable[[int], list[int]]) -> None:
        """Set what the draft's first pass of the round feeds each sequence (`draft_feed`): an eager
        draft its pending tokens, a lagging one what `plan_round` planned. `history(i)`: sequence
        i's prompt and generated tokens."""
        if self.pools and not self.lazy:
            for rnd in rounds:  # eager: the draft's cache holds every token the target's holds
                rnd.draft_feed = rnd.pending_input()
        elif self._ranges is not None:
            self._tokens_after = self._ranges[0][1]
            for i, (rnd, positions) in enumerate(zip(rounds, self._ranges)):
                if positions is not None:
                    rnd.draft_feed = self._feed(kv, history(i), i, rnd, *positions)

    def _catch_up_ranges(self, kv: RequestKV, committed: int, num_fed: int, num_seqs: int,
                         max_tokens: int | None) -> tuple[CatchUpRanges | None, int]:
        """(what a lagging draft's first pass feeds each sequence this round (None: nothing at all; a
        sequence's None: nothing for it), the missed tokens that catches up). The draft holds
        positions [0, tokens) of every sequence (none of the prompt until the request first drafts).
        The missed positions in blocks every sequence shares (the prompt, the common past) are fed
        once, by sequence 0; the rest by each sequence; then the pending tokens. All of it within
        `max_tokens` (None: no limit); past it only what fits is caught up (sequence 0's shared part
        first) and the round drafts nothing (the last range ends at or before `committed`)."""
        start = self.tokens
        shared_end = max(start, min(committed, kv.num_common_tokens(self.pools)))
        num_shared, num_own = shared_end - start, committed - shared_end
        budget = None if max_tokens is None else max(0, max_tokens)
        if budget is None or num_shared + num_own * num_seqs <= budget:
            end = committed + num_fed
            return [(start, end)] + [(shared_end, end)] * (num_seqs - 1), num_shared + num_own * num_seqs
        if num_shared:
            n = min(num_shared, budget)
            return ([(start, start + n)] + [None] * (num_seqs - 1) if n else None), n
        cap = budget // num_seqs
        return ([(start, start + cap)] * num_seqs if cap else None), cap * num_seqs

    def _feed(self, kv: RequestKV, history: list[int], seq_index: int, rnd: SequenceRound, start: int,
              end: int) -> SequenceInput:
        """Sequence `seq_index`'s tokens at positions [start, end) for the draft model: those it missed
        while it lagged (positions the target's cache holds: their blocks are allocated in the draft's
        pools too, forked with the target's) and the round's pending ones."""
        slots = kv.written_slots(seq_index, start, end, self.pools)
        return SequenceInput(history[start:end], start, rnd.block_tables, slots, rnd.group)

    # -- after a round -------------------------------------------------------------------------------
    def end_round(self, rounds: list[SequenceRound]) -> None:
        """The round ran: the draft holds what it was fed; the policy will hear what was drafted, not
        what was asked for (a prompt lookup that found nothing ran a plain step at a plain step's
        cost, so the policy hears of a plain round)."""
        if self._tokens_after is not None:
            self.tokens = self._tokens_after
        self._unrecorded_nodes = max(len(rnd.tree) for rnd in rounds)

    def keep_accepted(self, rounds: list[SequenceRound], replayed: ReplayedRound) -> int:
        """Accepted nodes whose K/V every chosen sequence keeps, so the next round does not feed them
        again (`DraftTree.num_kept`; with a draft model, only nodes it was fed too, which it then
        holds: a level of its tree). The same count for every sequence: a request's sequences stay
        the same length."""
        draft_fed = bool(self.pools)
        num_kept = min((rounds[parent].tree.num_kept(path, draft_fed)
                        for parent, path in zip(replayed.parent_indices, replayed.paths)), default=0)
        if self._tokens_after is not None:
            self.tokens += num_kept
        return num_kept

    def record_round(self, num_steps: int, round_s: float | None, share: StepShare = ALONE) -> None:
        """Tell the draft policy how the latest round went: its `num_steps` and, when the step ran
        rounds alone, its wall time and this request's share of the step. A re-feed round (nothing
        chosen) tells nothing."""
        if self.length is not None and self._unrecorded_nodes is not None:
            self.length.record(self._unrecorded_nodes, num_steps, round_s if self._round_timed else None,
                               share)
        self._unrecorded_nodes = None
