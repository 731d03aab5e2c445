"""Logits processors: an ordered list each request applies to its scores before choosing tokens.

A processor edits scores `[rows, vocab]` in place given how many tokens the request has generated.
The order is the list's: later processors see (and may override) what earlier ones did, as in
transformers' `LogitsProcessorList`. A processor with per-beam state (a catalogue constraint)
also follows the beams (`BeamStateProcessor`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

import torch


class LogitsProcessor(Protocol):
    def __call__(self, scores: torch.Tensor, num_generated_tokens: int) -> None:
        """Edit `scores` [rows, vocab] in place before the next token is chosen."""


@runtime_checkable
class BeamStateProcessor(Protocol):
    """A processor with state per live beam (a catalogue constraint's trie node): the beam decoder
    tells it how the beams moved after every step, and which finished on a stop string."""

    def __call__(self, scores: torch.Tensor, num_generated_tokens: int) -> None: ...

    def reorder(self, parent_indices: Sequence[int], token_ids: Sequence[int]) -> None: ...

    def drop(self, seq_indices: Iterable[int]) -> None: ...


@runtime_checkable
class SequenceStateProcessor(Protocol):
    """A processor with state for a single sequence (penalties, a grammar matcher): a sampling decoder
    hands it its generated tokens as a live list once, read at each call."""

    def __call__(self, scores: torch.Tensor, num_generated_tokens: int) -> None: ...

    def follow(self, generated_token_ids: list[int]) -> None: ...


@runtime_checkable
class AllowedSetProcessor(BeamStateProcessor, Protocol):
    """A processor that only allows a set of (beam, token) pairs each step (a catalogue): alone in
    a request's list, the beam search ranks that set directly instead of a masked copy of the rows."""

    def allowed(self, num_rows: int, num_generated_tokens: int) -> tuple[torch.Tensor, torch.Tensor]: ...


class BanUntilMinTokens:
    """Tokens that may not come before `min_new_tokens` tokens were generated (EOS, unless ignored,
    and the stop token ids), masked as transformers and vLLM do: not emitted, walked past."""

    def __init__(self, min_new_tokens: int, token_ids: Iterable[int]):
        self.min_new_tokens = min_new_tokens
        self.token_ids = sorted(set(token_ids))

    def __call__(self, scores: torch.Tensor, num_generated_tokens: int) -> None:
        if num_generated_tokens < self.min_new_tokens and self.token_ids:
            scores[:, self.token_ids] = float("-inf")


class SuppressTokens:
    """Tokens never generated (HF `bad_words_ids` of single tokens, e.g. Marian's pad)."""

    def __init__(self, token_ids: Sequence[int]):
        self.token_ids = list(token_ids)

    def __call__(self, scores: torch.Tensor, num_generated_tokens: int) -> None:
        scores[:, self.token_ids] = float("-inf")


class ForceEOSAtEnd:
    """HF `forced_eos_token_id`: the last allowed token (number `max_new_tokens`) is this one.
    It overrides every earlier processor, min_new_tokens' EOS ban included, as in HF."""

    def __init__(self, eos_token_id: int, max_new_tokens: int):
        self.eos_token_id = eos_token_id
        self.max_new_tokens = max_new_tokens

    def forcing(self, num_generated_tokens: int) -> bool:
        return num_generated_tokens == self.max_new_tokens - 1

    def __call__(self, scores: torch.Tensor, num_generated_tokens: int) -> None:
        if self.forcing(num_generated_tokens):
            scores.fill_(float("-inf"))
            scores[:, self.eos_token_id] = 0.0


def apply_processors(processors: Sequence[LogitsProcessor], scores: torch.Tensor,
                     num_generated_tokens: int) -> torch.Tensor:
    for processor in processors:
        processor(scores, num_generated_tokens)
    return scores


def forcing_eos(processors: Sequence[LogitsProcessor], num_generated_tokens: int) -> bool:
    """Whether a processor forces EOS at this step (beam search then lets EOS through min_new_tokens)."""
    return any(isinstance(p, ForceEOSAtEnd) and p.forcing(num_generated_tokens) for p in processors)
