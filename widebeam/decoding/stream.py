"""A request's output as it grows: the text, stop strings and the final completions.

The kind of stream is chosen once, with the decoder (`output_stream`): a sampled request streams
its text as it goes (decoded incrementally, held back while a stop string could still start in
it); a beam request's text is final only at the end (beams are reordered every step), so each
step only finishes the live beams whose text holds a stop string. Either way `on_step` is told
every decoder step, so the request never asks which kind it holds.
"""

from __future__ import annotations

from widebeam.decoding.decoders import Advance, BeamDecoder, SamplingDecoder
from widebeam.decoding.stop import held_back_chars, stop_string_cut
from widebeam.detokenizer import IncrementalDetokenizer
from widebeam.logprobs import token_text_of, with_token_text
from widebeam.outputs import CompletionOutput, RequestDelta


class SampledStream:
    """One sequence's text, streamed: what no stop string can still claim goes out each step."""

    def __init__(self, decoder: SamplingDecoder, tokenizer):
        self.decoder = decoder
        self.tokenizer = tokenizer
        self._detokenizer = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self._sent: list[str] = []  # streamed pieces, joined once at the end
        self._unsent = ""  # decoded, not yet streamed: it could still be the start of a stop string

    def on_step(self, delta: RequestDelta, step: Advance) -> set[int]:
        """Append the step's token and its text to the delta; a stop string stops the decoder.
        Returns the live sequences the text finished (none: the decoder is done instead).

        A stop string can only start in the unsent text: what was sent never ended in the start of
        one (`held_back_chars`), so each step searches the unsent text alone, whose length is
        bounded by the longest stop string plus the step's new characters."""
        decoder = self.decoder
        delta.new_token_ids.extend(step.token_ids)
        if decoder.logprobs is not None:  # with logprobs=k: one entry per new token
            delta.new_logprobs.extend(decoder.logprobs[len(decoder.logprobs) - len(step.token_ids):])
        if self._detokenizer is None:
            return set()
        self._unsent += self._detokenizer.add(step.token_ids)
        if decoder.done:  # the last token: whatever the detokenizer still holds (a cut character)
            self._unsent += self._detokenizer.flush()
        stops = decoder.params.stop
        cut = stop_string_cut(self._unsent, stops)
        if cut is not None:
            self._unsent = self._unsent[:cut]
            decoder.stop()
        safe_end = len(self._unsent)
        if not decoder.done:
            safe_end -= held_back_chars(self._unsent, stops)
        if safe_end:
            piece = self._unsent[:safe_end]
            delta.new_text += piece
            self._sent.append(piece)
            self._unsent = self._unsent[safe_end:]
        return set()

    def tree(self) -> None:
        """A sampled sequence has no search tree."""

    def completions(self) -> list[CompletionOutput]:
        decoder = self.decoder
        logprobs = with_token_text(decoder.logprobs, self.tokenizer)
        return [CompletionOutput(0, "".join(self._sent), list(decoder.token_ids), decoder.cumulative_logprob,
                                 decoder.finish_reason, logprobs=logprobs)]


class BeamStream:
    """Beam hypotheses' text: decoded whole at the end; stop strings checked on every live beam."""

    def __init__(self, decoder: BeamDecoder, tokenizer):
        self.decoder = decoder
        self.tokenizer = tokenizer

    def on_step(self, delta: RequestDelta, step: Advance) -> set[int]:
        """Finish the live beams whose text now holds a stop string; their indices (the caller
        releases their blocks)."""
        stops = self.decoder.params.stop
        if not stops or self.tokenizer is None or self.decoder.done:
            return set()
        # Each beam's text is decoded whole: beams are reordered every step, so no per-beam
        # incremental state survives (a known cost for long beams with stop strings).
        texts = [self.tokenizer.decode(token_ids, skip_special_tokens=True)
                 for token_ids in self.decoder.live_token_ids]
        stopped = [i for i, text in enumerate(texts) if stop_string_cut(text, stops) is not None]
        if stopped:
            self.decoder.stop(stopped)
        return set(stopped)

    def tree(self) -> dict | None:
        """The search tree with each token's text (`return_tree`), after `completions` ranked it."""
        tree = self.decoder.tree
        if tree is None:
            return None
        return tree.to_dict(token_text_of(self.tokenizer) if self.tokenizer is not None else None)

    def completions(self) -> list[CompletionOutput]:
        completions = []
        for index, hyp in enumerate(self.decoder.finalize()):
            text = ""
            if self.tokenizer is not None:
                text = self.tokenizer.decode(hyp.token_ids, skip_special_tokens=True)
                cut = stop_string_cut(text, self.decoder.params.stop)
                if cut is not None:
                    text = text[:cut]
            completions.append(CompletionOutput(index, text, list(hyp.token_ids), hyp.cumulative_logprob,
                                                hyp.finish_reason, hyp.score,
                                                with_token_text(hyp.annotations, self.tokenizer)))
        return completions


def output_stream(decoder: SamplingDecoder | BeamDecoder, tokenizer) -> SampledStream | BeamStream:
    """The stream of this decoder's kind (the one place that tells the kinds apart)."""
    if isinstance(decoder, SamplingDecoder):
        return SampledStream(decoder, tokenizer)
    return BeamStream(decoder, tokenizer)  # beams, or forced rows (decoding/scoring.py): whole at the end
