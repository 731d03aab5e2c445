"""One request: a decoder (sampling or beam) + its KV (`RequestKV`) + its output.

The request is the glue and owns no policy of its own: the KV coordinator does every allocation
(prompt once, beams forked, pruned branches released, copies queued), the decoder chooses tokens
(logits processors, sampling or beam search), stop strings cut text, and each step yields a
`RequestDelta`. See docs/architecture.md for the path of one beam-search request.

An encoder-decoder request's prompt is its source (`encoder_token_ids`): the engine encodes it once,
into the per-request cross table every beam reads, and the decoder prompt is the decoder start token.
"""

from __future__ import annotations

import time

import torch

from widebeam.decoding.decoders import BeamDecoder, RowScores, SamplingDecoder
from widebeam.decoding.stop import held_back_chars, stop_string_cut
from widebeam.detokenizer import IncrementalDetokenizer
from widebeam.kv.prefix import PrefixHit
from widebeam.kv.request_kv import RequestKV
from widebeam.logprobs import with_token_text
from widebeam.model.runner import SequenceInput
from widebeam.outputs import CompletionOutput, RequestDelta, RequestOutput
from widebeam.sched.admission import Admission
from widebeam.speculative.policy import DraftLength
from widebeam.speculative.round import SequenceRound
from widebeam.speculative.tree import ROOT


