"""Pure block math: the most blocks a request can ever hold in a pool, and its inverses.

Notation (docs/architecture.md shows where each bound is used): P prompt tokens, N max_new_tokens,
W beam width, T tokens per block, D extra (draft) tokens reserved per sequence, R refeed tokens (the
most pending tokens beyond one a decode step may feed: speculative tokens accepted last round and fed
again; sliding-window pools only), E encoder output tokens. All results are in blocks of the pool in
question.
"""

from __future__ import annotations

from dataclasses import dataclass


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def check_non_negative(**values: int) -> None:
    """Raise `ValueError` naming the first negative value."""
    for name, value in values.items():
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")


def _written_tokens_per_beam(max_new_tokens: int, extra_tokens: int) -> int:
    """Tokens past the prompt whose K/V one beam writes, at most: the N - 1 generated tokens fed back
    (the N-th is chosen and never fed) and the D speculative slots of the round that feeds the last
    of them (`decode_slots(k + D)` takes all D even when fewer can be drafted)."""
    return max_new_tokens - 1 + extra_tokens


def full_attention_blocks(
    prompt_tokens: int, max_new_tokens: int, beam_width: int, tokens_per_block: int, extra_tokens: int = 0
) -> int:
    """`floor(P/T) + ceil((P mod T + N - 1 + D)/T) * W` for N >= 2; `ceil(P/T)` for N <= 1.

    The full prompt blocks are stored once and shared by every beam. What a beam can make its own is
    the partial last prompt block (copied on first write) plus the blocks of what it writes after the
    prompt: N - 1 generated tokens (the N-th is chosen, never fed) and D speculative slots. With
    N <= 1 no decode step runs: the prompt alone is held, once, whatever W and D. For W = 1 this is
    `ceil((P + N - 1 + D)/T)`. Re-fed tokens (after a preemption, or accepted speculative ones) are
    written again at their own positions, so they add nothing here. Every beam diverging at once
    reaches it exactly (tests/unit/test_kv_traces.py, test_kv_tightness_engine.py).
    """
    check_non_negative(prompt_tokens=prompt_tokens, max_new_tokens=max_new_tokens, extra_tokens=extra_tokens)
    if beam_width < 1 or tokens_per_block < 1:
        raise ValueError("beam_width and tokens_per_block must be >= 1")
    if max_new_tokens <= 1:
        return _ceil_div(prompt_tokens, tokens_per_block)
    shared_blocks = prompt_tokens // tokens_per_block
    own_tokens = prompt_tokens % tokens_per_block + _written_tokens_per_beam(max_new_tokens, extra_tokens)
    return shared_blocks + _ceil_div(own_tokens, tokens_per_block) * beam_width


def cross_attention_blocks(encoder_tokens: int, tokens_per_block: int) -> int:
    """`ceil(E/T)`: computed once per request and shared by all its beams; never grows."""
    check_non_negative(encoder_tokens=encoder_tokens)
    return _ceil_div(encoder_tokens, tokens_per_block)


