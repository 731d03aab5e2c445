"""The start-up layout: every worker's KV pools, their blocks, `max_seq_len`, the pinned blocks and
the memory reserved beside them, computed once from the model archs, the config and the memory.

`LLMEngine` builds its `KVCache` and its workers' pools from a `StartupLayout`, and `widebeam plan`
prints one, so the plan is the engine's start-up by construction, not a second formula. The
activation reserve comes in as an `ActivationReserve`: measured by the engine (model/warmup.py), or
estimated here from shapes (`estimate_activation_reserve`, the one estimate); everything else is
arithmetic on shapes. Torch-free: `widebeam plan` must stay quick.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from widebeam.config import EngineConfig
from widebeam.errors import CacheTooSmallError, InvalidParameterError
from widebeam.kv.cache import KVCache
from widebeam.kv.sizing import size_pools
from widebeam.kv.spec import PoolSpec, kv_dtype
from widebeam.model.activation import estimate_activation_peak_bytes
from widebeam.model.families.arch import ModelArch
from widebeam.units import format_bytes, parse_bytes

TARGET_PREFIX = ""  # the target keeps its model's pool names ("self", "sliding_512", "cross")
DRAFT_PREFIX = "draft"  # a draft model's pools: "draft", "draft/sliding_512"


def scoped_pool_name(prefix: str, local_name: str) -> str:
    """The engine's name of a worker's pool: the model's own without a prefix; else the prefix
    alone for the self pool ("draft") and prefix/name for the others ("draft/sliding_512")."""
    if not prefix:
        return local_name
    return prefix if local_name == "self" else f"{prefix}/{local_name}"


def scoped_specs(arch: ModelArch, dtype: str, prefix: str = TARGET_PREFIX,
                 kv_cache_dtype: str = "auto") -> dict[str, PoolSpec]:
    """A worker's pools: the model's pool name -> its spec under the engine's name. `dtype`: the
    model's; int8 weights keep float KV, and `kv_cache_dtype` overrides both (`kv_dtype`)."""
    # a pool's name depends on the model alone, its spec on the dtypes too
    names = {local_name: scoped_pool_name(prefix, local_name) for local_name in arch.layer_pool_names()}
    return {spec.name: spec if spec.name == names[spec.name] else replace(spec, name=names[spec.name])
            for spec in arch.kv_pool_specs(kv_dtype(dtype, kv_cache_dtype))}


def activation_rows(max_beam_width: int, num_speculative_tokens: int = 0) -> int:
    """Rows of logits the widest decode step computes: every sequence feeds up to 1 + 2D tokens with
    speculation (D re-fed accepted ones, D drafted), each with its logits."""
    return max_beam_width * (1 + 2 * num_speculative_tokens)


def draft_dtype(config: EngineConfig) -> str:
    """The draft model's weights dtype (the target's unless `speculative_dtype` says otherwise)."""
    return (config.speculative.dtype if config.speculative else None) or config.model.dtype


def worker_models(config: EngineConfig, target: ModelArch,
                  draft: ModelArch | None = None) -> list[tuple[str, ModelArch, str, str]]:
    """Each worker as (name, model, weights dtype, pool-name prefix): the target, then a draft model."""
    workers = [("target", target, config.model.dtype, TARGET_PREFIX)]
    if draft is not None:
        workers.append(("draft", draft, draft_dtype(config), DRAFT_PREFIX))
    return workers


def config_activation_rows(config: EngineConfig) -> int:
    """`activation_rows` of an engine with `config`: its widest request, D tokens per sequence."""
    d = config.speculative.num_speculative_tokens if config.speculative else 0
    return activation_rows(config.scheduler.max_beam_width, d)


@dataclass(frozen=True)
class ActivationReserve:
    """The memory the widest steps' activations take beside the pools, per worker (the target's, then
    a draft model's), for `rows` rows of logits: measured on the device, or estimated from shapes."""

    worker_bytes: tuple[int, ...]
    rows: int
    measured: bool = False

    @property
    def nbytes(self) -> int:
        return sum(self.worker_bytes)

    @property
    def draft_bytes(self) -> int:
        """The draft model's share (0 without one)."""
        return sum(self.worker_bytes[1:])


def estimate_activation_reserve(config: EngineConfig, target: ModelArch,
                                draft: ModelArch | None = None) -> ActivationReserve:
    """The activation reserve of every worker, estimated from shapes (model/activation.py) for the
    largest prefill chunk and the widest decode step (`activation_rows`); the one estimate plan and
    the engine (with `kv_cache_memory`) take."""
    rows = config_activation_rows(config)
    chunk_tokens = config.scheduler.max_num_batched_tokens
    return ActivationReserve(tuple(estimate_activation_peak_bytes(arch, chunk_tokens, rows, kv_dtype(dtype))
                                   for _, arch, dtype, _ in worker_models(config, target, draft)), rows)


