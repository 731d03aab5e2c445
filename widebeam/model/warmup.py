"""Warm-up: run the largest steps the engine will run on a small temporary cache and measure the
activation memory they need, so the KV pools are sized from what is really left.
"""

from __future__ import annotations

import gc

import torch

from widebeam.memstats import reset_peak_rss, rss_bytes
from widebeam.model.activation import estimate_activation_peak_bytes
from widebeam.model.families.arch import CROSS_POOL
from widebeam.model.runner import ModelRunner, SequenceInput


def measure_activation_peak_bytes(model: torch.nn.Module, device: torch.device, dtype: torch.dtype,
                                  tokens_per_block: int, max_num_batched_tokens: int,
                                  max_beam_width: int, kv_cache_dtype: str | None = None) -> int:
    """Peak memory above the resident model while running (1) one prefill chunk of
    `max_num_batched_tokens` tokens and (2) one decode step of `max_beam_width` sequences.

    CUDA: the allocator's peak. CPU: the process's peak RSS (reset before, read after); where the
    kernel cannot reset it, the estimate of the largest tensors of the step is used instead.
    """
    t = tokens_per_block
    arch = model.arch
    if arch.is_encoder_decoder:  # positions are a table of max_position_embeddings rows
        max_num_batched_tokens = min(max_num_batched_tokens, arch.max_position_embeddings)
    prefill_blocks = -(-max_num_batched_tokens // t)
    pool_blocks = {name: prefill_blocks + max_beam_width for name in set(model.layer_pool_names)}
    runner = ModelRunner(model, pool_blocks, t, device, dtype, kv_cache_dtype=kv_cache_dtype)
    self_pools = [name for name in pool_blocks if name != CROSS_POOL]
    cross = {}
    if CROSS_POOL in pool_blocks:
        # the encoder over the longest source, whose cross K/V every sequence below reads
        runner.encode([[0] * max_num_batched_tokens], [list(range(max_num_batched_tokens))])
        cross = {"cross_block_table": list(range(prefill_blocks)),
                 "num_encoder_tokens": max_num_batched_tokens}
    prefill = SequenceInput(
        [0] * max_num_batched_tokens, 0, {name: list(range(prefill_blocks)) for name in self_pools},
        {name: list(range(max_num_batched_tokens)) for name in self_pools}, **cross,
    )
    decodes = [
        SequenceInput([0], 0, {name: [prefill_blocks + i] for name in self_pools},
                      {name: [(prefill_blocks + i) * t] for name in self_pools}, **cross)
        for i in range(max_beam_width)
    ]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        for batch in ([prefill], decodes):
            torch.log_softmax(runner.execute(batch), dim=-1)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
    else:
        gc.collect()
        base = rss_bytes("VmRSS")
        measured = base is not None and reset_peak_rss()
        for batch in ([prefill], decodes):
            torch.log_softmax(runner.execute(batch), dim=-1)
        high = rss_bytes("VmHWM") if measured else None
        if high is not None and base is not None:
            peak = max(high - base, 0)
        else:
            # float32 bound
            peak = estimate_activation_peak_bytes(model.arch, max_num_batched_tokens, max_beam_width)
    del runner
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return int(peak)
