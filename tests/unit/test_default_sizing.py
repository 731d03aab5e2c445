"""Default sizing (no `kv_cache_memory`) below the CPU cap: the pools get
`(available - measured activation peak) * kv_cache_fraction`, the measured warm-up peak subtracted.

Above `DEFAULT_CPU_KV_CACHE_BYTES` (2 GiB) the cap binds and hides whether the peak was subtracted, so
the device's free memory is stubbed well below it, and the warm-up's measure is stubbed to a known
figure (a real CPU measure is the process's peak RSS, which a process that freed memory can read as 0).
With a draft model each worker is measured and the reserve is their sum.
"""

from __future__ import annotations

import json

import pytest

from widebeam import startup as startup_module
from widebeam.defaults import DEFAULT_CPU_KV_CACHE_BYTES
from widebeam.engine import LLMEngine

MiB = 2**20
T = 4


@pytest.mark.parametrize("available, activation, fraction", [(48 * MiB, 20 * MiB, 0.9),
                                                             (40 * MiB, 7 * MiB + 123, 0.5)])
def test_default_sizing_subtracts_the_measured_activation_peak(monkeypatch, tiny_llama_dir, available,
                                                               activation, fraction):
    assert available < DEFAULT_CPU_KV_CACHE_BYTES
    calls = []

    def measure(model, device, dtype, tokens_per_block, max_num_batched_tokens, max_beam_width,
                kv_cache_dtype=None):
        calls.append((tokens_per_block, max_num_batched_tokens, max_beam_width))
        return activation

    monkeypatch.setattr(startup_module, "available_memory_bytes", lambda device: available)
    monkeypatch.setattr(startup_module, "measure_activation_peak_bytes", measure)
    engine = LLMEngine(str(tiny_llama_dir), device="cpu", dtype="float32", tokens_per_block=T,
                       max_beam_width=8, max_num_batched_tokens=64, kv_cache_fraction=fraction)
    assert calls == [(T, 64, 8)]  # measured once, for the largest chunk and the widest decode step
    expected = int((available - activation) * fraction)
    layout = engine.layout
    assert layout.reserve.measured
    assert layout.activation_bytes == engine.activation_peak_bytes == activation
    assert layout.free_bytes == available - activation
    assert layout.kv_cache_bytes == expected
    # the pools fill that budget to within one block, from the model's shapes alone
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    block_bytes = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * 4 * T
    [pool] = engine.stats()["pools"].values()
    assert expected - block_bytes < pool["total_blocks"] * block_bytes <= expected


def test_default_sizing_with_a_draft_model_reserves_both_workers_peaks(monkeypatch, tiny_llama_dir):
    """A draft model runs its own steps beside the target's (prefill chunks and drafting rounds of
    `W * (1 + 2D)` rows), so default sizing measures each worker and reserves the sum. The reference is
    the same engine without the draft: the reserve grows by exactly the draft's own peak, and the pools'
    budget shrinks by that times the fraction."""
    available, fraction, width, draft_tokens = 48 * MiB, 0.9, 4, 3
    # a known peak per model measured (the target is loaded first), both below the CPU cap
    peaks = [20 * MiB, 5 * MiB + 77]
    measured = []

    def measure(model, device, dtype, tokens_per_block, max_num_batched_tokens, max_beam_width,
                kv_cache_dtype=None):
        measured.append((model, tokens_per_block, max_num_batched_tokens, max_beam_width))
        return peaks[len(measured) - 1]

    monkeypatch.setattr(startup_module, "available_memory_bytes", lambda device: available)
    monkeypatch.setattr(startup_module, "measure_activation_peak_bytes", measure)
    common = {"device": "cpu", "dtype": "float32", "tokens_per_block": T, "max_beam_width": width,
              "max_num_batched_tokens": 64, "kv_cache_fraction": fraction}
    target_only = LLMEngine(str(tiny_llama_dir), **common)
    assert target_only.layout.activation_bytes == peaks[0]
    measured.clear()

    engine = LLMEngine(str(tiny_llama_dir), speculative_model=str(tiny_llama_dir),
                       num_speculative_tokens=draft_tokens, **common)
    rows = width * (1 + 2 * draft_tokens)  # the widest drafting round: D re-fed, D drafted per beam
    assert [(t, chunk, r) for _, t, chunk, r in measured] == [(T, 64, rows)] * 2
    assert [m for m, *_ in measured] == [w.model for w in engine.workers]  # the target's, then the draft's
    layout = engine.layout
    assert layout.reserve.measured and layout.activation_rows == rows
    assert layout.activation_bytes == engine.activation_peak_bytes == sum(peaks)
    assert layout.activation_bytes - target_only.layout.activation_bytes == peaks[1]
    assert layout.free_bytes == available - sum(peaks)
    assert layout.kv_cache_bytes == int((available - sum(peaks)) * fraction)
    assert set(engine.stats()["pools"]) == {"self", "draft"}


def test_default_sizing_with_a_draft_model_agrees_with_plans_reserve(monkeypatch, tiny_llama_dir):
    """With each worker's measure standing in for its shape-based estimate, the measured reserve of a
    draft-model engine is what `widebeam plan` reserves for the same config (target and draft)."""
    from widebeam.layout import estimate_activation_reserve
    from widebeam.model.activation import estimate_activation_peak_bytes
    from widebeam.model.loading.arch import load_arch

    def measure(model, device, dtype, tokens_per_block, max_num_batched_tokens, max_beam_width,
                kv_cache_dtype=None):
        return estimate_activation_peak_bytes(model.arch, max_num_batched_tokens, max_beam_width, "float32")

    monkeypatch.setattr(startup_module, "available_memory_bytes", lambda device: 48 * MiB)
    monkeypatch.setattr(startup_module, "measure_activation_peak_bytes", measure)
    engine = LLMEngine(str(tiny_llama_dir), speculative_model=str(tiny_llama_dir), num_speculative_tokens=5,
                       device="cpu", dtype="float32", tokens_per_block=T, max_beam_width=8,
                       max_num_batched_tokens=32)
    arch = load_arch(str(tiny_llama_dir))
    planned = estimate_activation_reserve(engine.config, arch, arch).nbytes
    assert engine.layout.activation_bytes == planned > estimate_activation_reserve(engine.config, arch).nbytes
