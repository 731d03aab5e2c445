"""`widebeam bench serve`'s result arithmetic on hand-written records: percentiles, TPOT, goodput (every
bound met, a TPOT bound not applying to a beam answer that came whole), throughputs, beams and items per
second, invalid items, and rejected (4xx) counted apart from failed (5xx, timeouts)."""

from __future__ import annotations

import math

import pytest

from widebeam.bench_serve.metrics import compute_result, parse_goodput, parse_percentiles, percentile_key
from widebeam.bench_serve.records import Outcome, RequestRecord, RequestSpec

CHAT = RequestSpec("/v1/chat/completions", {}, "chat-greedy")
GENREC = RequestSpec("/v1/completions", {}, "genrec", beam_width=64, catalogue=True)
DURATION_S = 4.0
VLLM_KEYS = ["duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
             "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
             "input_lens", "output_lens", "ttfts", "itls", "errors",
             *(f"{stat}_{metric}_ms" for metric in ("ttft", "tpot", "itl", "e2el")
               for stat in ("mean", "median", "std", "p99"))]


def records() -> list[RequestRecord]:
    done = Outcome.COMPLETED
    return [
        # TPOT (0.5 - 0.1) / (5 - 1) = 100 ms
        RequestRecord(CHAT, done, latency_s=0.5, ttft_s=0.1, itls_s=[0.1, 0.1, 0.2], num_text_chunks=4,
                      prompt_tokens=10, output_tokens=5, num_choices=1, choice_texts=["hello"]),
        # TPOT (1.0 - 0.2) / (3 - 1) = 400 ms
        RequestRecord(CHAT, done, latency_s=1.0, ttft_s=0.2, itls_s=[0.4, 0.4], num_text_chunks=3,
                      prompt_tokens=20, output_tokens=3, num_choices=1, choice_texts=["hi"]),
        # a beam answer, whole at the end: TTFT = e2el, no TPOT, no ITL; 12 tokens over 4 items
        RequestRecord(GENREC, done, latency_s=2.0, ttft_s=2.0, num_text_chunks=1, output_tokens=12,
                      num_choices=4, choice_texts=["a", " b", "z", "a"]),
        RequestRecord(CHAT, Outcome.REJECTED, latency_s=0.01, http_status=429, reason="429", error="full"),
        RequestRecord(CHAT, Outcome.REJECTED, latency_s=0.01, http_status=429, reason="429", error="full",
                      retry_after="2"),
        RequestRecord(GENREC, Outcome.REJECTED, latency_s=0.01, http_status=400, reason="400", error="never"),
        RequestRecord(CHAT, Outcome.FAILED, latency_s=0.3, http_status=500, reason="500", error="boom"),
        RequestRecord(CHAT, Outcome.FAILED, latency_s=3.0, reason="timeout", error="slow"),
    ]


def test_vllm_keys_are_there():
    result = compute_result(records(), DURATION_S, goodput_ms={"e2el": 1000})
    missing = [k for k in VLLM_KEYS if k not in result]
    assert not missing, missing


def test_counts_rejected_apart_from_failed():
    result = compute_result(records(), DURATION_S)
    assert (result["completed"], result["rejected"], result["failed"]) == (3, 3, 2)
    assert result["rejected_by_status"] == {"400": 1, "429": 2}
    assert result["rejected_429_without_retry_after"] == 1
    assert result["failed_by_reason"] == {"500": 1, "timeout": 1}
    assert sorted(result["errors"]) == ["boom", "full", "full", "never", "slow"]


def test_latency_statistics_by_hand():
    r = compute_result(records(), DURATION_S, percentiles=[50, 99])
    # e2el of the completed: 500, 1000, 2000 ms
    assert r["mean_e2el_ms"] == pytest.approx(3500 / 3)
    assert r["median_e2el_ms"] == r["p50_e2el_ms"] == pytest.approx(1000)
    assert r["std_e2el_ms"] == pytest.approx(math.sqrt(((500 - 3500 / 3) ** 2 + (1000 - 3500 / 3) ** 2
                                                         + (2000 - 3500 / 3) ** 2) / 3))
    assert r["p99_e2el_ms"] == pytest.approx(1000 + 0.98 * 1000)  # linear between the 2nd and 3rd
    # ttft: 100, 200, 2000 ms (the beam's is its whole latency)
    assert r["p99_ttft_ms"] == pytest.approx(200 + 0.98 * 1800)
    # tpot: only the streamed answers, 100 and 400 ms
    assert r["mean_tpot_ms"] == pytest.approx(250)
    assert r["p99_tpot_ms"] == pytest.approx(100 + 0.99 * 300)
    # itl: every gap of the streamed answers
    assert r["mean_itl_ms"] == pytest.approx(240)
    assert r["median_itl_ms"] == pytest.approx(200)
    assert r["e2els"] == [0.5, 1.0, 2.0]


def test_throughputs_beams_and_items():
    r = compute_result(records(), DURATION_S, catalogue_items={"a", "b", "c"})
    assert r["duration"] == DURATION_S
    assert r["request_throughput"] == pytest.approx(3 / 4)
    assert r["total_output_tokens"] == 20 and r["output_throughput"] == pytest.approx(5)
    assert r["total_input_tokens"] == 30 and r["total_token_throughput"] == pytest.approx(50 / 4)
    assert r["beams_per_s"] == pytest.approx(64 / 4)
    assert r["items_per_s"] == pytest.approx(4 / 4)
    assert r["invalid_items"] == 1  # "z"; " b" is "b" once stripped
    assert compute_result(records(), DURATION_S)["invalid_items"] is None  # no catalogue file: unknown


@pytest.mark.parametrize(("goodput_ms", "num_good"), [
    ({"ttft": 300, "e2el": 1500}, 2),  # the beam's 2,000 ms misses both bounds
    ({"e2el": 1000}, 2),  # a bound is met at equality
    ({"e2el": 999}, 1),
    ({"tpot": 200}, 2),  # 100 ms meets it, 400 ms does not; the beam has no TPOT: the bound does not apply
    ({"ttft": 150, "tpot": 500, "e2el": 5000}, 1),  # every bound must hold
    ({"ttft": 10_000, "tpot": 10_000, "e2el": 10_000}, 3),  # rejected and failed never count
])
def test_goodput_counts_requests_meeting_every_bound(goodput_ms, num_good):
    r = compute_result(records(), DURATION_S, goodput_ms=goodput_ms)
    assert r["request_goodput"] == pytest.approx(num_good / DURATION_S)


def test_no_goodput_bounds_is_null():
    assert compute_result(records(), DURATION_S)["request_goodput"] is None


def test_nothing_completed_gives_nulls_not_zeros():
    r = compute_result(records()[3:], DURATION_S, percentiles=[99.9])
    assert r["completed"] == 0 and r["request_throughput"] == 0
    assert r["mean_ttft_ms"] is None and r["p99.9_e2el_ms"] is None


def test_parsers():
    assert parse_goodput(["ttft:500", "e2el:2000.5"]) == {"ttft": 500.0, "e2el": 2000.5}
    for bad in (["itl:5"], ["ttft"], ["ttft:x"], ["ttft:0"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)
    assert parse_percentiles("50, 99,99.9") == [50.0, 99.0, 99.9]
    for bad in ("", "0", "101", "x"):
        with pytest.raises(ValueError):
            parse_percentiles(bad)
    assert [percentile_key(p) for p in (50, 99.0, 99.9)] == ["p50", "p99", "p99.9"]
