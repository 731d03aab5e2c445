"""Prompt lookup: draft the tokens that followed the latest earlier occurrence of the sequence's
last n tokens in its own prompt and output (n from `max_ngram` down to 1). Free to run, and right
whenever the output copies its input (rewriting, extraction, code edits, translation of names)."""

from __future__ import annotations

from collections.abc import Sequence

DEFAULT_MAX_NGRAM = 3


def lookup_continuation(history: Sequence[int], num_tokens: int,
                        max_ngram: int = DEFAULT_MAX_NGRAM) -> list[int]:
    """Up to `num_tokens` tokens to draft after `history`; empty when no suffix n-gram recurs."""
    if num_tokens < 1 or len(history) < 2:
        return []
    length = len(history)
    for n in range(min(max_ngram, length - 1), 0, -1):
        suffix = list(history[length - n:])
        # the latest earlier match: recent context predicts best
        for start in range(length - n - 1, -1, -1):
            if list(history[start:start + n]) == suffix:
                follow = list(history[start + n:start + n + num_tokens])
                if follow:
                    return follow
    return []