class Request:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 admission: Admission, kv: RequestKV, decoder: SamplingDecoder | BeamDecoder,
                 tokenizer=None, encoder_token_ids: list[int] | None = None):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.admission = admission
        self.kv = kv
        self.decoder = decoder
        self.params = decoder.params
        self.tokenizer = tokenizer
        self.encoder_token_ids = encoder_token_ids
        self.arrival_time = time.monotonic()
        self.num_prefilled_tokens = 0
        # What each live sequence feeds next: its last chosen token, after a speculative round also
        # the tokens accepted before it (their drafted K/V were discarded, so they are fed again).
        self.pending_token_ids: list[list[int]] = []
        self.outputs: list[CompletionOutput] | None = None
        # Sampled requests stream text: decoded incrementally, sent once no stop string can start in it.
        self._detokenizer = IncrementalDetokenizer(tokenizer) if tokenizer is not None and self.is_sampling else None
        self._sent: list[str] = []  # streamed pieces, joined once at the end
        self._unsent = ""  # decoded, not yet streamed: it could still be the start of a stop string
        self.last_round_steps = 0  # decoder steps the latest speculative round took
        self.draft_length: DraftLength | None = None  # set by a speculative engine
        self.num_preemptions = 0  # times the scheduler took its blocks back (it resumed by recomputation)
        self.max_feed_tokens: int | None = None  # after a preemption: the most tokens one re-feed step feeds
        self._num_fed_tokens = 1  # tokens per sequence the latest decode step fed
        self._earlier_peak_blocks: dict[str, int] = {}  # peaks held before the latest preemption

    @property
    def is_sampling(self) -> bool:
        return isinstance(self.decoder, SamplingDecoder)

    @property
    def finished(self) -> bool:
        return self.outputs is not None

    @property
    def prompt_done(self) -> bool:
        return self.num_prefilled_tokens == len(self.prompt_token_ids)

    @property
    def num_prompt_tokens_left(self) -> int:
        return len(self.prompt_token_ids) - self.num_prefilled_tokens

    @property
    def num_live_sequences(self) -> int:
        return len(self.pending_token_ids)

    @property
    def num_feed_tokens(self) -> int:
        """Tokens each live sequence feeds in its next decode step: all its pending ones, but
        `max_feed_tokens` at a time in all (at least one each) while it re-feeds after a preemption."""
        num_pending = len(self.pending_token_ids[0]) if self.pending_token_ids else 0
        if self.max_feed_tokens is None:
            return num_pending
        return min(num_pending, max(1, self.max_feed_tokens // len(self.pending_token_ids)))

    def num_step_tokens(self, num_draft_tokens: int = 0) -> int:
        """Tokens a decode step of this request feeds: the pending tokens of every live sequence it
        feeds now (`num_feed_tokens`), and up to `num_draft_tokens` drafted ones each when speculating."""
        return sum(min(len(pending), self.num_feed_tokens) + num_draft_tokens for pending in self.pending_token_ids)

    def remaining_blocks(self) -> dict[str, int]:
        """Blocks this request may still take, per pool: its reservation in the scheduler."""
        return self.kv.remaining_blocks(self.admission.required_blocks)

    def find_prefix_hit(self) -> PrefixHit:
        """What the cache holds of this prompt now (no side effects)."""
        return self.kv.cache.find_hit(self.kv.key)

    def unnamed_prompt_blocks(self) -> tuple[bytes, ...]:
        return self.kv.unnamed_prompt_blocks()

    def gains_by_waiting(self, hit: PrefixHit, pending: set[bytes]) -> bool:
        return self.kv.gains_by_waiting(hit, pending)

    def take_prefix_hit(self, hit: PrefixHit) -> None:
        """Admitted: start from the cached blocks; the prefill begins after them (and skips the
        encoder when its output was cached)."""
        self.kv.take_hit(hit)
        self.kv.cache.record_lookup(self.kv.key, hit)
        self.num_prefilled_tokens = hit.num_tokens

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
        return self._input(self.prompt_token_ids[start:start + num_tokens], start, 0, slots)

    def decode_inputs(self) -> list[SequenceInput]:
        """One token per live sequence; the beams of a request form one group (shared prefix)."""
        num_fed = self._num_fed_tokens = self.num_feed_tokens
        position = len(self.prompt_token_ids) + self.decoder.num_generated_tokens - len(self.pending_token_ids[0])
        slots = self.kv.decode_slots(num_fed)
        return [self._input(pending[:num_fed], position, i, slots[i])
                for i, pending in enumerate(self.pending_token_ids)]

    def _input(self, token_ids: list[int], position: int, seq_index: int, slots: dict[str, list[int]]) -> SequenceInput:
        tables = self.kv.block_tables(seq_index)
        cross = {}
        for name, num_tokens in self.kv.num_shared_tokens().items():  # at most one: the encoder output
            cross = {"cross_block_table": tables.pop(name), "num_encoder_tokens": num_tokens}
        return SequenceInput(token_ids, position, tables, slots, group=self.request_id, **cross)

    # -- consuming a step --------------------------------------------------------------------------
    def advance(self, scores: RowScores) -> RequestDelta | None:
        """Consume this request's rows of the step (one per live sequence); None while a chunked
        prompt is still being prefilled (no token to choose yet)."""
        self.kv.register_computed(self.num_prefilled_tokens)  # before the prompt forks into beams
        if not self.prompt_done:
            return None
        if self.decoder.num_generated_tokens and not self.pending_token_ids:
            self._resume()  # the prompt is back after a preemption; its logits chose a token long ago
            return None
        if self.pending_token_ids and self._num_fed_tokens < len(self.pending_token_ids[0]):
            # re-feeding after a preemption: these tokens were chosen before; only the last one's
            # logits are new, so nothing is scored (nor sampled: the generator is not touched)
            self.pending_token_ids = [pending[self._num_fed_tokens:] for pending in self.pending_token_ids]
            return None
        num_generated = self.decoder.num_generated_tokens + 1  # every step generates one token per sequence
        step = self.decoder.advance(scores)
        delta = RequestDelta(self.request_id, num_generated_tokens=num_generated, first_token=num_generated == 1)
        if self.is_sampling:
            self.pending_token_ids = [step.token_ids]
            self._stream_text(delta, step.token_ids)
        elif not self.decoder.done:
            self.kv.reorder(step.parent_indices)  # free -> fork; copy-on-write when the next step appends
            self.pending_token_ids = [[token] for token in step.token_ids]
            stopped = self._stopped_beams()
            if stopped:
                self.kv.drop(stopped)
                self.pending_token_ids = [p for i, p in enumerate(self.pending_token_ids) if i not in stopped]
        if self.decoder.done:
            self.kv.free()
            self.outputs = self._completions()
            delta.finished = True
            delta.output = self.output()
        return delta

    # -- speculative rounds ---------------------------------------------------------------------------
    def begin_round(self, num_draft_tokens: int, branching: int) -> list[SequenceRound]:
        """Take slots for every live sequence's pending tokens and `num_draft_tokens` drafted ones, in
        every pool at once, and describe the round (a drafter fills the trees)."""
        committed = self.kv.num_tokens(0)
        num_pending = len(self.pending_token_ids[0])
        slots = self.kv.decode_slots(num_pending + num_draft_tokens)
        generated = self.decoder.num_generated_tokens
        # A round takes at most depth + 1 steps and never passes max_new_tokens, so deeper nodes
        # would be wasted (and would sit past the positions admission checked).
        max_depth = min(num_draft_tokens, max(0, self.admission.max_new_tokens - generated - 1))
        if self.is_sampling:
            histories = [self.prompt_token_ids + self.decoder.token_ids]
        else:
            histories = [self.prompt_token_ids + tokens for tokens in self.decoder.live_token_ids]
        return [SequenceRound(committed, list(pending), self.kv.block_tables(i), slots[i], self.request_id,
                              histories[i], max_depth, branching, num_draft_tokens)
                for i, pending in enumerate(self.pending_token_ids)]

    def finish_round(self, rounds: list[SequenceRound], logits: torch.Tensor, logprobs: torch.Tensor) -> RequestDelta:
        """Replay the decoder on the verified scores (`logits`/`logprobs` [rows, vocab] of the whole
        verify pass), one step at a time, while every sequence it continues is a drafted node, whose
        next-token scores the target has computed; then keep what was chosen and roll the rest back.

        Each step is the decoder's ordinary step on the target's own scores, so the result is the
        one decoding without speculation gives: the same beams, tokens and scores (sampling draws
        from the same distribution, by rejection against the drafted token)."""
        decoder = self.decoder
        current: list[tuple[int, int | None]] = [(i, ROOT) for i in range(len(rounds))]  # (old seq, node)
        paths: list[list[int]] = [[] for _ in rounds]
        delta = RequestDelta(self.request_id)
        num_steps = 0
        while True:
            rows = torch.tensor([rounds[i].row(node) for i, node in current], device=logits.device)
            scores = RowScores(logits.index_select(0, rows), logprobs.index_select(0, rows))
            if self.is_sampling:
                seq, node = current[0]
                tree = rounds[seq].tree
                drafted = tree.children(node)  # a chain: at most one
                step, _ = decoder.advance_with_draft(scores, tree.token_ids[drafted[0]] if drafted else None)
                self._stream_text(delta, step.token_ids)
            else:
                step = decoder.advance(scores)
            num_steps += 1
            if decoder.done:
                break
            current = [(current[p][0], rounds[current[p][0]].tree.child(current[p][1], token))
                       for p, token in zip(step.parent_indices, step.token_ids)]
            paths = [paths[p] + [token] for p, token in zip(step.parent_indices, step.token_ids)]
            if not self.is_sampling:
                stopped = self._stopped_beams()
                current = [c for i, c in enumerate(current) if i not in stopped]
                paths = [path for i, path in enumerate(paths) if i not in stopped]
                if decoder.done:
                    break
            if any(node is None for _, node in current):
                break  # the next step's scores were not drafted: the round ends here
        self.last_round_steps = num_steps
        delta.num_generated_tokens = decoder.num_generated_tokens
        if decoder.done:
            self.kv.free()
            self.outputs = self._completions()
            delta.finished = True
            delta.output = self.output()
            return delta
        # Drafted K/V go (each sequence keeps its pending tokens, written at their own positions),
        # then the chosen sequences fork: the held count only falls before `reorder`.
        for i, rnd in enumerate(rounds):
            self.kv.truncate(i, rnd.committed_tokens + rnd.num_pending)
        self.kv.reorder([seq for seq, _ in current])
        self.pending_token_ids = paths
        return delta

    def _stream_text(self, delta: RequestDelta, token_ids: list[int]) -> None:
        """Append these tokens and their text to the delta; send what no stop string can still claim.

        A stop string can only start in the unsent text: what was sent never ended in the start of
        one (`held_back_chars`), so each step searches the unsent text alone, whose length is
        bounded by the longest stop string plus the step's new characters."""
        delta.new_token_ids.extend(token_ids)
        if self.decoder.logprobs is not None:  # with logprobs=k: one entry per new token
            delta.new_logprobs.extend(self.decoder.logprobs[len(self.decoder.logprobs) - len(token_ids):])
        if self._detokenizer is None:
            return
        self._unsent += self._detokenizer.add(token_ids)
        if self.decoder.done:  # the last token: whatever the detokenizer still holds (a cut character)
            self._unsent += self._detokenizer.flush()
        stops = self.params.stop
        cut = stop_string_cut(self._unsent, stops)
        if cut is not None:
            self._unsent = self._unsent[:cut]
            self.decoder.stop()
        safe_end = len(self._unsent) if self.decoder.done else len(self._unsent) - held_back_chars(self._unsent, stops)
        if safe_end:
            piece = self._unsent[:safe_end]
            delta.new_text += piece
            self._sent.append(piece)
            self._unsent = self._unsent[safe_end:]

    def _stopped_beams(self) -> set[int]:
        """Finish the live beams whose text now holds a stop string; their indices (the caller
        releases their blocks)."""
        if not self.params.stop or self.tokenizer is None:
            return set()
        # Each beam's text is decoded whole: beams are reordered every step, so no per-beam
        # incremental state survives (a known cost for long beams with stop strings).
        stopped = [i for i, token_ids in enumerate(self.decoder.live_token_ids)
                   if stop_string_cut(self.tokenizer.decode(token_ids, skip_special_tokens=True),
                                      self.params.stop) is not None]
        if stopped:
            self.decoder.stop(stopped)
        return set(stopped)

    def free(self) -> None:
        """Give back every block; safe to call twice (abort after finish)."""
        self.kv.free()

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
        self.pending_token_ids = []
        self.max_feed_tokens = max_feed_tokens
        self.num_preemptions += 1
        return num_dropped

    def _resume(self) -> None:
        """The prompt is prefilled again: fork it into the live sequences, each to re-feed its tokens."""
        decoder = self.decoder
        histories = [list(decoder.token_ids)] if self.is_sampling else [list(t) for t in decoder.live_token_ids]
        self.kv.reorder([0] * len(histories))
        self.pending_token_ids = histories

    def _peak_blocks(self) -> dict[str, int]:
        """The most distinct blocks held at once per pool, over every run since admission."""
        return {name: max(n, self._earlier_peak_blocks.get(name, 0)) for name, n in self.kv.peak_blocks().items()}

    # -- results -----------------------------------------------------------------------------------
    def _completions(self) -> list[CompletionOutput]:
        decoder = self.decoder
        if isinstance(decoder, SamplingDecoder):
            return [CompletionOutput(0, "".join(self._sent), list(decoder.token_ids), decoder.cumulative_logprob,
                                     decoder.finish_reason, logprobs=with_token_text(decoder.logprobs, self.tokenizer))]
        completions = []
        for index, hyp in enumerate(decoder.finalize()):
            text = ""
            if self.tokenizer is not None:
                text = self.tokenizer.decode(hyp.token_ids, skip_special_tokens=True)
                cut = stop_string_cut(text, self.params.stop)
                if cut is not None:
                    text = text[:cut]
            completions.append(CompletionOutput(index, text, list(hyp.token_ids), hyp.cumulative_logprob,
                                                hyp.finish_reason, hyp.score,
                                                with_token_text(hyp.annotations, self.tokenizer)))
        return completions

    @property
    def source_token_ids(self) -> list[int]:
        """What the user sent: the source of an encoder-decoder request, else the prompt."""
        return self.prompt_token_ids if self.encoder_token_ids is None else self.encoder_token_ids

    def output(self) -> RequestOutput:
        return RequestOutput(self.request_id, self.prompt, self.source_token_ids, list(self.outputs or []),
                             self.finished, peak_blocks=self._peak_blocks(),
                             required_blocks=dict(self.admission.required_blocks),
                             num_cached_tokens=self.kv.num_cached_tokens,
                             prompt_logprobs=with_token_text(self.decoder.prompt_logprobs, self.tokenizer))