@dataclass(frozen=True)
class PoolLayout:
    """One KV pool as start-up lays it out: its spec (named in the engine's scope), the worker it
    belongs to, its blocks, and the names of the blocks pinned prefixes hold in it."""

    spec: PoolSpec
    worker: str  # "target" or "draft"
    num_blocks: int
    pinned_block_hashes: tuple[bytes, ...] = ()

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def num_pinned_blocks(self) -> int:
        return len(self.pinned_block_hashes)


@dataclass(frozen=True)
class StartupLayout:
    """What start-up decides before any tensor is allocated (see `compute_layout`)."""

    pools: tuple[PoolLayout, ...]
    tokens_per_block: int
    max_seq_len: int  # 0: the cache holds not even one sequence (`too_small` says why)
    model_max_seq_len: int
    max_encoder_tokens: int  # the longest source an encoder-decoder takes (0 for a decoder-only model)
    capacity_tokens: int | None  # the length-bounding pools' token capacity; None when none bounds it
    reserve: ActivationReserve  # beside the pools, every worker's
    free_bytes: int  # the memory given less the activation reserve (the KV share is taken of this)
    kv_cache_bytes: int  # the pools' budget
    catalogue_bytes: int  # start-up catalogues, beside the pools
    too_small: str | None = None  # why start-up must refuse this layout (a `CacheTooSmallError`)

    @property
    def activation_rows(self) -> int:
        """Logits rows of the widest decode step the reserve is sized for."""
        return self.reserve.rows

    @property
    def activation_bytes(self) -> int:
        """The reserve of every worker, measured or estimated."""
        return self.reserve.nbytes

    @property
    def blocks_per_pool(self) -> dict[str, int]:
        return {p.name: p.num_blocks for p in self.pools}

    @property
    def pinned_blocks(self) -> dict[str, int]:
        """Blocks pinned prefixes hold, per pool (every pool, zeros included)."""
        return {p.name: p.num_pinned_blocks for p in self.pools}

    @property
    def pinned_block_hashes(self) -> dict[str, tuple[bytes, ...]]:
        """The names of the blocks pinned prefixes hold, per pool that holds any."""
        return {p.name: p.pinned_block_hashes for p in self.pools if p.pinned_block_hashes}

    @property
    def specs(self) -> list[PoolSpec]:
        return [p.spec for p in self.pools]

    def worker_specs(self, worker: str) -> list[PoolSpec]:
        return [p.spec for p in self.pools if p.worker == worker]


