"""Views of widebeam's internals that only tests read; they live here so the package carries no API
that nothing of its own uses."""

from __future__ import annotations


def live_cumulative_logprobs(state) -> list[float]:
    """A `BeamSearchState`'s live beams' cumulative log-probs (float32 values), in live-beam order:
    what the ranking tests compare against transformers and against a slower reference."""
    return list(state._live_scores)
