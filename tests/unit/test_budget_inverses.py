"""What the cost model tells a user who does not fit, checked against the bound itself, and the
sliding-window prefill bound's candidate starts checked against every start (found by the mutation
check, `make mutation`: these were the surviving mutants of kv/budget.py and kv/managers.py).

A refusal's hints are exact: `max_new_tokens_that_fit` is the largest N whose bound fits the pool (one
more does not), `beam_width_that_fits` likewise for W, with the speculative extra tokens D and the
re-fed tokens R as the request has them, in full and sliding-window pools.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

import pytest

from widebeam.errors import RequestTooLargeError
from widebeam.kv import KVCache, KVRequest
from widebeam.kv.budget import _prefill_chunk_starts, _prefill_span_blocks
from widebeam.kv.spec import FullAttentionSpec, SlidingWindowSpec


def spec(kind, window=None):
    if kind == "full":
        return FullAttentionSpec(name="self", num_layers=1, num_kv_heads=1, head_dim=4)
    return SlidingWindowSpec(name="sliding", num_layers=1, num_kv_heads=1, head_dim=4, window_tokens=window)


def required(cache, request):
    (budget,) = cache.budgets(request)
    return budget.required_blocks


def random_requests(seed, count):
    rng = random.Random(seed)
    for _ in range(count):
        kind = rng.choice(["full", "sliding"])
        t = rng.choice([1, 2, 4, 16])
        window = rng.randint(1, 40)
        chunk = rng.choice([None, rng.randint(1, 48)])
        cache = KVCache([(spec(kind, window), rng.randint(1, 120))], tokens_per_block=t,
                        prefill_chunk_tokens=chunk)
        d = rng.choice([0, 0, 1, 3, 4])
        request = KVRequest(rng.randint(1, 90), rng.randint(1, 80), rng.randint(1, 64), extra_tokens=d,
                            refeed_tokens=d if kind == "sliding" else 0)
        yield cache, request


@pytest.mark.parametrize("seed", range(4))
def test_refusal_hints_are_the_largest_values_that_fit(seed):
    refused = 0
    for cache, request in random_requests(seed, 150):
        capacity = cache.managers[next(iter(cache.managers))].capacity_blocks()
        try:
            cache.check_fits(request)
            assert required(cache, request) <= capacity
            continue
        except RequestTooLargeError as exc:
            refused += 1
            error = exc
        assert required(cache, request) > capacity
        n = error.max_new_tokens_that_fit
        if n >= 1:
            assert required(cache, replace(request, max_new_tokens=n)) <= capacity
        else:  # not even one token: the bound at N = 1 is already too large
            assert required(cache, replace(request, max_new_tokens=1)) > capacity
        assert required(cache, replace(request, max_new_tokens=max(n, 0) + 1)) > capacity
        w = error.beam_width_that_fits
        if w >= 1:
            assert required(cache, replace(request, beam_width=w)) <= capacity
        assert required(cache, replace(request, beam_width=max(w, 0) + 1)) > capacity
        assert f"pool '{error.pool}'" in str(error)
    assert refused >= 40


def test_candidate_prefill_starts_give_the_maximum_over_every_start():
    """`_prefill_chunk_starts` is a handful of chunk starts that must reach the largest span any start
    gives (sliding_window_blocks' docstring): checked against all of them."""
    cases = itertools.product(range(1, 34), (1, 3, 8, 13), (1, 2, 4, 5), (None, 1, 3, 7, 16), (0, 5, 12))
    for prompt, window, t, chunk, first in cases:
        if first >= prompt:
            continue
        every = max(_prefill_span_blocks(s, prompt, window, t, chunk) for s in range(first, prompt))
        starts = _prefill_chunk_starts(prompt, window, t, chunk, first)
        assert starts and all(first <= s < prompt for s in starts)
        assert max(_prefill_span_blocks(s, prompt, window, t, chunk) for s in starts) == every, (
            prompt, window, t, chunk, first)
