"""A run's result: vLLM's `vllm bench serve` keys where they exist, and what beams need beside them.

Conventions (the same as vLLM's unless said):
- latencies in milliseconds: `mean_`, `median_`, `std_` (population) and `pNN_` (numpy's linear
  interpolation; `--metric-percentiles 50,99,99.9` gives p50, p99, p99.9) of `ttft`, `tpot`, `itl`, `e2el`;
  over completed requests; null when no request has that metric (vLLM writes 0 there).
- TTFT: sent to the first chunk carrying text. A beam answer arrives whole at its end, so its TTFT is its
  end-to-end latency and it has no TPOT and no ITL (records.py); TPOT = (e2el - TTFT) / (tokens - 1)
  with tokens per returned choice; ITL: every gap between chunks carrying text.
- throughputs are per second of the run's `duration` (first send to last answer): `request_throughput`
  (completed), `output_throughput` and `total_token_throughput` (usage's tokens), `beams_per_s` (beams
  searched by completed beam requests), `items_per_s` (choices returned by completed catalogue requests).
- `request_goodput`: completed requests that meet every `--goodput` bound (a TPOT bound does not apply
  to a request without a TPOT), per second; null without `--goodput`.
- `failed` (5xx, timeouts, connection errors, cut or errored streams) is counted apart from `rejected`
  (HTTP 4xx, 429 included: refused at admission, the client was told); `failed_by_reason` and
  `rejected_by_status` break them down (`rejected_429_without_retry_after`: 429s that did not say when
  to come back). vLLM's `failed` counts both.
- `invalid_items`: returned catalogue choices whose text is not an item of `--catalogue-path` (null when
  no catalogue file was given: the client cannot tell).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

import numpy as np

from widebeam.bench_serve.records import Outcome, RequestRecord

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


def parse_goodput(pairs: Iterable[str]) -> dict[str, float]:
    """["ttft:500", "e2el:2000"] -> {"ttft": 500.0, "e2el": 2000.0} (milliseconds); ValueError names
    what is wrong."""
    slos: dict[str, float] = {}
    for pair in pairs:
        name, _, value = pair.partition(":")
        if name not in GOODPUT_METRICS:
            raise ValueError(f"goodput metric must be one of {', '.join(GOODPUT_METRICS)}, got {pair!r}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"expected METRIC:MILLISECONDS (e.g. ttft:500), got {pair!r}") from None
        if not slos[name] > 0:
            raise ValueError(f"a goodput bound must be > 0 ms, got {pair!r}")
    return slos


def parse_percentiles(text: str) -> list[float]:
    """"50,99,99.9" -> [50.0, 99.0, 99.9]; each in (0, 100]."""
    try:
        values = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"expected comma-separated percentiles like 50,99, got {text!r}") from None
    if not values or any(not 0 < p <= 100 for p in values):
        raise ValueError(f"percentiles must be in (0, 100], got {text!r}")
    return values


def percentile_key(p: float) -> str:
    return f"p{int(p)}" if int(p) == p else f"p{p}"


def meets_goodput(record: RequestRecord, slos_ms: dict[str, float]) -> bool:
    values_s = {"ttft": record.ttft_s, "tpot": record.tpot_s, "e2el": record.latency_s}
    for name, bound_ms in slos_ms.items():
        value_s = values_s[name]
        if value_s is None and name == "tpot":
            continue  # answered whole: no per-token time to bound
        if value_s is None or value_s * 1000 > bound_ms:
            return False
    return True


def latency_stats(name: str, values_s: Sequence[float], percentiles: Sequence[float]) -> dict:
    """`mean_{name}_ms`, `median_`, `std_` and each `pNN_` of `values_s` (seconds) in milliseconds."""
    if not len(values_s):
        return {f"{k}_{name}_ms": None for k in ("mean", "median", "std",
                                                 *(percentile_key(p) for p in percentiles))}
    ms = np.asarray(values_s, dtype=float) * 1000
    out = {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
           f"std_{name}_ms": float(ms.std())}
    for p in percentiles:
        out[f"{percentile_key(p)}_{name}_ms"] = float(np.percentile(ms, p))
    return out


def compute_result(records: Sequence[RequestRecord], duration_s: float, *,
                   percentiles: Sequence[float] = (99,), goodput_ms: dict[str, float] | None = None,
                   catalogue_items: set[str] | None = None) -> dict:
    done = [r for r in records if r.outcome is Outcome.COMPLETED]
    rejected = [r for r in records if r.outcome is Outcome.REJECTED]
    failed = [r for r in records if r.outcome is Outcome.FAILED]
    duration_s = max(duration_s, 1e-9)
    input_tokens = sum(r.prompt_tokens or 0 for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    result = {
        "duration": duration_s,
        "completed": len(done),
        "failed": len(failed),
        "rejected": len(rejected),
        "rejected_by_status": dict(sorted(Counter(r.reason for r in rejected).items())),
        # a 429 should say when to come back; one that does not leaves the client guessing
        "rejected_429_without_retry_after": sum(r.http_status == 429 and r.retry_after is None
                                                for r in rejected),
        "failed_by_reason": dict(sorted(Counter(r.reason for r in failed).items())),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration_s,
        "request_goodput": (sum(meets_goodput(r, goodput_ms) for r in done) / duration_s
                            if goodput_ms else None),
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
    }
    per_metric = {"ttft": [r.ttft_s for r in done if r.ttft_s is not None],
                  "tpot": [r.tpot_s for r in done if r.tpot_s is not None],
                  "itl": [gap for r in done for gap in r.itls_s],
                  "e2el": [r.latency_s for r in done]}
    for name in LATENCY_METRICS:
        result.update(latency_stats(name, per_metric[name], percentiles))
    result.update(_beam_metrics(done, duration_s, catalogue_items))
    result.update({
        "input_lens": [r.prompt_tokens for r in done],
        "output_lens": [r.output_tokens for r in done],
        "ttfts": [r.ttft_s for r in done],
        "e2els": [r.latency_s for r in done],
        "itls": [r.itls_s for r in done],
        "errors": [r.error for r in records if r.outcome is not Outcome.COMPLETED],
    })
    return result


def _beam_metrics(done: Sequence[RequestRecord], duration_s: float, catalogue_items: set[str] | None) -> dict:
    beams = [r for r in done if r.spec.beam_width]
    from_catalogue = [r for r in done if r.spec.catalogue]
    invalid = None
    if catalogue_items is not None:
        invalid = sum(text.strip() not in catalogue_items for r in from_catalogue for text in r.choice_texts)
    return {
        "beams_per_s": sum(r.spec.beam_width for r in beams) / duration_s,
        "items_per_s": sum(r.num_choices for r in from_catalogue) / duration_s,
        "invalid_items": invalid,
    }
