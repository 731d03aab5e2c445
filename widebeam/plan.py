"""Capacity planning: how a model, a memory size and a request shape map onto KV blocks.

`plan()` is the engine's start-up layout (layout.py: `compute_layout`, the function the engine
builds its pools from) for an engine whose widest request is the one planned, read through the
engine's budget code (kv/cache.py), with the naive per-beam-copy model beside it so the difference
is visible; the activation reserve is the layout's estimate, the pins are held by the cache
(`KVCache.hold_pinned_blocks`). With speculative decoding the draft model's pools ("draft",
"draft/sliding_512", ...) are sized beside the target's from the same budget, and every
per-sequence pool reserves D speculative tokens per sequence. A catalogue registered at start-up
(generative retrieval, `CataloguePlan`: catalogue/sizing.py) lives on the device beside the pools:
its bytes come off the memory before the KV share is taken, as the engine does. The command line
is plan_cli.py.

This module stays free of torch (`widebeam plan` must be quick and run anywhere).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from widebeam.catalogue.sizing import CataloguePlan
from widebeam.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from widebeam.defaults import (
    DEFAULT_KV_CACHE_FRACTION,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_TOKENS_PER_BLOCK,
)
from widebeam.errors import InvalidParameterError
from widebeam.kv.budget import (
    KVRequest,
    cross_attention_blocks,
    naive_full_attention_blocks,
    naive_max_seq_len,
)
from widebeam.kv.cache import KVCache
from widebeam.layout import compute_layout, estimate_activation_reserve, worker_models
from widebeam.model.families.arch import CROSS_POOL, ModelArch
from widebeam.request_checks import check_width_schedule

# The most memory a plan is made for: 256 TiB, past the largest single-system memory sold today (tens of
# TiB). Larger is a typo or an attack, refused naming --memory; the plan's cost does not grow with it
# (pools are counts: kv/block_pool.py hands out ids lazily).
MAX_PLAN_MEMORY_BYTES = 1 << 48


@dataclass(frozen=True)
class PlanInputs:
    memory_bytes: int
    beam_width: int
    prompt_len: int
    max_new_tokens: int
    tokens_per_block: int = DEFAULT_TOKENS_PER_BLOCK
    kv_cache_fraction: float = DEFAULT_KV_CACHE_FRACTION
    dtype: str = "bfloat16"
    kv_cache_dtype: str = "auto"  # what the pools store (config.py: CacheConfig.kv_cache_dtype)
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    # Encoder-decoder models: E, the source tokens (default: prompt_len). The decoder's own prompt
    # is then its start token and a decoder prefix of `decoder_prefix_len` tokens (NLLB's language code).
    encoder_len: int | None = None
    decoder_prefix_len: int = 0
    # Speculative decoding (None: off): "draft" needs the draft model's arch passed to `plan()`;
    # "ngram" has no draft model, only the target's D tokens per sequence.
    speculative: SpeculativeConfig | None = None
    # Catalogues registered at start-up (None: none); their bytes come off the memory before the KV share.
    catalogue: CataloguePlan | None = None
    # Pinned prefixes as token ids (--pin-prefix): their blocks come off every pool's capacity.
    pinned_prefixes: tuple[tuple[int, ...], ...] = ()
    # Per-step beam widths (--beam-width-schedule; `beam_width` is then its widest step): the
    # schedule's own bound is counted (kv/schedule_budget.py: scheduled_blocks).
    beam_width_schedule: tuple[int, ...] = ()

    def engine_config(self) -> EngineConfig:
        """The engine this plan is for: its widest request is this one (max_beam_width = beam_width)."""
        return EngineConfig(ModelConfig(dtype=self.dtype),
                            CacheConfig(kv_cache_fraction=self.kv_cache_fraction,
                                        tokens_per_block=self.tokens_per_block,
                                        kv_cache_dtype=self.kv_cache_dtype),
                            SchedulerConfig(max_num_batched_tokens=self.max_num_batched_tokens,
                                            max_beam_width=self.beam_width),
                            self.speculative)


class PlanError(ValueError):
    """The inputs leave nothing for the KV cache, or pinned prefixes the engine would refuse;
    `argument`: the command-line flag to blame."""

    def __init__(self, message: str, argument: str = "--memory"):
        super().__init__(message)
        self.argument = argument


def plan(arch: ModelArch, inputs: PlanInputs, draft_arch: ModelArch | None = None) -> dict:
    """The capacity plan as a JSON-ready dict (see `widebeam plan --json`).

    `draft_arch`: the draft model's arch, required with `inputs.speculative.method == "draft"`. Its
    weights and activation reserve come off the same memory, and its pools share the KV budget with
    the target's: the pools are the engine's start-up layout (layout.py: `compute_layout`)."""
    spec_config = inputs.speculative
    uses_draft = spec_config is not None and spec_config.method == "draft"
    if uses_draft and draft_arch is None:
        raise ValueError("speculative method 'draft' needs the draft model's arch (draft_arch)")
    if not uses_draft:
        draft_arch = None
    if not 0 < inputs.memory_bytes <= MAX_PLAN_MEMORY_BYTES:
        raise PlanError(f"--memory must be in (0, {MAX_PLAN_MEMORY_BYTES}] bytes (256 TiB, more than any "
                        f"machine has), got {inputs.memory_bytes}")
    config = inputs.engine_config()
    t = inputs.tokens_per_block
    # each worker's weights (a draft model's in its own dtype), and the activation reserve: the
    # layout's estimate for an engine whose widest request is this one (summed over its workers)
    worker_weight_bytes = [model.weight_bytes(dtype)
                           for _, model, dtype, _ in worker_models(config, arch, draft_arch)]
    weight_bytes = sum(worker_weight_bytes)
    reserve = estimate_activation_reserve(config, arch, draft_arch)
    catalogue_bytes = inputs.catalogue.nbytes if inputs.catalogue is not None else 0
    # what a device of --memory has left once the weights and the catalogues are loaded
    available_bytes = inputs.memory_bytes - weight_bytes - catalogue_bytes
    if available_bytes - reserve.nbytes <= 0:
        raise PlanError(
            f"--memory {inputs.memory_bytes} bytes leaves nothing for the KV cache: the weights"
            f"{' (target and draft)' if draft_arch is not None else ''} need "
            f"{weight_bytes} bytes and the activation reserve {reserve.nbytes} bytes"
            f"{f', the catalogue {catalogue_bytes} bytes' if catalogue_bytes else ''}; "
            f"use --memory > {weight_bytes + reserve.nbytes + catalogue_bytes}"
        )
    try:
        layout = compute_layout(config, arch, available_bytes, reserve, draft=draft_arch,
                                catalogue_bytes=catalogue_bytes, pinned_prefixes=inputs.pinned_prefixes)
    except InvalidParameterError as exc:
        if exc.param == "pinned_prefixes":
            raise PlanError(str(exc), argument="--pin-prefix") from None
        raise
    # What the cache is asked to hold: an encoder-decoder model's source goes to the cross pool and
    # its decoder prompt is its start token and prefix; with speculation D more tokens per sequence
    # (D draft tokens written per step, and up to D accepted ones fed again the next round).
    d = spec_config.num_speculative_tokens if spec_config is not None else 0
    schedule = inputs.beam_width_schedule
    try:
        check_width_schedule(schedule, speculative=bool(d))
    except InvalidParameterError as exc:
        raise PlanError(exc.render({"beam_width_schedule": "a beam-width schedule"}),
                        "--beam-width-schedule") from None
    encoder_len = inputs.prompt_len if inputs.encoder_len is None else inputs.encoder_len
    request = KVRequest(1 + inputs.decoder_prefix_len if arch.is_encoder_decoder else inputs.prompt_len,
                        inputs.max_new_tokens, inputs.beam_width, extra_tokens=d, refeed_tokens=d,
                        encoder_tokens=encoder_len if arch.is_encoder_decoder else 0,
                        beam_width_schedule=schedule)
    cache = KVCache([(p.spec, p.num_blocks) for p in layout.pools], t, inputs.max_num_batched_tokens,
                    enable_prefix_caching=True)
    cache.hold_pinned_blocks(layout.pinned_block_hashes)  # every pool's capacity shows the pins gone
    pinned_blocks = {name: n for name, n in layout.pinned_blocks.items() if n}
    # The start-up bound is the token capacity of the full-attention pool, never divided by W.
    bound_tokens = layout.capacity_tokens
    capacity_blocks = layout.pools[0].num_blocks if bound_tokens is None else bound_tokens // t
    max_seq_len = layout.max_seq_len  # 0 when the cache holds not even one sequence: reported, not raised

    pools = [
        {
            "name": b.pool,
            "kind": cache[b.pool].spec.kind,
            "num_layers": cache[b.pool].spec.num_layers,
            "bytes_per_token": cache[b.pool].spec.bytes_per_token,
            "required_blocks": b.required_blocks,
            "total_blocks": cache[b.pool].pool.num_blocks,
            "pinned_blocks": pinned_blocks.get(b.pool, 0),
            "capacity_blocks": b.capacity_blocks,  # what requests may use: the pool less its pinned blocks
            "fits": b.fits,
            "max_concurrent_requests": b.capacity_blocks // b.required_blocks,
            **({"fixed_width_required_blocks":
                cache[b.pool].required_blocks(replace(request, beam_width_schedule=()))}
               if request.beam_width_schedule else {}),
            **cache[b.pool].fit_hints(request),
        }
        for b in cache.budgets(request)
    ]
    fits_length = request.prompt_tokens + inputs.max_new_tokens <= max_seq_len
    if arch.is_encoder_decoder:
        fits_length = fits_length and request.encoder_tokens <= arch.max_position_embeddings
    fits = all(p["fits"] for p in pools) and fits_length
    max_concurrent = min(p["max_concurrent_requests"] for p in pools) if fits else 0

    p = request.prompt_tokens
    naive_required = naive_full_attention_blocks(p, inputs.max_new_tokens, inputs.beam_width, t)
    naive_seq_len = min(arch.max_position_embeddings,
                        naive_max_seq_len(capacity_blocks, inputs.beam_width, t))
    naive_fits = naive_required <= capacity_blocks and p + inputs.max_new_tokens <= naive_seq_len
    naive_concurrent = capacity_blocks // naive_required if naive_fits else 0
    naive_cross = {}
    if arch.is_encoder_decoder:
        # HF-style engines expand the encoder output (and its cross K/V) once per beam
        cross_required = cross_attention_blocks(request.encoder_tokens, t) * inputs.beam_width
        cross_capacity = cache[CROSS_POOL].capacity_blocks()
        naive_fits = naive_fits and cross_required <= cross_capacity
        naive_concurrent = min(naive_concurrent, cross_capacity // cross_required) if naive_fits else 0
        naive_cross = {"cross_required_blocks": cross_required}
    return {
        "model": arch.name,
        "dtype": inputs.dtype,
        "kv_cache_dtype": layout.specs[0].dtype,  # what the pools store ("auto" resolved)
        "memory_bytes": inputs.memory_bytes,
        "weight_bytes": weight_bytes,
        "activation_reserve_bytes": layout.activation_bytes,
        "activation_rows": layout.activation_rows,  # logits rows of the widest step: W x (1 + 2D)
        **({"catalogue": inputs.catalogue.entry()} if inputs.catalogue is not None else {}),
        "kv_cache_fraction": inputs.kv_cache_fraction,
        "kv_cache_bytes": layout.kv_cache_bytes,
        "bytes_per_token": sum(s.bytes_per_token for s in layout.specs),
        "tokens_per_block": t,
        "capacity_blocks": capacity_blocks,
        "model_max_seq_len": arch.max_position_embeddings,
        "max_seq_len": max_seq_len,
        "request": {
            # an encoder-decoder model's decoder prompt: its start token and decoder prefix
            "prompt_len": request.prompt_tokens,
            "max_new_tokens": inputs.max_new_tokens,
            "beam_width": inputs.beam_width,
            **({"beam_width_schedule": list(inputs.beam_width_schedule)}
               if inputs.beam_width_schedule else {}),
            **({"encoder_len": request.encoder_tokens} if arch.is_encoder_decoder else {}),
        },
        **({"speculative": {
            "method": spec_config.method, "model": spec_config.model,
            "num_speculative_tokens": spec_config.num_speculative_tokens,
            **({"draft_model": draft_arch.name, "draft_weight_bytes": sum(worker_weight_bytes[1:]),
                "draft_activation_reserve_bytes": layout.reserve.draft_bytes}
               if draft_arch is not None else {}),
        }} if spec_config is not None else {}),
        **({"pinned_prefixes": {"count": len(inputs.pinned_prefixes),
                                "tokens": [len(ids) for ids in inputs.pinned_prefixes],
                                "blocks": pinned_blocks}} if inputs.pinned_prefixes else {}),
        "pools": pools,
        "fits": fits,
        "max_concurrent_requests": max_concurrent,
        "naive": {
            "max_seq_len": naive_seq_len,
            "required_blocks": naive_required,
            "fits": naive_fits,
            "max_concurrent_requests": naive_concurrent,
            **naive_cross,
        },
    }
