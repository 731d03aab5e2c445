"""Default sizing (no `kv_cache_memory`) below the CPU cap: the pools get
`(available - measured activation peak) * kv_cache_fraction`, the measured warm-up peak subtracted.

Above `DEFAULT_CPU_KV_CACHE_BYTES` (2 GiB) the cap binds and hides whether the peak was subtracted, so
the device's free memory is stubbed well below it, and the warm-up's measure is stubbed to a known
figure (a real CPU measure is the process's peak RSS, which a process that freed memory can read as 0).
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

    def measure(model, device, dtype, tokens_per_block, max_num_batched_tokens, max_beam_width):
        calls.append((tokens_per_block, max_num_batched_tokens, max_beam_width))
        return activation

    monkeypatch.setattr(startup_module, "available_memory_bytes", lambda device: available)
    monkeypatch.setattr(startup_module, "measure_activation_peak_bytes", measure)
    engine = LLMEngine(str(tiny_llama_dir), device="cpu", dtype="float32", tokens_per_block=T,
                       max_beam_width=8, max_num_batched_tokens=64, kv_cache_fraction=fraction)
    assert calls == [(T, 64, 8)]  # measured once, for the largest chunk and the widest decode step
    expected = int((available - activation) * fraction)
    layout = engine.layout
    assert layout.activation_measured
    assert layout.activation_bytes == engine.activation_peak_bytes == activation
    assert layout.free_bytes == available - activation
    assert layout.kv_cache_bytes == expected
    # the pools fill that budget to within one block, from the model's shapes alone
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    block_bytes = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * 4 * T
    [pool] = engine.stats()["pools"].values()
    assert expected - block_bytes < pool["total_blocks"] * block_bytes <= expected
