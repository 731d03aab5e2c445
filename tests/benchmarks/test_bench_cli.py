"""`widebeam bench` end to end on a tiny random model: both engines run, outputs agree, and the figures
match what the test measures around each engine's `generate` and the KV the shapes give."""

from __future__ import annotations

import json
import time

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


def _rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _spy(monkeypatch, owner, name: str, calls: list, tokens_of):
    """Wrap `owner.name` (a generate method): each call appends (seconds inside it, its generated
    tokens per returned sequence, its sequences, the RSS when it returned), measured here."""
    real = getattr(owner, name)

    def spy(self, *args, **kwargs):
        started = time.perf_counter()
        out = real(self, *args, **kwargs)
        elapsed = time.perf_counter() - started
        calls.append((elapsed, *tokens_of(out, args, kwargs), _rss_bytes()))
        return out

    monkeypatch.setattr(owner, name, spy)


def test_bench_compares_both_engines_in_one_run(tiny_dir, tmp_path, monkeypatch):
    """The figures against what the test measures itself around both engines' `generate`: each
    `wall_s` is the time spent in that call (not the floors', not the other engine's), tokens/s the
    tokens it really generated over that time, the peak RSS at least the RSS seen when it returned,
    and the floors below the engines that do more than their products; KV bytes from the shapes."""
    from transformers import GenerationMixin

    from widebeam.llm import LLM

    widebeam_calls, hf_calls = [], []
    _spy(monkeypatch, LLM, "generate", widebeam_calls,
         lambda out, args, kwargs: (len(out[0].outputs[0].token_ids), len(out[0].outputs)))
    _spy(monkeypatch, GenerationMixin, "generate", hf_calls,
         lambda out, args, kwargs: (out.shape[1] - args[0].shape[1], out.shape[0]))
    out = tmp_path / "bench.json"
    started = time.perf_counter()
    points = _bench(tiny_dir, out)
    total_s = time.perf_counter() - started
    assert [(p["beam_width"], p["prompt_len"]) for p in points] == [(1, 40), (4, 40)]
    # one warm-up call each, then one per point, in order
    assert len(widebeam_calls) == len(hf_calls) == 1 + len(points)
    for p, wb_call, hf_call in zip(points, widebeam_calls[1:], hf_calls[1:], strict=True):
        assert p["same_best_sequence"] is True
        for side, call in (("widebeam", wb_call), ("transformers", hf_call)):
            seconds, new_tokens, num_sequences, rss = call
            figures = p[side]
            assert new_tokens == 6 and num_sequences >= 1, side  # min_new_tokens = N: all 6 made
            # the bench's timer wraps the call the spy timed: equal but for the spy's own overhead
            assert seconds <= figures["wall_s"] <= seconds + 0.1, (side, seconds, figures["wall_s"])
            # tokens/s: the tokens it really made over its wall time (a ~5 ms call: the spy's own
            # overhead alone is a few percent of it, so the seconds above bound wall_s, not this)
            made_per_s = p["beam_width"] * new_tokens / figures["wall_s"]
            assert figures["beam_tokens_per_s"] == pytest.approx(made_per_s, rel=1e-6)
            assert figures["peak_rss_bytes"] >= rss > 0, side  # the high-water mark since its reset
            # the dense products alone, then with attention's, take less than a whole engine run
            assert 1 < figures["x_compute_and_attention_floor"] < figures["x_compute_floor"], side
        assert 0 < p["compute_floor_s"] < p["widebeam"]["wall_s"] and p["attention_floor_s"] > 0
    # every timed figure lies within the run that measured it
    assert sum(p[s]["wall_s"] for p in points for s in ("widebeam", "transformers")) < total_s
    # tiny model: 2 layers x 2 KV heads x 16 dims x 2 (K, V) x 4 bytes = 512 bytes per token
    w1, w4 = points
    assert w1["transformers"]["peak_kv_bytes"] == (40 + 6) * 512
    assert w4["transformers"]["peak_kv_bytes"] == 4 * (40 + 6) * 512
    # widebeam, 16-token blocks: the 2 full prompt blocks once, and each beam's own last block (the
    # prompt's 8 tail tokens + 6 new fit one): 3 blocks at W=1, 2 + 4 at W=4
    assert w1["widebeam"]["peak_kv_bytes"] == 3 * 16 * 512
    assert w4["widebeam"]["peak_kv_bytes"] == (2 + 4) * 16 * 512 < w4["transformers"]["peak_kv_bytes"]
    assert out.with_suffix(".png").stat().st_size > 0


def test_bench_skips_transformers_with_the_reason_when_its_kv_would_not_fit(tiny_dir, tmp_path):
    points = _bench(tiny_dir, tmp_path / "bench.json", "--hf-kv-limit", "30KiB")
    w1, w4 = points
    assert "wall_s" in w1["transformers"]  # 46 tokens x 512 bytes = 23 KiB fits
    assert "--hf-kv-limit" in w4["transformers"]["skipped"] and "184 tokens" in w4["transformers"]["skipped"]
    assert "speedup" not in w4 and w4["widebeam"]["wall_s"] > 0
