"""The definitions the fast KV bounds are checked against: the same bounds computed term by term,
slowly (kv/budget.py's `sliding_window_blocks`, kv/schedule_budget.py's `scheduled_blocks`)."""

from __future__ import annotations

from widebeam.kv.budget import _sliding_blocks, blocks_spanned
from widebeam.kv.schedule_budget import width_at_step


def sliding_window_blocks_reference(
    prompt_tokens: int,
    max_new_tokens: int,
    beam_width: int,
    tokens_per_block: int,
    window_tokens: int,
    prefill_chunk_tokens: int | None = None,
    extra_tokens: int = 0,
    refeed_tokens: int = 0,
    cached_prompt_tokens: int = 0,
) -> int:
    """The definition of `sliding_window_blocks`: the same bound with the decode term taken over
    every position x = P .. P + N - 2 (O(N) per call). `sliding_window_blocks` evaluates only
    `_decode_candidate_positions`; tests/unit/test_sliding_bound_fast.py checks they agree (the
    loop's body, `_decode_step_blocks`, is the pre-#30 loop's, unchanged)."""
    return _sliding_blocks(prompt_tokens, max_new_tokens, beam_width, tokens_per_block, window_tokens,
                           prefill_chunk_tokens, extra_tokens, refeed_tokens, cached_prompt_tokens,
                           lambda first, last_fed, *_: range(first, last_fed + 1))


def scheduled_blocks_reference(prompt_tokens: int, max_new_tokens: int, schedule: tuple[int, ...],
                               tokens_per_block: int, window_tokens: int | None = None,
                               beams_own_all: bool = False) -> int:
    """The definition of `scheduled_blocks`, term by term (O(N^2 / T)); the tests compare them."""
    t, p = tokens_per_block, prompt_tokens
    best = -(-p // t) if window_tokens is None else 0
    for k in range(1, max_new_tokens):
        x = p + k - 1
        window_start = 0 if window_tokens is None else max(0, x - window_tokens + 1)
        total = blocks_spanned(window_start, (p // t) * t - 1, t) + width_at_step(schedule, k)
        for b in range(p // t, x // t):
            if (b + 1) * t - 1 < window_start:
                continue
            first_step = (b + 1) * t - p
            steps = [k] if beams_own_all else range(first_step, k + 1)
            total += min(width_at_step(schedule, s) for s in steps)
        best = max(best, total)
    return best


