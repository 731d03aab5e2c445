"""`widebeam bench serve`'s arrival times: gamma gaps with mean 1/rate whatever the burstiness, a coefficient
of variation of 1/sqrt(burstiness) (1 = Poisson), all at once for an infinite rate, the same for a seed."""

from __future__ import annotations

import math

import numpy as np
import pytest

from widebeam.bench_serve.arrivals import arrival_gaps_s, arrival_offsets_s

NUM_DRAWS = 40_001  # 40,000 gaps: the mean within ~1% (CV <= 2 here), the CV within a few %


@pytest.mark.parametrize("request_rate", [0.5, 4.0, 250.0])
@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_mean_gap_is_one_over_rate_and_cv_is_one_over_sqrt_shape(request_rate, burstiness):
    gaps = arrival_gaps_s(NUM_DRAWS, request_rate, burstiness, seed=7)
    assert gaps.shape == (NUM_DRAWS - 1,)
    assert gaps.min() >= 0
    assert gaps.mean() == pytest.approx(1 / request_rate, rel=0.03)
    cv = gaps.std() / gaps.mean()
    assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_burstiness_one_is_poisson():
    """Exponential gaps: the count of arrivals in unit windows has variance equal to its mean."""
    offsets = arrival_offsets_s(NUM_DRAWS, 10.0, 1.0, seed=3)
    counts = np.bincount(offsets.astype(int))[:-1]  # whole windows only
    assert counts.mean() == pytest.approx(10, rel=0.03)
    assert counts.var() == pytest.approx(counts.mean(), rel=0.1)


def test_burstier_is_more_variable():
    calm = arrival_gaps_s(5_000, 2.0, 8.0, seed=1).std()
    bursty = arrival_gaps_s(5_000, 2.0, 0.2, seed=1).std()
    assert bursty > 4 * calm


def test_a_seed_gives_the_same_schedule_and_another_seed_another():
    a = arrival_offsets_s(100, 3.0, 0.5, seed=11)
    assert np.array_equal(a, arrival_offsets_s(100, 3.0, 0.5, seed=11))
    assert not np.array_equal(a, arrival_offsets_s(100, 3.0, 0.5, seed=12))


def test_offsets_start_at_zero_and_never_go_back():
    offsets = arrival_offsets_s(50, 5.0, 0.3, seed=0)
    assert offsets[0] == 0 and len(offsets) == 50
    assert np.all(np.diff(offsets) >= 0)
    assert np.allclose(np.diff(offsets), arrival_gaps_s(50, 5.0, 0.3, seed=0))


def test_infinite_rate_sends_everything_at_once():
    assert np.array_equal(arrival_offsets_s(8, math.inf), np.zeros(8))
    assert len(arrival_offsets_s(0, 1.0)) == 0 and len(arrival_offsets_s(1, 1.0)) == 1


@pytest.mark.parametrize(("request_rate", "burstiness"),
                         [(0, 1), (-1, 1), (math.nan, 1), (1, 0), (1, math.inf)])
def test_bad_rate_or_burstiness_is_refused(request_rate, burstiness):
    with pytest.raises(ValueError, match="request_rate|burstiness"):
        arrival_gaps_s(10, request_rate, burstiness)
