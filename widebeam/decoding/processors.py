"""Logits processors: an ordered list each request applies to its scores before choosing tokens.

A processor edits scores `[rows, vocab]` in place. The order is the list's: later processors see (and
may override) what earlier ones did, as in transformers' `LogitsProcessorList`.

Users pass plain callables (`LogitsProcessor`: `fn(scores, num_generated_tokens)`); the decoder wraps
each in a `StepProcessor`, the one protocol it speaks. A `StepProcessor` gets the step's context
(decoding/context.py: the live rows' history, the generated count, how the beams moved), and may
offer two things the decoder asks every processor about, without knowing which one it is:
- `allowed(context)`: the only (row, token) pairs this step may take (a catalogue). Alone in the
  list, beam search then ranks that set directly instead of a masked copy of the rows.
- `forces_eos(context)`: whether it forces EOS this step (beam search then lets EOS through its
  min_new_tokens ban, as transformers' processor order does).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

import torch

from widebeam.decoding.context import BeamMoves, StepContext


class LogitsProcessor(Protocol):
    def __call__(self, scores: torch.Tensor, num_generated_tokens: int) -> None:
        """Edit `scores` [rows, vocab] in place before the next token is chosen."""


class StepProcessor:
    """A processor as the decoder calls it (see the module docstring); the defaults offer nothing."""

    def process(self, scores: torch.Tensor, context: StepContext) -> None:
        """Edit `scores` [context.num_rows, vocab] in place."""
        raise NotImplementedError

    def allowed(self, context: StepContext) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows, tokens) [num_allowed]: the only pairs this step may take, or None (no such set).
        Whoever answers also moves its state as `process` would: only one of them runs a step."""
        return None

    def forces_eos(self, context: StepContext) -> bool:
        return False


class CallableProcessor(StepProcessor):
    """A user's `fn(scores, num_generated_tokens)`."""

    def __init__(self, fn: LogitsProcessor | Callable[[torch.Tensor, int], None]):
        self.fn = fn

    def process(self, scores: torch.Tensor, context: StepContext) -> None:
        self.fn(scores, context.num_generated_tokens)


def step_processors(processors: Iterable[LogitsProcessor | StepProcessor]) -> list[StepProcessor]:
    """Every processor as a `StepProcessor`: a plain callable is wrapped."""
    return [p if isinstance(p, StepProcessor) else CallableProcessor(p) for p in processors]


class BeamStateFollower:
    """For a processor whose per-row state cannot be derived from the history (a trie node, a grammar
    matcher): `follow(context)` hands it the context's moves once per step, whichever of `process` or
    `allowed` runs first; `move(moves)` does the work."""

    _followed_step: int = 0  # the num_generated_tokens whose moves were applied

    def follow(self, context: StepContext) -> None:
        if context.moves is not None and context.num_generated_tokens != self._followed_step:
            self.move(context.moves)
        self._followed_step = context.num_generated_tokens

    def move(self, moves: BeamMoves) -> None:
        raise NotImplementedError


class BanUntilMinTokens(StepProcessor):
    """Tokens that may not come before `min_new_tokens` tokens were generated (EOS, unless ignored,
    and the stop token ids), masked as transformers and vLLM do: not emitted, walked past."""

    def __init__(self, min_new_tokens: int, token_ids: Iterable[int]):
        self.min_new_tokens = min_new_tokens
        self.token_ids = sorted(set(token_ids))

    def process(self, scores: torch.Tensor, context: StepContext) -> None:
        if context.num_generated_tokens < self.min_new_tokens and self.token_ids:
            scores[:, self.token_ids] = float("-inf")


class SuppressTokens(StepProcessor):
    """Tokens never generated (HF `bad_words_ids` of single tokens, e.g. Marian's pad)."""

    def __init__(self, token_ids: Sequence[int]):
        self.token_ids = list(token_ids)

    def process(self, scores: torch.Tensor, context: StepContext) -> None:
        scores[:, self.token_ids] = float("-inf")


class ForceBOSAtStart(StepProcessor):
    """HF `forced_bos_token_id`: the first generated token is this one (mBART-50 and NLLB put the
    target language there). Its log-prob becomes 0, so it adds nothing to a beam's score but counts in
    its length, as in HF."""

    def __init__(self, token_id: int):
        self.token_id = token_id

    def process(self, scores: torch.Tensor, context: StepContext) -> None:
        if context.num_generated_tokens == 0:
            scores.fill_(float("-inf"))
            scores[:, self.token_id] = 0.0


class ForceEOSAtEnd(StepProcessor):
    """HF `forced_eos_token_id`: the last allowed token (number `max_new_tokens`) is this one.
    It overrides every earlier processor, min_new_tokens' EOS ban included, as in HF."""

    def __init__(self, eos_token_id: int, max_new_tokens: int):
        self.eos_token_id = eos_token_id
        self.max_new_tokens = max_new_tokens

    def forces_eos(self, context: StepContext) -> bool:
        return context.num_generated_tokens == self.max_new_tokens - 1

    def process(self, scores: torch.Tensor, context: StepContext) -> None:
        if self.forces_eos(context):
            scores.fill_(float("-inf"))
            scores[:, self.eos_token_id] = 0.0


def apply_processors(processors: Sequence[StepProcessor], scores: torch.Tensor,
                     context: StepContext) -> torch.Tensor:
    for processor in processors:
        processor.process(scores, context)
    return scores


def allowed_pairs(processors: Sequence[StepProcessor],
                  context: StepContext) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The (rows, tokens) a lone processor allows, or None: with others after or before it, they edit
    scores the set does not carry, so the decoder masks and ranks the rows instead."""
    return processors[0].allowed(context) if len(processors) == 1 else None


def forcing_eos(processors: Sequence[StepProcessor], context: StepContext) -> bool:
    """Whether a processor forces EOS at this step (beam search then lets EOS through min_new_tokens)."""
    return any(p.forces_eos(context) for p in processors)
