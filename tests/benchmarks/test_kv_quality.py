"""benchmarks/kv_quality.py on a tiny random model: the KL of float32 KV against float32 KV is exactly 0
with top-1 agreement 1.0, a perturbed candidate (noisy logits, or different weights) gives KL > 0 (the
metric can fail), and int8 / bfloat16 KV give a small but nonzero KL; the beam measures on known
hypothesis lists; the held-text prompts; the whole command end to end, writing its JSON and markdown; the
OneRec-shaped part's float32 control."""

from __future__ import annotations

import copy
import inspect
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import kv_quality as bench

from widebeam.model.loading.build import load_model
from widebeam.model.loading.sources import resolve_model
from widebeam.model.runner import ModelRunner

HAS_KV_CACHE_DTYPE = "kv_cache_dtype" in inspect.signature(ModelRunner).parameters
needs_kv_cache_dtype = pytest.mark.skipif(not HAS_KV_CACHE_DTYPE, reason="ModelRunner has no kv_cache_dtype")
# windows of 64 in chunks of 16: three of every four positions read earlier chunks' K/V from the cache
KNOBS = {"window_tokens": 64, "chunk_tokens": 16, "tokens_per_block": 16}


@pytest.fixture(scope="module")
def tiny_model(tiny_llama_dir):
    return load_model(resolve_model(str(tiny_llama_dir)), "float32", torch.device("cpu"))


@pytest.fixture(scope="module")
def text_ids():
    return torch.randint(3, 128, (150,), generator=torch.Generator().manual_seed(0)).tolist()


@pytest.mark.parametrize("candidate", ["float32", "auto"])
def test_float32_against_float32_is_exactly_zero(tiny_model, text_ids, candidate):
    (result,) = bench.token_kl(tiny_model, text_ids, [candidate], **KNOBS)
    summary = result["summary"]
    assert summary["tokens"] == 150 and summary["later_chunk_tokens"] == 150 - 3 * 16  # windows 64, 64, 22
    assert summary["mean_kl"] == 0.0 and summary["p99_kl"] == 0.0 and summary["max_kl"] == 0.0
    assert summary["top1_agreement"] == 1.0
    assert result["kl"].dtype == torch.float64 and bool((result["kl"] == 0).all())


def test_a_perturbed_candidate_fails(tiny_model, text_ids):
    (noisy,) = (r["summary"] for r in bench.token_kl(tiny_model, text_ids, ["float32"], logit_noise_std=1.0,
                                                     **KNOBS))
    assert noisy["mean_kl"] > 0.05 and noisy["top1_agreement"] < 1.0
    other = copy.deepcopy(tiny_model)
    with torch.no_grad():
        for name, param in other.named_parameters():
            if "norm" not in name:
                param.add_(0.05 * torch.randn(param.shape, generator=torch.Generator().manual_seed(1)))
    (moved,) = (r["summary"] for r in bench.token_kl(tiny_model, text_ids, ["float32"], candidate_model=other,
                                                     **KNOBS))
    assert moved["mean_kl"] > 1e-3 and moved["p99_kl"] > moved["mean_kl"]


def test_a_bos_starts_every_window(tiny_model, text_ids):
    summary = bench.token_kl(tiny_model, text_ids, ["float32"], bos_token_id=1, **KNOBS)[0]["summary"]
    # 63 text tokens per window: 150 = 63 + 63 + 24, each window one BOS more
    assert summary["tokens"] == 153 and summary["mean_kl"] == 0.0


@needs_kv_cache_dtype
def test_lower_precision_kv_gives_small_nonzero_kl(tiny_model, text_ids):
    # one reference run for all candidates; float32 among them stays exactly 0
    results = bench.token_kl(tiny_model, text_ids, ["bfloat16", "int8", "float32"], **KNOBS)
    (bf16, int8, fp32) = (r["summary"] for r in results)
    for summary, bound in ((bf16, 1e-3), (int8, 1e-2)):  # measured: 1.1e-4 and 4.1e-4
        assert 0 < summary["mean_kl"] < bound and summary["mean_kl_later_chunks"] > 0
        assert summary["top1_agreement"] >= 0.9
    assert fp32["max_kl"] == 0.0 and fp32["top1_agreement"] == 1.0


