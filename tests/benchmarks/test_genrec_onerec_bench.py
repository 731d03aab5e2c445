"""benchmarks/genrec_onerec.py's own logic, without a model: the synthetic catalogue (distinct items,
the Zipf first code spread over many codes), the knobs' parsing, and the variants' interleaving
(every chunk run by every variant, the order reversed every other chunk, measurements summed)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import genrec_onerec as bench


def test_catalogue_is_distinct_items_over_many_first_codes():
    rng = np.random.default_rng(0)
    items = bench.make_catalogue(20_000, 10, 512, rng)
    assert items.shape == (20_000, 3)
    assert len(np.unique(items, axis=0)) == 20_000
    for level in range(3):  # each level its own tokens
        assert items[:, level].min() >= 10 + level * 512 and items[:, level].max() < 10 + (level + 1) * 512
    first = items[:, 0] - 10
    # Zipf-popular: code 0 the most common, yet hundreds of first codes (not only the lowest few)
    assert np.bincount(first).argmax() == 0 and len(np.unique(first)) > 200


def test_knobs_parse_both_list_forms(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["x", "--widths", "1024", "--concurrencies", "1,8", "32",
                                      "--variants", "fixed", "schedule", "--schedule", "64,256,1024",
                                      "--requests", "4", "--items", "100000", "--layers", "1", "--out", "a"])
    args = bench.parse_args()
    assert args.widths == [1024] and args.concurrencies == [1, 8, 32] and args.schedule == [64, 256, 1024]
    assert args.variants == ["fixed", "schedule"]
    assert (args.requests, args.items, args.layers) == (4, 100_000, 1)
    monkeypatch.setattr(sys, "argv", ["x", "--widths", "0"])
    with pytest.raises(SystemExit):
        bench.parse_args()


def test_variants_interleave_per_chunk(monkeypatch):
    calls = []

    def fake_loop(llm, chunk, make_params, concurrency, catalogue_items, allowed, tag):
        calls.append((tag.split("-")[1], sorted(chunk)))
        return {"wall_s": 1.0, "latencies": [0.5] * len(chunk), "returned": {i: [(i,)] for i in chunk},
                "peak": len(calls), "required": 99, "invalid": 0}

    monkeypatch.setattr(bench, "run_loop", fake_loop)
    variants = {"fixed": (None, None), "schedule": (None, None)}
    raws = bench.run_point(None, list(range(5)), variants, 1, set(), "t", chunk_requests=2)
    assert calls == [("fixed", [0, 1]), ("schedule", [0, 1]), ("schedule", [2, 3]), ("fixed", [2, 3]),
                     ("fixed", [4]), ("schedule", [4])]
    for raw in raws.values():
        assert raw["wall_s"] == 3.0 and sorted(raw["returned"]) == list(range(5))
        assert len(raw["latencies"]) == 5
    row = bench.summary(raws["fixed"])
    assert row["requests"] == 5 and row["items_per_s"] == round(5 / 3.0, 1) and row["p99_over_p50"] == 1.0
