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

from dataclasses import dataclass, field

import torch

from widebeam.decoding.decoders import BeamDecoder, SamplingDecoder, StepScores
from widebeam.decoding.stream import BeamStream, SampledStream
from widebeam.kv.request_kv import RequestKV
from widebeam.logprobs import with_token_text
from widebeam.model.runner import SequenceInput
from widebeam.outputs import CompletionOutput, RequestDelta, RequestOutput
from widebeam.sched.admission import Admission
from widebeam.speculative.replay import ReplayedRound, replay_round
from widebeam.speculative.request_draft import RequestDraft
from widebeam.speculative.round import SequenceRound
from widebeam.speculative.tree import DraftTree, branching_for_width


class Request:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 admission: Admission, kv: RequestKV, decoder: SamplingDecoder | BeamDecoder,
                 stream: SampledStream | BeamStream, encoder_token_ids: list[int] | None = None,
                 draft: RequestDraft | None = None, catalogue=None):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.admission = admission
        self.kv = kv
        self.decoder = decoder
        self.stream = stream
        self.params = decoder.params
        self.priority: int = getattr(self.params, "priority", 0)  # lower runs first (sched/scheduler.py)
        self.encoder_token_ids = encoder_token_ids
        self.draft = draft  # its drafting (speculative/request_draft.py); None: the engine does not speculate
        self.catalogue = catalogue  # the catalogue its search is constrained to (catalogue/), or None
        self.num_prefilled_tokens = 0
        # What each live sequence feeds next: its last chosen token, after a round that accepted
        # drafted nodes also those whose drafted K/V were not kept (`RequestDraft.keep_accepted`).
        self.pending_token_ids: list[list[int]] = []
        self.completions: list[CompletionOutput] | None = None  # set when it finishes
        self.last_round_steps = 0  # decoder steps the latest round took
        self.num_preemptions = 0  # times the scheduler took its blocks back (it resumed by recomputation)
        self.max_feed_tokens: int | None = None  # after a preemption: the most tokens one re-feed step feeds
        self._num_fed_tokens = 1  # tokens per sequence the latest round fed
        self.split: SplitRound | None = None  # a round fed over several steps, while it lasts
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

    def num_splittable_rows(self, num_draft_tokens: int = 0) -> int:
        """The rows its round still has to feed when they may be fed over several steps (several live
        sequences, one token each, nothing drafted: each row is a sequence's whole round), else 0. A
        round split so chooses once all its rows are scored, as it would in one step."""
        if self.split is not None:
            return len(self.split.rounds) - self.split.num_done
        pending = self.pending_token_ids
        if num_draft_tokens or self.draft is not None or len(pending) < 2 \
                or any(len(p) != 1 for p in pending):
            return 0
        return len(pending)

    def take_prefix_hit(self, hit) -> None:
        """Admitted: start from the cached blocks; the prefill begins after them (and skips the
        encoder when its output was cached)."""
        self.kv.take_hit(hit)
        self.num_prefilled_tokens = hit.num_tokens
        if self.draft is not None:
            self.draft.take_hit(hit.num_tokens)

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

    def begin_round(self, max_catch_up_tokens: int | None = None,
                    plain: bool = False) -> tuple[list[SequenceRound], int]:
        """Take slots for every live sequence's pending tokens (those it feeds now) and the nodes it
        may draft, in every pool at once, and describe the round (a drafter, if any, fills the trees);
        with it the missed tokens a lagging draft model catches up (`RequestDraft.plan_round`: at
        most `max_catch_up_tokens`, None: no limit). While re-feeding after a preemption nothing is
        drafted; nor when the step is `plain` (another request measures a plain round)."""
        num_fed = self._num_fed_tokens = self.num_feed_tokens
        refeeding = num_fed < len(self.pending_token_ids[0])
        generated = self.decoder.num_generated_tokens
        committed = len(self.prompt_token_ids) + generated - len(self.pending_token_ids[0])
        num_nodes = num_catch_up_tokens = 0
        if self.draft is not None:
            num_nodes, num_catch_up_tokens = self.draft.plan_round(
                self.kv, committed, num_fed, len(self.pending_token_ids), refeeding=refeeding, plain=plain,
                may_draft=self.admission.max_new_tokens - generated - 1 > 0,
                max_catch_up_tokens=max_catch_up_tokens)
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
        if self.draft is not None:
            self.draft.feed(rounds, self.kv, lambda i: self.prompt_token_ids + self.decoder.live_token_ids[i])
        return rounds, num_catch_up_tokens

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
        if self.draft is not None:
            self.draft.prompt_done()
        if self.decoder.num_generated_tokens:
            self._resume()
            return None
        delta, replayed = self._replay(scores, [row], [DraftTree()])
        if not delta.finished:
            self._continue(replayed)
        return delta

    def begin_round_part(self, num_rows: int | None, begin) -> list[SequenceRound]:
        """The next `num_rows` (None: all left) sequences of a round fed over several steps; the round
        itself (`begin(self)`: the step's `begin_round`, which takes every sequence's slot) begins with
        its first part."""
        if self.split is None:
            self.split = SplitRound(begin(self))
        split = self.split
        part = split.rounds[split.num_done:None if num_rows is None else split.num_done + num_rows]
        split.num_done += len(part)
        return part

    def finish_round_part(self, part: list[SequenceRound], scores: StepScores) -> RequestDelta | None:
        """Keep a part's logits; once every part is scored, finish the round on all of them at once."""
        split = self.split
        split.logits.append(scores.select([rnd.row_start for rnd in part]).logits.clone())
        if split.num_done < len(split.rounds):
            return None
        self.split = None
        for row, rnd in enumerate(split.rounds):
            rnd.row_start = row
        return self.finish_round(split.rounds, StepScores(torch.cat(split.logits)))

    def finish_round(self, rounds: list[SequenceRound], scores: StepScores) -> RequestDelta | None:
        """Replay the decoder on the round's scores (speculative/replay.py), keep what it chose and
        roll the rest back. None for a re-feed round: these tokens were chosen before a preemption;
        nothing is scored (nor sampled: the generator is not touched)."""
        if self._num_fed_tokens < len(self.pending_token_ids[0]):
            self.pending_token_ids = [pending[self._num_fed_tokens:] for pending in self.pending_token_ids]
            return None
        root_rows = [rnd.row_start for rnd in rounds]
        delta, replayed = self._replay(scores, root_rows, [rnd.tree for rnd in rounds])
        if self.draft is not None:
            self.draft.end_round(rounds)
        if delta.finished:
            return delta
        if rounds[0].max_nodes:
            # Drafted K/V go but the accepted ones in place (each sequence keeps its pending tokens,
            # written at their own positions), then the chosen sequences fork: the held count only
            # falls before `reorder`.
            num_kept = self.draft.keep_accepted(rounds, replayed)
            for i, rnd in enumerate(rounds):
                self.kv.truncate(i, rnd.committed_tokens + rnd.num_pending + num_kept)
            if num_kept:
                paths = [path[num_kept:] for path in replayed.paths]
                replayed = ReplayedRound(replayed.parent_indices, paths, replayed.num_steps)
        self._continue(replayed)
        return delta

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
        if self.draft is not None:
            self.draft.reset()
        self.pending_token_ids = []
        self.split = None  # its slots went with the blocks; the round starts again after the re-feed
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


@dataclass
class SplitRound:
    """A round whose sequences are fed over several steps (sched/scheduler.py splits a wide round at the
    step's token budget): its rounds, how many have run, their logits so far ([rows, vocab] each)."""

    rounds: list[SequenceRound]
    num_done: int = 0
    logits: list[torch.Tensor] = field(default_factory=list)
