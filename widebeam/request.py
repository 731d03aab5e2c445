"""One request: data and lifecycle around a decoder, its KV (`RequestKV`) and its output stream.

The request owns no policy: the KV coordinator does every allocation (prompt once, beams forked,
pruned branches released, copies queued), the decoder chooses tokens, the output stream keeps the
text and stop strings (decoding/stream.py), and a round's replay lives in speculative/replay.py.
What is left here is where the request stands: its prompt chunks, each live sequence's pending
tokens, its rounds, preemption and resumption. See docs/architecture.md for one request's path.

Every decode step is a round (speculative/round.py): each live sequence feeds its pending tokens
and D >= 0 drafted nodes; D = 0 is a plain decode step. An encoder-decoder request's prompt is its
source (`encoder_token_ids`): the engine encodes it once, into the per-request cross table every
beam reads, and the decoder prompt is the decoder start token.
"""

from __future__ import annotations

from widebeam.decoding.decoders import BeamDecoder, SamplingDecoder, StepScores
from widebeam.decoding.stream import BeamStream, SampledStream
from widebeam.kv.request_kv import RequestKV
from widebeam.logprobs import with_token_text
from widebeam.model.runner import SequenceInput
from widebeam.outputs import CompletionOutput, RequestDelta, RequestOutput
from widebeam.sched.admission import Admission
from widebeam.speculative.policy import ALONE, DraftLength, StepShare
from widebeam.speculative.replay import ReplayedRound, replay_round
from widebeam.speculative.round import SequenceRound
from widebeam.speculative.tree import DraftTree, branching_for_width


class DraftPrompts:
    """Whether the draft model holds the K/V of every prompt in the prefix cache: true until a lazy
    draft first skips a prompt (`Request.draft_prefill_input`); from then a prefix hit's blocks may
    hold no draft K/V, so a request's draft holds none of a hit and catches it up if it drafts."""

    def __init__(self) -> None:
        self.whole = True