def compute_layout(config: EngineConfig, target: ModelArch, available_bytes: int, reserve: ActivationReserve,
                   *, draft: ModelArch | None = None, catalogue_bytes: int = 0,
                   pinned_prefixes: Sequence[Sequence[int]] = (),
                   default_kv_cache_bytes: int | None = None) -> StartupLayout:
    """The start-up layout of an engine with `config` over `target` (and `draft`, the draft model's
    arch with `config.speculative.method == "draft"`).

    `available_bytes`: memory left for the activations and the KV cache once the weights and the
    catalogues are loaded (the engine measures it on its device; `widebeam plan` subtracts them from
    --memory). `reserve`: the activations', measured on the device or estimated from shapes
    (`estimate_activation_reserve`: `widebeam plan`, and the engine with `kv_cache_memory`).
    `pinned_prefixes`: token ids (text is tokenized first). `default_kv_cache_bytes`: a cap on the
    pools' budget without `kv_cache_memory` (CPU hosts). Raises `InvalidParameterError` for
    `kv_cache_memory` that leaves nothing beside the catalogues and for pins start-up refuses; a
    cache too small for one sequence comes back as `too_small` (plan reports it, the engine raises)."""
    uses_draft = config.speculative is not None and config.speculative.method == "draft"
    if uses_draft != (draft is not None):
        raise ValueError("the draft model's arch (draft) is needed with speculative method 'draft' only")
    t = config.cache.tokens_per_block
    chunk_tokens = config.scheduler.max_num_batched_tokens
    _check_pins(pinned_prefixes, target, t)
    # a draft model's pools are sized beside the target's, from the same budget
    workers = [(worker, scoped_specs(arch, dtype, prefix, config.cache.kv_cache_dtype))
               for worker, arch, dtype, prefix in worker_models(config, target, draft)]
    specs = [spec for _, worker_specs in workers for spec in worker_specs.values()]
    free_bytes = available_bytes - reserve.nbytes
    kv_cache_bytes = int(max(free_bytes, 0) * config.cache.kv_cache_fraction)
    if config.cache.kv_cache_memory is not None:
        # kv_cache_memory is the budget of the pools and the start-up catalogues together
        budget_bytes = parse_bytes(config.cache.kv_cache_memory) - catalogue_bytes
        if budget_bytes <= 0:
            raise InvalidParameterError("kv_cache_memory", "{kv_cache_memory} ({value}) leaves nothing for "
                                        "the KV cache beside the catalogues ({catalogue_bytes})",
                                        value=format_bytes(parse_bytes(config.cache.kv_cache_memory)),
                                        catalogue_bytes=format_bytes(catalogue_bytes))
        kv_cache_bytes = min(kv_cache_bytes, budget_bytes)
    elif default_kv_cache_bytes is not None:
        kv_cache_bytes = min(kv_cache_bytes, default_kv_cache_bytes)

    # Encoder-decoder: the source is bounded by the model's positions, as the decoder's length is.
    max_encoder_tokens = target.max_position_embeddings if target.is_encoder_decoder else 0
    sizing = size_pools(specs, kv_cache_bytes, t, target.max_position_embeddings, max_encoder_tokens,
                        prefill_chunk_tokens=chunk_tokens)
    too_small = None
    try:
        max_seq_len = sizing.max_seq_len(config.scheduler.max_seq_len)
    except CacheTooSmallError as exc:
        max_seq_len, too_small = 0, str(exc)
    # The names of the blocks the pins hold, per pool: each prefix's full blocks that a hit at its end
    # needs (a sliding pool: its window's), a block two prefixes share counted once. Asked of an
    # empty cache with the engine's pools, so the rule is the one `KVCache.pin` follows.
    names = KVCache([(spec, 0) for spec in specs], t, chunk_tokens, enable_prefix_caching=True)
    pinned: dict[str, dict[bytes, None]] = {}  # insertion-ordered sets
    for token_ids in pinned_prefixes:
        for pool, block_hashes in names.prefix_blocks(names.prefix_key(token_ids)).items():
            pinned.setdefault(pool, {}).update(dict.fromkeys(block_hashes))
    pools = tuple(PoolLayout(spec, worker, sizing.blocks_per_pool[spec.name],
                             tuple(pinned.get(spec.name, ())))
                  for worker, worker_specs in workers for spec in worker_specs.values())
    if too_small is None:  # a refused cache is refused for its size, whatever it pins
        for pool in pools:
            if pool.num_pinned_blocks > pool.num_blocks:
                raise InvalidParameterError("pinned_prefixes", "the pinned prefixes need more than the "
                                            "{num_blocks} blocks of pool {pool!r}; pin less or give the "
                                            "KV cache more memory", num_blocks=pool.num_blocks,
                                            pool=pool.name)
    return StartupLayout(pools, t, max_seq_len, target.max_position_embeddings, max_encoder_tokens,
                         sizing.capacity_tokens, reserve, free_bytes, kv_cache_bytes, catalogue_bytes,
                         too_small)


def _check_pins(prefixes: Sequence[Sequence[int]], target: ModelArch, tokens_per_block: int) -> None:
    """Refuse the pins start-up cannot hold: any on an encoder-decoder, one shorter than a block, a
    token outside the vocabulary. The messages name a prefix by its index (the parameter is
    `pinned_prefixes`, --pin-prefix on the command line)."""
    if prefixes and target.is_encoder_decoder:
        raise InvalidParameterError("pinned_prefixes", "{model} is an encoder-decoder model: its source is "
                                    "encoded whole per request, so there is no prefix to pin",
                                    model=target.name)
    for index, token_ids in enumerate(prefixes):
        if len(token_ids) < tokens_per_block:
            raise InvalidParameterError("pinned_prefixes", "prefix {index} has {num_tokens} tokens, fewer "
                                        "than one block ({t}): nothing to pin", index=index,
                                        num_tokens=len(token_ids), t=tokens_per_block)
        outside = [token for token in token_ids if not 0 <= token < target.vocab_size]
        if outside:
            raise InvalidParameterError("pinned_prefixes", "prefix {index} holds token id {token}, outside "
                                        "the vocabulary [0, {vocab_size})", index=index, token=outside[0],
                                        vocab_size=target.vocab_size)
