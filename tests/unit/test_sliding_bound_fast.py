"""`sliding_window_blocks` evaluates its decode term only at `_decode_candidate_positions`
(O(T + R) positions); `sliding_window_blocks_reference` loops over every position and is the
definition. They must agree everywhere."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from kv_reference_bounds import sliding_window_blocks_reference

from widebeam.defaults import MAX_NUM_SPECULATIVE_TOKENS
from widebeam.kv import budget
from widebeam.kv.budget import sliding_window_blocks


def _args(p, n, beams, t, w, chunk=None, extra=0, refeed=0, cached=0):
    return {"prompt_tokens": p, "max_new_tokens": n, "beam_width": beams, "tokens_per_block": t,
            "window_tokens": w, "prefill_chunk_tokens": chunk, "extra_tokens": extra,
            "refeed_tokens": refeed, "cached_prompt_tokens": cached}


# D and R over the whole range the engine accepts (num_speculative_tokens = D, and the engine
# reserves R = D); R is also drawn on its own, which the bound allows.
_TOKENS_D = st.integers(0, MAX_NUM_SPECULATIVE_TOKENS)


@st.composite
def _bound_args(draw):
    prompt = draw(st.integers(1, 300))
    extra = draw(_TOKENS_D)
    return {
        "prompt_tokens": prompt,
        "max_new_tokens": draw(st.integers(1, 400)),
        "beam_width": draw(st.integers(1, 8)),
        "tokens_per_block": draw(st.integers(1, 32)),
        "window_tokens": draw(st.integers(1, 64) | st.integers(65, 512)),
        "prefill_chunk_tokens": draw(st.none() | st.integers(1, 64)),
        "extra_tokens": extra,
        "refeed_tokens": draw(st.just(extra) | _TOKENS_D),
        "cached_prompt_tokens": draw(st.integers(0, prompt - 1)),
    }


@settings(max_examples=2000, deadline=None)
@given(_bound_args())
# the audit's point: a tail window that forgets the re-feed shift gives 27 here
@example(_args(91, 90, 3, 16, 128, extra=25, refeed=25))
@example(_args(91, 90, 3, 16, 128, extra=MAX_NUM_SPECULATIVE_TOKENS, refeed=MAX_NUM_SPECULATIVE_TOKENS))
def test_fast_bound_equals_reference(args):
    assert sliding_window_blocks(**args) == sliding_window_blocks_reference(**args)


def test_the_audit_point_needs_its_refeed_tail():
    """T=16, window 128, P=91, N=90, W=3, D=R=25: the reference loop's maximum lies in the re-feed tail
    (positions within R + T of the last one fed), 29 blocks."""
    args = _args(91, 90, 3, 16, 128, extra=25, refeed=25)
    assert sliding_window_blocks_reference(**args) == 29
    assert sliding_window_blocks(**args) == 29


_EDGES = [
    # N = 1 (no decode step), N = 2 (one step, at x = P)
    *[_args(p, n, 4, t, w) for p in (1, 7, 16, 33) for n in (1, 2) for t in (1, 4, 16) for w in (1, 5, 64)],
    # w < T, w = 1
    *[_args(p, 200, beams, 16, w, extra=4, refeed=r)
      for p in (1, 15, 16, 17, 100) for w in (1, 2, 7, 15) for beams in (1, 3) for r in (0, 2, 4)],
    # P < w
    *[_args(p, 300, 8, t, 64, chunk=c, extra=3, refeed=3)
      for p in (1, 5, 31, 63) for t in (1, 8, 16) for c in (None, 1, 9)],
    # P a multiple of T (no partial prompt block), with and without a cached prefix
    *[_args(k * t, n, 5, t, w, extra=2, refeed=1, cached=cached)
      for t in (1, 4, 16) for k in (1, 3, 8) for n in (2, 3, 50, 400) for w in (1, t, 2 * t + 1, 64)
      for cached in (0, k * t - 1)],
]


@pytest.mark.parametrize("args", _EDGES)
def test_fast_bound_edge_cases(args):
    assert sliding_window_blocks(**args) == sliding_window_blocks_reference(**args)


def test_fast_bound_independent_of_max_new_tokens(monkeypatch):
    """A million new tokens evaluate as many decode positions as ten thousand do (the reference evaluates
    one per position): counted, not timed."""
    calls = []
    step = budget._decode_step_blocks
    monkeypatch.setattr(budget, "_decode_step_blocks", lambda *a, **kw: calls.append(1) or step(*a, **kw))

    def positions(num_new_tokens: int) -> int:
        calls.clear()
        sliding_window_blocks(2048, num_new_tokens, 8, 16, 512, 512, extra_tokens=4, refeed_tokens=4)
        return len(calls)

    # three windows of about a block each (and the re-feed), whatever N: 75 positions here
    assert positions(1_000_000) == positions(10_000) <= 5 * 16 + 2 * 4
    args = _args(2048, 5000, 8, 16, 512, chunk=512, extra=4, refeed=4)
    assert sliding_window_blocks(**args) == sliding_window_blocks_reference(**args)


def test_plan_at_64gib_on_a_sliding_config_evaluates_few_positions(monkeypatch, capsys):
    """`widebeam plan` on Gemma 3 (sliding layers) at 64 GiB: the fit hints binary-search max_new_tokens
    up to the pool's capacity in tokens (millions), each probe one bound. With the O(T) bound the whole
    plan evaluates a few thousand decode positions; the per-position loop would evaluate billions."""
    from widebeam.cli import main

    calls = []
    step = budget._decode_step_blocks
    monkeypatch.setattr(budget, "_decode_step_blocks", lambda *a, **kw: calls.append(1) or step(*a, **kw))
    assert main(["plan", "--model", "gemma3-270m", "--memory", "64GiB", "--json"]) == 0
    assert '"bytes_per_token"' in capsys.readouterr().out
    assert 0 < len(calls) < 200_000
