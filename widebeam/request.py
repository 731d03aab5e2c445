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

from widebeam.decoding.decoders import BeamDecoder, RowScores, SamplingDecoder
from widebeam.decoding.stop import held_back_chars, stop_string_cut
from widebeam.detokenizer import IncrementalDetokenizer
from widebeam.kv.request_kv import RequestKV
from widebeam.model.runner import SequenceInput
from widebeam.outputs import CompletionOutput, RequestDelta, RequestOutput
from widebeam.sched.admission import Admission


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
        self.next_token_ids: list[int] = []  # what each live sequence feeds next
        self.outputs: list[CompletionOutput] | None = None
        # Sampled requests stream text: decoded incrementally, sent once no stop string can start in it.
        self._detokenizer = IncrementalDetokenizer(tokenizer) if tokenizer is not None and self.is_sampling else None
        self._sent: list[str] = []  # streamed pieces, joined once at the end
        self._unsent = ""  # decoded, not yet streamed: it could still be the start of a stop string

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
        return len(self.next_token_ids)

    def remaining_blocks(self) -> dict[str, int]:
        """Blocks this request may still take, per pool: its reservation in the scheduler."""
        return self.kv.remaining_blocks(self.admission.required_blocks)

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
        position = len(self.prompt_token_ids) + self.decoder.num_generated_tokens - 1
        slots = self.kv.decode_slots()
        return [self._input([token], position, i, slots[i]) for i, token in enumerate(self.next_token_ids)]

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
        if not self.prompt_done:
            return None
        num_generated = self.decoder.num_generated_tokens + 1  # every step generates one token per sequence
        step = self.decoder.advance(scores)
        delta = RequestDelta(self.request_id, num_generated_tokens=num_generated, first_token=num_generated == 1)
        if self.is_sampling:
            self.next_token_ids = step.token_ids
            delta.new_token_ids = step.token_ids
            self._stream_text(delta)
        elif not self.decoder.done:
            self.kv.reorder(step.parent_indices)  # free -> fork; copy-on-write when the next step appends
            self.next_token_ids = step.token_ids
            self._stop_beams()
        if self.decoder.done:
            self.kv.free()
            self.outputs = self._completions()
            delta.finished = True
            delta.output = self.output()
        return delta

    def _stream_text(self, delta: RequestDelta) -> None:
        """Append this step's text; send what no stop string can still claim.

        A stop string can only start in the unsent text: what was sent never ended in the start of
        one (`held_back_chars`), so each step searches the unsent text alone, whose length is
        bounded by the longest stop string plus the step's new characters."""
        if self._detokenizer is None:
            return
        self._unsent += self._detokenizer.add(delta.new_token_ids)
        if self.decoder.done:  # the last token: whatever the detokenizer still holds (a cut character)
            self._unsent += self._detokenizer.flush()
        stops = self.params.stop
        cut = stop_string_cut(self._unsent, stops)
        if cut is not None:
            self._unsent = self._unsent[:cut]
            self.decoder.stop()
        safe_end = len(self._unsent) if self.decoder.done else len(self._unsent) - held_back_chars(self._unsent, stops)
        if safe_end:
            delta.new_text = self._unsent[:safe_end]
            self._sent.append(delta.new_text)
            self._unsent = self._unsent[safe_end:]

    def _stop_beams(self) -> None:
        """Finish the live beams whose text now holds a stop string, and release their blocks."""
        if not self.params.stop or self.tokenizer is None:
            return
        # Each beam's text is decoded whole: beams are reordered every step, so no per-beam
        # incremental state survives (a known cost for long beams with stop strings).
        stopped = [i for i, token_ids in enumerate(self.decoder.live_token_ids)
                   if stop_string_cut(self.tokenizer.decode(token_ids, skip_special_tokens=True),
                                      self.params.stop) is not None]
        if stopped:
            self.decoder.stop(stopped)
            self.kv.drop(stopped)
            gone = set(stopped)
            self.next_token_ids = [t for i, t in enumerate(self.next_token_ids) if i not in gone]

    def free(self) -> None:
        """Give back every block; safe to call twice (abort after finish)."""
        self.kv.free()

    # -- results -----------------------------------------------------------------------------------
    def _completions(self) -> list[CompletionOutput]:
        decoder = self.decoder
        if isinstance(decoder, SamplingDecoder):
            return [CompletionOutput(0, "".join(self._sent), list(decoder.token_ids), decoder.cumulative_logprob,
                                     decoder.finish_reason)]
        completions = []
        for index, hyp in enumerate(decoder.finalize()):
            text = ""
            if self.tokenizer is not None:
                text = self.tokenizer.decode(hyp.token_ids, skip_special_tokens=True)
                cut = stop_string_cut(text, self.params.stop)
                if cut is not None:
                    text = text[:cut]
            completions.append(CompletionOutput(index, text, list(hyp.token_ids), hyp.cumulative_logprob,
                                                hyp.finish_reason, hyp.score))
        return completions

    @property
    def source_token_ids(self) -> list[int]:
        """What the user sent: the source of an encoder-decoder request, else the prompt."""
        return self.prompt_token_ids if self.encoder_token_ids is None else self.encoder_token_ids

    def output(self) -> RequestOutput:
        return RequestOutput(self.request_id, self.prompt, self.source_token_ids, list(self.outputs or []),
                             self.finished, peak_blocks=self.kv.peak_blocks(),
                             required_blocks=dict(self.admission.required_blocks))