def max_new_tokens_that_fit(
    capacity_blocks: int, prompt_tokens: int, beam_width: int, tokens_per_block: int, extra_tokens: int = 0
) -> int:
    """Largest N with `full_attention_blocks(P, N, W, T, D) <= capacity`; 0 or less when none fits."""
    per_beam_blocks = (capacity_blocks - prompt_tokens // tokens_per_block) // beam_width
    # the largest N >= 2 whose own tokens, P mod T + N - 1 + D, fill at most per_beam_blocks blocks
    largest = per_beam_blocks * tokens_per_block - prompt_tokens % tokens_per_block - extra_tokens + 1
    if largest >= 2:
        return largest
    # N = 1 holds the prompt alone (and so does N = 0)
    return 1 if _ceil_div(prompt_tokens, tokens_per_block) <= capacity_blocks else min(largest, 0)


def beam_width_that_fits(
    capacity_blocks: int, prompt_tokens: int, max_new_tokens: int, tokens_per_block: int,
    extra_tokens: int = 0,
) -> int:
    """Largest W with `full_attention_blocks(P, N, W, T, D) <= capacity`; 0 when none fits (2**31 - 1
    when W does not matter: N <= 1 holds the prompt alone)."""
    if max_new_tokens <= 1:
        return 0 if _ceil_div(prompt_tokens, tokens_per_block) > capacity_blocks else 2**31 - 1
    own_tokens = prompt_tokens % tokens_per_block + _written_tokens_per_beam(max_new_tokens, extra_tokens)
    per_beam_blocks = _ceil_div(own_tokens, tokens_per_block)  # >= 1: N >= 2
    spare_blocks = capacity_blocks - prompt_tokens // tokens_per_block
    return max(0, spare_blocks // per_beam_blocks)


def naive_full_attention_blocks(
    prompt_tokens: int, max_new_tokens: int, beam_width: int, tokens_per_block: int
) -> int:
    """What an engine that copies the prompt into every beam reserves: `ceil((P + N)/T) * W`."""
    return _ceil_div(prompt_tokens + max_new_tokens, tokens_per_block) * beam_width


def naive_max_seq_len(capacity_blocks: int, beam_width: int, tokens_per_block: int) -> int:
    """The start-up bound of engines that divide the pool by the beam width: `floor(capacity/W) * T`."""
    return (capacity_blocks // beam_width) * tokens_per_block


@dataclass(frozen=True)
class KVRequest:
    """What the cache needs to know about a request to bound its blocks: lengths and beam width."""

    prompt_tokens: int
    max_new_tokens: int
    beam_width: int = 1
    extra_tokens: int = 0
    encoder_tokens: int = 0
    # R: the most pending tokens beyond one a decode step feeds (speculative decoding re-feeds the
    # tokens it accepted last round); only sliding-window pools depend on it.
    refeed_tokens: int = 0
    # L: prompt tokens the request is sure to find cached (a pinned prefix), so its prefill starts
    # at L or later; only sliding-window pools depend on it (the other kinds count the hit as held).
    cached_prompt_tokens: int = 0
    # A beam-width schedule (w_1, ..., w_L), or () for the constant `beam_width` (see
    # `scheduled_blocks`); with one, `beam_width` is its widest step.
    beam_width_schedule: tuple[int, ...] = ()
    # Whether a preemption may resume the request by re-feeding each beam's tokens into its own
    # blocks (the max_utilization policy): a schedule's bound then counts every block per beam.
    refeeds_after_preemption: bool = False

    def __post_init__(self) -> None:
        check_non_negative(
            prompt_tokens=self.prompt_tokens,
            max_new_tokens=self.max_new_tokens,
            extra_tokens=self.extra_tokens,
            encoder_tokens=self.encoder_tokens,
            refeed_tokens=self.refeed_tokens,
            cached_prompt_tokens=self.cached_prompt_tokens,
        )
        if self.cached_prompt_tokens >= max(self.prompt_tokens, 1):
            raise ValueError("cached_prompt_tokens must leave at least one prompt token to compute")
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be >= 1, got {self.beam_width}")
        if self.beam_width_schedule:
            if any(w < 1 for w in self.beam_width_schedule):
                raise ValueError(f"beam_width_schedule must hold widths >= 1, got {self.beam_width_schedule}")
            if self.extra_tokens or self.refeed_tokens:
                raise ValueError("a beam_width_schedule takes no draft or re-fed tokens (extra_tokens, "
                                 "refeed_tokens must be 0)")


def blocks_spanned(first_position: int, last_position: int, tokens_per_block: int) -> int:
    """Blocks holding any position of [first_position, last_position] (0 when empty)."""
    if last_position < first_position:
        return 0
    return last_position // tokens_per_block - first_position // tokens_per_block + 1


def _prefill_span_blocks(start: int, prompt_tokens: int, window_tokens: int, tokens_per_block: int,
                         prefill_chunk_tokens: int | None) -> int:
    chunk = prompt_tokens - start
    if prefill_chunk_tokens is not None:
        chunk = min(prefill_chunk_tokens, chunk)
    return blocks_spanned(max(0, start - window_tokens + 1), start + chunk - 1, tokens_per_block)


def _prefill_chunk_starts(prompt_tokens: int, window_tokens: int, tokens_per_block: int,
                          prefill_chunk_tokens: int | None, first_start: int = 0) -> set[int]:
    """Chunk starts from `first_start` on that cover every regime of `_prefill_span_blocks` (see
    sliding_window_blocks)."""
    t, last = tokens_per_block, prompt_tokens - 1
    chunk = prompt_tokens if prefill_chunk_tokens is None else prefill_chunk_tokens
    tail = max(0, prompt_tokens - chunk)
    starts = {0, min(window_tokens - 1, last), first_start}
    starts.update(range(window_tokens - 1, window_tokens - 1 + t))
    starts.update(range(first_start, first_start + t + 1))  # one period of the sliding regime
    starts.update(range(tail - t, tail + t + 1))
    return {s for s in starts if first_start <= s <= last}


def sliding_prefill_blocks(prompt_tokens: int, window_tokens: int, tokens_per_block: int,
                           prefill_chunk_tokens: int | None, cached_prompt_tokens: int) -> int:
    """The prefill term of the sliding-window bounds: the most blocks one prompt chunk's window spans
    (one sequence, whatever the beam width; see sliding_window_blocks)."""
    starts = _prefill_chunk_starts(prompt_tokens, window_tokens, tokens_per_block, prefill_chunk_tokens,
                                   cached_prompt_tokens)
    return max(_prefill_span_blocks(s, prompt_tokens, window_tokens, tokens_per_block, prefill_chunk_tokens)
               for s in starts)


def sliding_window_blocks(
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
    """The most blocks a request holds in a sliding-window pool (window w, query i sees keys j with
    i - j < w), for the policy of `SlidingWindowManager`: before the tokens of a step are written,
    every beam drops the blocks that lie wholly before its next query's window, then the new
    tokens' blocks are taken (copying a shared partial block first).

    Prefill (one sequence, chunks of at most C tokens, starting anywhere the scheduler's budget
    leaves them): writing positions [s, s + c) keeps keys [max(0, s - w + 1), s + c - 1], widest
    with c = min(C, P - s). The blocks that interval spans depend on s only through three regimes
    (the window still at 0, the interval sliding with period T, the prompt's end cutting the
    chunk), so a handful of starts `_prefill_chunk_starts` gives the exact maximum. A request sure
    to find its first L prompt tokens cached (`cached_prompt_tokens`, a pinned prefix) starts at L
    or later, holding the window's blocks before its start as if it had computed them.

    Decode (W beams): a step with x tokens committed feeds 1 + r pending tokens (r <= R: tokens
    accepted by the last speculative round, fed again) and D extra ones (e.g. draft tokens, rolled
    back after the step), so it writes positions x .. x + r + D having trimmed by x alone (the first
    pending query, at x, still sees keys from x - w + 1). The full prompt blocks that still overlap
    [x - w + 1, x] are shared by all beams; each beam owns the blocks from its partial prompt block
    (or the window start, if later) up to x + r + D. The last pending token fed is the (N - 1)-th
    generated one, at position P + N - 2 (the N-th is never fed, as in `full_attention_blocks`), so
    the bound is the largest such total over x = P .. P + N - 2, with r = min(R, P + N - 2 - x) and
    r = 0 at x = P (the first step feeds only the token the prompt produced); N <= 1 runs no decode
    step. Beams that all diverge at once reach it, a speculative round at x with k = r + 1 pending
    tokens (the last round accepted k) included.
    """
    return _sliding_blocks(prompt_tokens, max_new_tokens, beam_width, tokens_per_block, window_tokens,
                           prefill_chunk_tokens, extra_tokens, refeed_tokens, cached_prompt_tokens,
                           _decode_candidate_positions)


def _sliding_blocks(prompt_tokens: int, max_new_tokens: int, beam_width: int, tokens_per_block: int,
                    window_tokens: int, prefill_chunk_tokens: int | None, extra_tokens: int,
                    refeed_tokens: int, cached_prompt_tokens: int, decode_positions) -> int:
    """`sliding_window_blocks` with the decode term's maximum taken over
    `decode_positions(P, last_fed, T, w, R)`: the candidates, or every position (the
    definition the tests check it against: tests/kv_reference_bounds.py)."""
    if window_tokens < 1:
        raise ValueError(f"window_tokens must be >= 1, got {window_tokens}")
    t = tokens_per_block
    # validates the common arguments the same way the full-attention bound does
    full = full_attention_blocks(prompt_tokens, max_new_tokens, beam_width, t, extra_tokens)
    check_non_negative(refeed_tokens=refeed_tokens)
    prefill_blocks = sliding_prefill_blocks(prompt_tokens, window_tokens, t, prefill_chunk_tokens,
                                            cached_prompt_tokens)
    last_fed = prompt_tokens + max_new_tokens - 2  # the position of the last token ever fed
    decode_blocks = max(
        (_decode_step_blocks(x, prompt_tokens, last_fed, beam_width, t, window_tokens, extra_tokens,
                             refeed_tokens)
         for x in decode_positions(prompt_tokens, last_fed, t, window_tokens, refeed_tokens)),
        default=0,
    )
    return min(full, max(prefill_blocks, decode_blocks))


def _decode_step_blocks(x: int, prompt_tokens: int, last_fed: int, beam_width: int, tokens_per_block: int,
                        window_tokens: int, extra_tokens: int, refeed_tokens: int) -> int:
    """Blocks held by a decode step with x tokens committed (see sliding_window_blocks): the shared
    full prompt blocks still in the window plus each beam's own blocks."""
    t = tokens_per_block
    shared_end = (prompt_tokens // t) * t  # positions below this live in shared full prompt blocks
    # A step writes positions x .. x + r + D at once (r pending tokens fed again, D speculative
    # ones rolled back after), having trimmed by the committed length x: keys from the first
    # query's window start stay.
    refeed = 0 if x == prompt_tokens else min(refeed_tokens, last_fed - x)
    window_start = max(0, x - window_tokens + 1)
    shared = blocks_spanned(window_start, shared_end - 1, t)
    own = blocks_spanned(max(window_start, shared_end), x + refeed + extra_tokens, t)
    return shared + own * beam_width


def _decode_candidate_positions(prompt_tokens: int, last_fed: int, tokens_per_block: int,
                                window_tokens: int, refeed_tokens: int) -> set[int]:
    """The positions x at which `_decode_step_blocks` can reach its maximum over P .. last_fed.

    Away from x = P (r = 0) and the last R positions (r shrinking), r = R and the term depends on
    x through the window start s = max(0, x - w + 1) against the shared end E = floor(P/T)*T:
    while s <= E (x <= c = E + w - 1) a beam's own span [E, x + R + D] grows by one block every T
    positions while the shared part loses at most one, so f(x + T) >= f(x) and the maximum of that
    stretch lies in its last T positions; once s > E nothing is shared and the own span
    [x - w + 1, x + R + D] has a fixed length, so f is periodic with period T and one period from
    the stretch's start holds its maximum. The set takes a period (and one more) on both sides of
    each boundary: P, c and last_fed - R, clipped to P .. last_fed. (Near c the first stretch stays
    at or below the second's periodic values, so the last R + T + 2 positions with x = P already
    reach the maximum; dropping that tail's period makes tests/unit/test_sliding_bound_fast.py fail,
    dropping the windows at P or c does not. They are kept as cheap margin.)"""
    t = tokens_per_block
    if last_fed < prompt_tokens:
        return set()
    shared_end = (prompt_tokens // t) * t
    crossing = shared_end + window_tokens - 1  # the last x whose window start is <= the shared end
    candidates = set(range(prompt_tokens, prompt_tokens + t + 2))
    candidates.update(range(crossing - t - 1, crossing + t + 2))
    candidates.update(range(last_fed - refeed_tokens - t - 1, last_fed + 1))
    return {x for x in candidates if prompt_tokens <= x <= last_fed}
