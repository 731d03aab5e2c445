"""Stop strings: where a text must be cut, and how much of a streamed text is safe to send.

Searching only the tail a new piece of text can complete keeps the work per step independent of
the text's length.
"""

from __future__ import annotations

from collections.abc import Sequence


def stop_string_cut(text: str, stops: Sequence[str], start: int = 0) -> int | None:
    """Where the earliest stop string that ends at or after `start` begins in `text`, or None.

    `start` is the first new character: a stop string found before it would have been found then."""
    if not stops:
        return None
    positions = []
    for stop in stops:
        found = text.find(stop, max(0, start - len(stop) + 1))
        if found >= 0:
            positions.append(found)
    return min(positions) if positions else None


def held_back_chars(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters could still be the start of a stop string (not safe to stream)."""
    held = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), held, -1):
            if text.endswith(stop[:k]):
                held = k
                break
    return held
