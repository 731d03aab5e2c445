"""An engine's start-up before its first request: the workers, the catalogues, the pools.

In order: load the target (and a draft worker when speculating), register the start-up
catalogues (their bytes come off the memory), lay the pools out (layout.py: what `widebeam plan`
prints, from the same function), allocate them and start each worker's runner on them. The pinned
prefixes run last, once the engine is whole (LLMEngine.__init__, pinning.py).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from widebeam.config import EngineConfig
from widebeam.defaults import DEFAULT_CPU_KV_CACHE_BYTES
from widebeam.device import available_memory_bytes
from widebeam.errors import CacheTooSmallError
from widebeam.kv.cache import KVCache
from widebeam.layout import (
    ActivationReserve,
    StartupLayout,
    compute_layout,
    config_activation_rows,
    estimate_activation_reserve,
)
from widebeam.model.loading.build import load_model, load_tokenizer, model_dtype
from widebeam.model.loading.sources import ModelSource, resolve_model
from widebeam.model.warmup import measure_activation_peak_bytes
from widebeam.speculative.drafter import ModelDrafter, NgramDrafter
from widebeam.speculative.setup import start_drafter
from widebeam.units import format_bytes
from widebeam.worker import Worker

log = logging.getLogger("widebeam")


@dataclass
class LoadedWorkers:
    source: ModelSource
    tokenizer: object
    workers: list[Worker]  # the target first, then a draft model's
    drafter: ModelDrafter | NgramDrafter | None


def load_workers(config: EngineConfig, model: str, device: torch.device) -> LoadedWorkers:
    """The target model's worker, and with speculation the drafter (a draft model joins as a second
    worker, its pools sized with the target's from one budget)."""
    source = resolve_model(model)
    target = load_model(source, config.model.dtype, device, config.model.linear_backend)
    tokenizer = load_tokenizer(source)
    workers = [Worker("target", target, config.model.dtype, kv_cache_dtype=config.cache.kv_cache_dtype)]
    drafter = None
    if config.speculative is not None:
        drafter, draft_worker = start_drafter(config.speculative, target.arch, tokenizer, model,
                                              config.model.dtype, device, config.cache.kv_cache_dtype)
        if draft_worker is not None:
            workers.append(draft_worker)
    return LoadedWorkers(source, tokenizer, workers, drafter)


def lay_out_pools(config: EngineConfig, workers: list[Worker], device: torch.device, catalogue_bytes: int,
                  pinned_prefixes: Sequence[Sequence[int]]) -> StartupLayout:
    """The layout of the pools (layout.py). With `kv_cache_memory` the activation reserve is the
    shape-based estimate `widebeam plan` uses; without, the pools take what is left, so the largest
    steps' activations are measured (a warm-up costs seconds per engine on a CPU)."""
    target, draft = workers[0].arch, workers[1].arch if len(workers) > 1 else None
    if config.cache.kv_cache_memory is None:
        rows = config_activation_rows(config)
        t, chunk = config.cache.tokens_per_block, config.scheduler.max_num_batched_tokens
        peak_bytes = tuple(measure_activation_peak_bytes(worker.model, device, model_dtype(worker.model), t,
                                                         chunk, rows, kv_cache_dtype=worker.kv_cache_dtype)
                           for worker in workers)
        reserve = ActivationReserve(peak_bytes, rows, measured=True)
    else:
        reserve = estimate_activation_reserve(config, target, draft)
    layout = compute_layout(
        config, target, available_memory_bytes(device), reserve, draft=draft, catalogue_bytes=catalogue_bytes,
        pinned_prefixes=pinned_prefixes,
        default_kv_cache_bytes=DEFAULT_CPU_KV_CACHE_BYTES if device.type == "cpu" else None)
    if layout.too_small:
        raise CacheTooSmallError(layout.too_small)
    return layout


def allocate_pools(config: EngineConfig, layout: StartupLayout, workers: list[Worker],
                   device: torch.device) -> KVCache:
    """The block accounting of every pool (one `KVCache`), and each worker's K/V tensors for its own."""
    t = layout.tokens_per_block
    cache = KVCache([(pool.spec, pool.num_blocks) for pool in layout.pools], t,
                    config.scheduler.max_num_batched_tokens, config.cache.enable_prefix_caching)
    log.info("KV cache %s: %s; max_seq_len %d; activation peak %s (%d rows); device %s",
             format_bytes(layout.kv_cache_bytes),
             ", ".join(f"{p.name} {p.num_blocks} blocks x {t} = {p.num_blocks * t} tokens"
                       for p in layout.pools),
             layout.max_seq_len, format_bytes(layout.activation_bytes), layout.activation_rows, device)
    for worker in workers:
        worker.start(layout.blocks_per_pool, t, device, config.model.attention_backend)
    return cache