class Request:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 admission: Admission, kv: RequestKV, decoder: SamplingDecoder | BeamDecoder,
                 stream: SampledStream | BeamStream, encoder_token_ids: list[int] | None = None,
                 draft_length: DraftLength | None = None, draft_pools: tuple[str, ...] = (),
                 lazy_draft: bool = False, draft_prompts: DraftPrompts | None = None):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.admission = admission
        self.kv = kv
        self.decoder = decoder
        self.stream = stream
        self.params = decoder.params
        self.encoder_token_ids = encoder_token_ids
        self.draft_length = draft_length  # how many nodes to draft next round (None: no drafter)
        # A draft model's pools (empty: no draft model). Lazy: a round that drafts nothing does not feed
        # the draft, whose cache then lags at `draft_tokens` tokens per live sequence (the same for all:
        # beams fork from sequences that had it, and share their blocks up to there); the next round
        # that drafts feeds each sequence what it missed first (`_draft_feed`). Eager: every round feeds
        # the draft its pending tokens (a draft with sliding-window pools: blocks behind its window are
        # released, so missed tokens could not be written later).
        self.draft_pools = draft_pools
        self.lazy_draft = lazy_draft
        self.draft_tokens = 0
        # Leading prompt positions the draft holds (fed to it, or in prefix-cache blocks, which hold the
        # draft's K/V of every prompt fed to it): a lazy draft skips the prompt of a request that starts
        # backed off (`draft_prefill_input`).
        self._draft_prompt_tokens = 0
        self.draft_prompts = draft_prompts or DraftPrompts()  # the engine's: shared by its requests
        self.num_catch_up_tokens = 0  # missed tokens the latest round's draft pass catches up
        self._draft_tokens_after: int | None = None  # draft_tokens once the round being run ends
        self._round_timed = True  # whether the latest round's wall time says what drafting costs
        self.num_prefilled_tokens = 0
        # What each live sequence feeds next: its last chosen token, after a round that accepted
        # drafted nodes also those whose drafted K/V were not kept (`_num_kept_nodes`).
        self.pending_token_ids: list[list[int]] = []
        self.completions: list[CompletionOutput] | None = None  # set when it finishes
        self.last_round_steps = 0  # decoder steps the latest round took
        self._unrecorded_round_nodes: int | None = None  # the latest round's drafted nodes, for the policy
        self.num_preemptions = 0  # times the scheduler took its blocks back (it resumed by recomputation)
        self.max_feed_tokens: int | None = None  # after a preemption: the most tokens one re-feed step feeds
        self._num_fed_tokens = 1  # tokens per sequence the latest round fed
        self._earlier_peak_blocks: dict[str, int] = {}  # peaks held before the latest preemption

    @property
    def finished(self) -> bool:
        return self.completions is not None

    @property
    def prompt_done(self) -> bool:
        return self.num_prefilled_tokens == len(self.prompt_token_ids)

    @property
    def num_prompt_tokens_left(self) -> int:
        return len(self.prompt_token_ids) - self.num_prefilled_tokens

    @property
    def num_feed_tokens(self) -> int:
        """Tokens each live sequence feeds in its next round: all its pending ones, but
        `max_feed_tokens` at a time in all (at least one each) while it re-feeds after a preemption."""
        num_pending = len(self.pending_token_ids[0]) if self.pending_token_ids else 0
        if self.max_feed_tokens is None:
            return num_pending
        return min(num_pending, max(1, self.max_feed_tokens // len(self.pending_token_ids)))

    def num_step_tokens(self, num_draft_tokens: int = 0) -> int:
        """Tokens a round of this request feeds: the pending tokens of every live sequence it feeds
        now (`num_feed_tokens`), and up to `num_draft_tokens` drafted ones each when speculating."""
        num_fed = self.num_feed_tokens
        return sum(min(len(pending), num_fed) + num_draft_tokens for pending in self.pending_token_ids)

    def num_round_tokens(self, num_draft_tokens: int = 0) -> int:
        """Tokens per live sequence the next round takes slots for: those it feeds, and up to
        `num_draft_tokens` drafted ones unless it is re-feeding after a preemption."""
        num_fed = self.num_feed_tokens
        return num_fed + (num_draft_tokens if num_fed == len(self.pending_token_ids[0]) else 0)

    def take_prefix_hit(self, hit) -> None:
        """Admitted: start from the cached blocks; the prefill begins after them (and skips the
        encoder when its output was cached)."""
        self.kv.take_hit(hit)
        self.kv.cache.record_lookup(self.kv.key, hit)
        self.num_prefilled_tokens = hit.num_tokens
        self._draft_prompt_tokens = hit.num_tokens if self.draft_prompts.whole else 0

    # -- building a step ---------------------------------------------------------------------------
    def encoder_input(self) -> tuple[list[int], dict[str, list[int]]] | None:
        """(source tokens, cross slots per pool) the first time an encoder-decoder request runs;
        None when there is nothing to encode."""
        if self.encoder_token_ids is None or self.kv.shared_tables:
            return None
        return self.encoder_token_ids, self.kv.allocate_shared(len(self.encoder_token_ids))

    def prefill_input(self, num_tokens: int) -> SequenceInput:
        """The next `num_tokens` prompt tokens, as one sequence: the prompt is stored once."""
        start = self.num_prefilled_tokens
        slots = self.kv.prefill_slots(num_tokens)
        self.num_prefilled_tokens += num_tokens
        tables, cross = self._tables(0)
        return SequenceInput(self.prompt_token_ids[start:start + num_tokens], start, tables, slots,
                             self.request_id, *cross)

    def draft_prefill_input(self, chunk: SequenceInput) -> SequenceInput | None:
        """Prompt chunk `chunk` if the draft model takes it, else None. An eager draft takes every
        chunk; a lazy one skips the prompt of a request that starts backed off (earlier requests of
        its shape lost by drafting: speculative/policy.py), which then catches the prompt up if it
        ever drafts, so a request that never drafts costs the draft nothing."""
        if not self.draft_pools:
            return None
        takes = not self.lazy_draft or (chunk.num_computed_tokens == self._draft_prompt_tokens
                                        and not (self.draft_length and self.draft_length.backed_off))
        if not takes:
            self.draft_prompts.whole = False
            return None
        self._draft_prompt_tokens = chunk.num_computed_tokens + len(chunk.token_ids)
        return chunk

    def wants_plain_round(self) -> bool:
        """Whether the draft policy measures a plain round next (the engine then runs a plain step)."""
        return self.draft_length is not None and self.draft_length.wants_plain_round()

    def begin_round(self, max_catch_up_tokens: int | None = None, plain: bool = False) -> list[SequenceRound]:
        """Take slots for every live sequence's pending tokens (those it feeds now) and the nodes it
        may draft, in every pool at once, and describe the round (a drafter, if any, fills the trees).
        While re-feeding after a preemption nothing is drafted. With a draft model, each sequence's
        `draft_feed` says what the draft's first pass feeds (see `lazy_draft` in `__init__`): a lagging
        draft catches up at most `max_catch_up_tokens` missed tokens (all sequences together; None: no
        limit) and drafts nothing until it has caught up; `num_catch_up_tokens` says how many it took.
        `plain`: the step is plain (another request measures a plain round): nothing is drafted."""
        num_fed = self._num_fed_tokens = self.num_feed_tokens
        refeeding = num_fed < len(self.pending_token_ids[0])
        num_nodes = 0 if self.draft_length is None or refeeding else self.draft_length.next_num_nodes()
        if plain:
            num_nodes = 0
        generated = self.decoder.num_generated_tokens
        committed = len(self.prompt_token_ids) + generated - len(self.pending_token_ids[0])
        self._round_timed, self._draft_tokens_after = True, None
        self.num_catch_up_tokens = 0
        # lazy draft: per sequence, the positions [start, end) its first pass feeds (None: nothing)
        draft_ranges: list[tuple[int, int] | None] | None = None
        # (the last token's round drafts nothing: no catch-up for it, its D slots taken as counted)
        if self.lazy_draft and num_nodes and self.admission.max_new_tokens - generated - 1 > 0:
            draft_ranges = self._catch_up_ranges(committed, num_fed, max_catch_up_tokens)
            if draft_ranges is None or draft_ranges[0][1] <= committed:
                # Too far behind for this step's budget: it catches up what fits (if anything) and
                # drafts nothing; a round that fed the draft is not a plain round's time either.
                num_nodes, self._round_timed = 0, draft_ranges is None
        slots = self.kv.decode_slots(num_fed + num_nodes)
        # A round takes at most depth + 1 steps and never passes max_new_tokens, so deeper nodes
        # would be wasted (and would sit past the positions admission checked).
        max_depth = min(num_nodes, max(0, self.admission.max_new_tokens - generated - 1))
        branching = branching_for_width(self.params.beam_width)
        # what prompt lookup searches: built only for a round that drafts
        live_token_ids = self.decoder.live_token_ids if num_nodes else []
        rounds = []
        for i, pending in enumerate(self.pending_token_ids):
            history = self.prompt_token_ids + live_token_ids[i] if num_nodes else []
            tables, (cross_table, num_encoder_tokens) = self._tables(i)
            rounds.append(SequenceRound(committed, pending[:num_fed], tables, slots[i], self.request_id,
                                        history, max_depth, branching, num_nodes,
                                        cross_block_table=cross_table, num_encoder_tokens=num_encoder_tokens))
        if self.draft_pools and not self.lazy_draft:
            for rnd in rounds:  # eager: the draft's cache holds every token the target's holds
                rnd.draft_feed = rnd.pending_input()
        elif draft_ranges is not None:
            self._draft_tokens_after = draft_ranges[0][1]
            for i, (rnd, positions) in enumerate(zip(rounds, draft_ranges)):
                if positions is not None:
                    rnd.draft_feed = self._draft_feed(i, rnd, *positions)
        return rounds

    def _catch_up_ranges(self, committed: int, num_fed: int,
                         max_tokens: int | None) -> list[tuple[int, int] | None] | None:
        """What a lagging draft's first pass feeds each sequence this round (None: nothing at all; a
        sequence's None: nothing for it), and sets `num_catch_up_tokens`. The draft holds positions
        [0, draft_tokens) of every sequence (none of the prompt until the request first drafts). The
        missed positions in blocks every sequence shares (the prompt, the common past) are fed once,
        by sequence 0; the rest by each sequence; then the pending tokens. All of it within
        `max_tokens` (None: no limit); past it only what fits is caught up (sequence 0's shared part
        first) and the round drafts nothing (the last range ends at or before `committed`)."""
        num_seqs = len(self.pending_token_ids)
        start = self.draft_tokens
        shared_end = max(start, min(committed, self.kv.num_common_tokens(self.draft_pools)))
        num_shared, num_own = shared_end - start, committed - shared_end
        budget = None if max_tokens is None else max(0, max_tokens)
        if budget is None or num_shared + num_own * num_seqs <= budget:
            self.num_catch_up_tokens = num_shared + num_own * num_seqs
            end = committed + num_fed
            return [(start, end)] + [(shared_end, end)] * (num_seqs - 1)
        if num_shared:
            n = min(num_shared, budget)
            self.num_catch_up_tokens = n
            return [(start, start + n)] + [None] * (num_seqs - 1) if n else None
        cap = budget // num_seqs
        self.num_catch_up_tokens = cap * num_seqs
        return [(start, start + cap)] * num_seqs if cap else None

    def _draft_feed(self, seq_index: int, rnd: SequenceRound, start: int, end: int) -> SequenceInput:
        """Sequence `seq_index`'s tokens at positions [start, end) for the draft model: those it missed
        while it lagged (positions the target's cache holds: their blocks are allocated in the draft's
        pools too, forked with the target's) and the round's pending ones."""
        tokens = (self.prompt_token_ids + self.decoder.live_token_ids[seq_index])[start:end]
        slots = self.kv.written_slots(seq_index, start, end, self.draft_pools)
        return SequenceInput(tokens, start, rnd.block_tables, slots, rnd.group)

    def _tables(self, seq_index: int) -> tuple[dict[str, list[int]], tuple[list[int] | None, int]]:
        """A sequence's block tables, and the cross table and its tokens apart (every beam reads it)."""
        tables = self.kv.block_tables(seq_index)
        cross: tuple[list[int] | None, int] = (None, 0)
        for name, num_tokens in self.kv.num_shared_tokens().items():  # at most one: the encoder output
            cross = (tables.pop(name), num_tokens)
        return tables, cross

    # -- consuming a step --------------------------------------------------------------------------
    def finish_prefill(self, scores: StepScores, row: int) -> RequestDelta | None:
        """A prompt chunk ran (its last token's scores at `row`). Once the prompt is done they choose
        the first token, as a round with nothing drafted; None while chunks are left (nothing to
        choose yet) or when the prompt is back after a preemption (its token was chosen long ago)."""
        self.kv.register_computed(self.num_prefilled_tokens)  # before the prompt forks into beams
        if not self.prompt_done:
            return None
        self.draft_tokens = self._draft_prompt_tokens
        if self.decoder.num_generated_tokens:
            self._resume()
            return None
        delta, replayed = self._replay(scores, [row], [DraftTree()])
        if not delta.finished:
            self._continue(replayed)
        return delta

    def finish_round(self, rounds: list[SequenceRound], scores: StepScores) -> RequestDelta | None:
        """Replay the decoder on the round's scores (speculative/replay.py), keep what it chose and
        roll the rest back. None for a re-feed round: these tokens were chosen before a preemption;
        nothing is scored (nor sampled: the generator is not touched)."""
        if self._num_fed_tokens < len(self.pending_token_ids[0]):
            self.pending_token_ids = [pending[self._num_fed_tokens:] for pending in self.pending_token_ids]
            return None
        if self._draft_tokens_after is not None:
            self.draft_tokens = self._draft_tokens_after  # the draft was fed (the target's drafts go below)
        root_rows = [rnd.row_start for rnd in rounds]
        delta, replayed = self._replay(scores, root_rows, [rnd.tree for rnd in rounds])
        # What the round drafted, not what it asked for: a prompt lookup that found nothing ran a plain
        # step at a plain step's cost, so the policy hears of a plain round (its cost and steps say
        # nothing about drafting).
        self._unrecorded_round_nodes = max(len(rnd.tree) for rnd in rounds)
        if delta.finished:
            return delta
        if rounds[0].max_nodes:
            # Drafted K/V go but the accepted ones in place (each sequence keeps its pending tokens,
            # written at their own positions), then the chosen sequences fork: the held count only
            # falls before `reorder`.
            num_kept = self._num_kept_nodes(rounds, replayed)
            for i, rnd in enumerate(rounds):
                self.kv.truncate(i, rnd.committed_tokens + rnd.num_pending + num_kept)
            if num_kept:
                paths = [path[num_kept:] for path in replayed.paths]
                replayed = ReplayedRound(replayed.parent_indices, paths, replayed.num_steps)
                if self._draft_tokens_after is not None:
                    self.draft_tokens += num_kept  # the draft fed them too (a level of its tree)
        self._continue(replayed)
        return delta

    def _num_kept_nodes(self, rounds: list[SequenceRound], replayed: ReplayedRound) -> int:
        """Accepted nodes whose K/V every chosen sequence keeps, so the next round does not feed them
        again (`DraftTree.num_kept`; with a draft model, only nodes it was fed too). The same count
        for every sequence: a request's sequences stay the same length."""
        draft_fed = bool(self.draft_pools)
        return min((rounds[parent].tree.num_kept(path, draft_fed)
                    for parent, path in zip(replayed.parent_indices, replayed.paths)), default=0)

    def record_round(self, round_s: float | None, share: StepShare = ALONE) -> None:
        """Tell the draft policy how the latest round went: its steps and, when the step ran rounds
        alone, its wall time and this request's share of the step. A re-feed round (nothing chosen)
        tells nothing."""
        if self.draft_length is not None and self._unrecorded_round_nodes is not None:
            self.draft_length.record(self._unrecorded_round_nodes, self.last_round_steps,
                                     round_s if self._round_timed else None, share)
        self._unrecorded_round_nodes = None

    def _replay(self, scores: StepScores, root_rows: list[int], trees: list[DraftTree]) -> tuple[RequestDelta,
                                                                                                   ReplayedRound]:
        decoder = self.decoder
        num_generated = decoder.num_generated_tokens
        delta = RequestDelta(self.request_id, first_token=num_generated == 0)
        replayed = replay_round(decoder, self.stream, delta, root_rows, trees, scores)
        self.last_round_steps = replayed.num_steps
        # every step generates one token per sequence (the search's own count stops at its last step)
        delta.num_generated_tokens = num_generated + replayed.num_steps
        if decoder.done:
            self.kv.free()
            self.completions = self.stream.completions()
            delta.finished = True
            delta.output = self.output()
        return delta, replayed

    def _continue(self, replayed: ReplayedRound) -> None:
        """The chosen sequences go on: released, kept or forked (copy-on-write when the next round
        appends); each feeds its path next."""
        self.kv.reorder(replayed.parent_indices)
        self.pending_token_ids = replayed.paths

    # -- preemption ----------------------------------------------------------------------------------
    def preempt(self, max_feed_tokens: int | None = None) -> int:
        """Give back every block and start again from the prompt. The decoder keeps its state
        (beams, scores, histories, its random generator), so once the prompt is prefilled again
        every live sequence re-feeds the tokens it generated, `max_feed_tokens` a step in all (None:
        at once), choosing nothing, and decoding goes on where it stopped. Returns the tokens whose
        K/V were dropped (computed again, less what the prefix cache still holds)."""
        num_generated = self.decoder.num_generated_tokens
        num_dropped = self.num_prefilled_tokens + sum(num_generated - len(p) for p in self.pending_token_ids)
        self._earlier_peak_blocks = self._peak_blocks()
        self.kv.free()
        self.kv = self.kv.renew()
        self.num_prefilled_tokens = 0
        self.draft_tokens = self._draft_prompt_tokens = 0
        self.pending_token_ids = []
        self.max_feed_tokens = max_feed_tokens
        self.num_preemptions += 1
        return num_dropped

    def _resume(self) -> None:
        """The prompt is prefilled again: fork it into the live sequences, each to re-feed its tokens."""
        histories = [list(tokens) for tokens in self.decoder.live_token_ids]
        self.kv.reorder([0] * len(histories))
        self.pending_token_ids = histories

    def _peak_blocks(self) -> dict[str, int]:
        """The most distinct blocks held at once per pool, over every run since admission."""
        earlier = self._earlier_peak_blocks
        return {name: max(n, earlier.get(name, 0)) for name, n in self.kv.peak_blocks().items()}

    # -- results -----------------------------------------------------------------------------------
    @property
    def source_token_ids(self) -> list[int]:
        """What the user sent: the source of an encoder-decoder request, else the prompt."""
        return self.prompt_token_ids if self.encoder_token_ids is None else self.encoder_token_ids

    def output(self) -> RequestOutput:
        prompt_logprobs = with_token_text(self.decoder.prompt_logprobs, self.stream.tokenizer)
        return RequestOutput(self.request_id, self.prompt, self.source_token_ids,
                             list(self.completions or []), self.finished, peak_blocks=self._peak_blocks(),
                             required_blocks=dict(self.admission.required_blocks),
                             num_cached_tokens=self.kv.num_cached_tokens, prompt_logprobs=prompt_logprobs,
                             tree=self.stream.tree())
