"""`widebeam bench` end to end on a tiny random model: both engines run, outputs agree, figures add up."""

from __future__ import annotations

import json

import pytest
from tiny_models import save_tiny_model

from widebeam.cli import main


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-bench")
    save_tiny_model(path)
    return path


def _bench(tiny_dir, out, *extra):
    code = main(["bench", "--model", str(tiny_dir), "--widths", "1", "4", "--prompt-lens", "40",
                 "--max-new-tokens", "6", "--no-wide", "--threads", "1", "--kv-cache-memory", "8MiB",
                 "--out", str(out), *extra])
    assert code == 0
    return json.loads(out.read_text())["points"]


def test_bench_compares_both_engines_in_one_run(tiny_dir, tmp_path):
    out = tmp_path / "bench.json"
    points = _bench(tiny_dir, out)
    assert [(p["beam_width"], p["prompt_len"]) for p in points] == [(1, 40), (4, 40)]
    for p in points:
        assert p["same_best_sequence"] is True
        for side in ("widebeam", "transformers"):
            figures = p[side]
            assert figures["wall_s"] > 0 and figures["peak_rss_bytes"] > 0
            assert figures["beam_tokens_per_s"] == pytest.approx(p["beam_width"] * 6 / figures["wall_s"])
            assert figures["x_compute_floor"] == pytest.approx(figures["wall_s"] / p["compute_floor_s"])
            floors = p["compute_floor_s"] + p["attention_floor_s"]
            assert p["attention_floor_s"] > 0
            assert figures["x_compute_and_attention_floor"] == pytest.approx(figures["wall_s"] / floors)
    # tiny model: 2 layers x 2 KV heads x 16 dims x 2 (K, V) x 4 bytes = 512 bytes per token
    w1, w4 = points
    assert w1["transformers"]["peak_kv_bytes"] == (40 + 6) * 512
    assert w4["transformers"]["peak_kv_bytes"] == 4 * (40 + 6) * 512
    # widebeam: the 2 full prompt blocks once, then per beam ceil((8 + 6) / 16) = 1 block, at most
    assert w4["widebeam"]["peak_kv_bytes"] <= (2 + 4) * 16 * 512 < w4["transformers"]["peak_kv_bytes"]
    assert out.with_suffix(".png").stat().st_size > 0


def test_bench_skips_transformers_with_the_reason_when_its_kv_would_not_fit(tiny_dir, tmp_path):
    points = _bench(tiny_dir, tmp_path / "bench.json", "--hf-kv-limit", "30KiB")
    w1, w4 = points
    assert "wall_s" in w1["transformers"]  # 46 tokens x 512 bytes = 23 KiB fits
    assert "--hf-kv-limit" in w4["transformers"]["skipped"] and "184 tokens" in w4["transformers"]["skipped"]
    assert "speedup" not in w4 and w4["widebeam"]["wall_s"] > 0