def test_beam_agreement_counts_best_and_overlap():
    reference = [{(1, 2): -1.0, (1, 3): -1.5, (4,): -2.0, (5,): -3.0}, {(7,): -0.5, (8,): -0.75},
                 {(6,): -1.0}, {}]
    candidate = [{(1, 2): -1.1, (4,): -1.2, (9,): -1.3, (1, 3): -1.4}, {(8,): -0.5, (7,): -0.6},
                 {(9,): -1.0}, {}]
    row = bench.beam_agreement(reference, candidate, width=4)
    assert row["prompts"] == 4 and row["same_best"] == 1 and row["same_best_share"] == 1 / 4
    assert row["mean_overlap"] == pytest.approx((3 / 4 + 2 / 4 + 0 + 0) / 4) and row["min_overlap"] == 0.0
    assert row["best_flip_score_gaps"] == [0.25, None]  # (8,) was the reference's second; (9,) not in it
    assert bench.flip_gaps([None, 0.25, 0.001]) == "0.001, 0.25, out"


def test_prompts_are_distinct_slices_spread_over_the_text():
    ids = list(range(1000))
    prompts = bench.beam_prompts(ids, 5, 64)
    assert [p[0] for p in prompts] == [0, 234, 468, 702, 936] and all(len(p) == 64 for p in prompts)
    assert bench.beam_prompts([1] * 100, 3, 64) == [[1] * 64]  # repeated slices count once
    with pytest.raises(ValueError):
        bench.beam_prompts(ids[:10], 1, 64)


def test_held_text_is_the_standard_library_prose():
    text = bench.held_text()
    assert len(text) > 100_000 and "assert" in text and text == bench.held_text()
    info = bench.held_text_info(text, 123)
    assert info["source"].startswith("pydoc_data.topics") and len(info["sha256"]) == 64


class _ByteTokenizer:
    """The tiny model has no tokenizer: the text's bytes folded into its vocabulary, no BOS."""

    bos_token_id = None

    def encode(self, text, add_special_tokens=True):
        return [3 + b % 120 for b in text.encode()]


def test_the_command_end_to_end(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "text_tokenizer", lambda llm, model: _ByteTokenizer())
    candidates = ["float32", "int8"] if HAS_KV_CACHE_DTYPE else ["float32"]
    assert bench.main(["--model", str(tiny_llama_dir), "--device", "cpu", "--kv-cache-dtypes", *candidates,
                       "--tokens", "96", "--window", "48", "--chunk", "16", "--beam-widths", "2", "4",
                       "--beam-prompts-overlap", "2", "--beam-prompts", "3", "--beam-width-best", "2",
                       "--beam-new-tokens", "4", "--beam-prompt-tokens", "8", "--kv-cache-memory", "16MiB",
                       "--threads", "1", "--results-dir", str(tmp_path), "--out", "q"]) == 0
    report = json.loads((tmp_path / "q.json").read_text())
    kl = {row["kv_cache_dtype"]: row for row in report["kl"]["rows"]}
    assert kl["float32"]["tokens"] == 96 and kl["float32"]["mean_kl"] == 0.0
    beams = [row for row in report["beams"]["rows"] if row["kv_cache_dtype"] == "float32"]
    assert [(row["part"], row["width"], row["prompts"]) for row in beams] == [
        ("beams", 2, 2), ("beams", 4, 2), ("best", 2, 3)]
    assert all(row["same_best_share"] == 1.0 and row["mean_overlap"] == 1.0 for row in beams)
    if HAS_KV_CACHE_DTYPE:
        assert kl["int8"]["mean_kl"] > 0
    markdown = (tmp_path / "q.md").read_text()
    assert "pydoc_data.topics" in markdown and "| float32 |" in markdown


def test_genrec_overlap_of_the_float32_control_is_one():
    candidates = ["float32", "int8"] if HAS_KV_CACHE_DTYPE else ["float32"]
    rows = bench.genrec_overlap(candidates, width=8, requests=2, items=1000, layers=1, device="cpu",
                                kv_cache_memory="128MiB")
    assert [row["kv_cache_dtype"] for row in rows] == candidates
    assert rows[0]["mean_top100_overlap"] == 1.0 and rows[0]["same_best_item"] == 2
    assert all(0.0 <= row["min_top100_overlap"] <= row["mean_top100_overlap"] <= 1.0 for row in rows)


def test_knobs_are_checked():
    args = bench.parse_args(["--genrec", "--kv-cache-dtypes", "float32", "int8"])
    assert args.parts == ["kl", "beams", "best", "genrec"] and args.kv_cache_dtypes == ["float32", "int8"]
    for bad in (["--kv-cache-dtypes", "float64"], ["--tokens", "0"], ["--beam-widths", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)
