"""The engine's settings as frozen dataclasses, defaults from widebeam/defaults.py (defined once).

Derived values (blocks per pool, `max_seq_len`, the activation reserve) live on the engine, not here.
"""

from __future__ import annotations

from dataclasses import dataclass

from widebeam.defaults import (
    DEFAULT_KV_CACHE_FRACTION,
    DEFAULT_MAX_BEAM_WIDTH,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MODEL,
    DEFAULT_TOKENS_PER_BLOCK,
)
from widebeam.errors import InvalidParameterError


@dataclass(frozen=True)
class ModelConfig:
    model: str = DEFAULT_MODEL  # alias, Hugging Face directory or .gguf file
    dtype: str = "float32"
    device: str | None = None  # None: cuda when available, else cpu
    # None: $WIDEBEAM_ATTENTION_BACKEND, else "sdpa" (model/attention_backends.py); chosen once
    attention_backend: str | None = None


@dataclass(frozen=True)
class CacheConfig:
    kv_cache_memory: int | str | None = None  # None: what is left after the measured activations
    kv_cache_fraction: float = DEFAULT_KV_CACHE_FRACTION
    tokens_per_block: int = DEFAULT_TOKENS_PER_BLOCK

    def __post_init__(self) -> None:
        if not 0 < self.kv_cache_fraction <= 1:
            raise InvalidParameterError("kv_cache_fraction", "{kv_cache_fraction} must be in (0, 1], got {value}",
                                        value=self.kv_cache_fraction)
        if self.tokens_per_block < 1:
            raise InvalidParameterError("tokens_per_block", "{tokens_per_block} must be >= 1, got {value}",
                                        value=self.tokens_per_block)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_beam_width: int = DEFAULT_MAX_BEAM_WIDTH
    max_seq_len: int | None = None  # None: the model's limit bounded by the cache's capacity

    def __post_init__(self) -> None:
        if self.max_beam_width < 1:
            raise InvalidParameterError("max_beam_width", "{max_beam_width} must be >= 1, got {value}",
                                        value=self.max_beam_width)
        if self.max_num_batched_tokens < 1:
            raise InvalidParameterError("max_num_batched_tokens", "{max_num_batched_tokens} must be >= 1, got {value}",
                                        value=self.max_num_batched_tokens)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = ModelConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()

    @classmethod
    def from_kwargs(cls, model: str = DEFAULT_MODEL, *, dtype: str = "float32", device: str | None = None,
                    attention_backend: str | None = None,
                    kv_cache_memory: int | str | None = None, kv_cache_fraction: float = DEFAULT_KV_CACHE_FRACTION,
                    tokens_per_block: int = DEFAULT_TOKENS_PER_BLOCK, max_seq_len: int | None = None,
                    max_beam_width: int = DEFAULT_MAX_BEAM_WIDTH,
                    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS) -> EngineConfig:
        """The flat keyword arguments `LLMEngine` and `LLM` take, grouped."""
        return cls(ModelConfig(model, dtype, device, attention_backend),
                   CacheConfig(kv_cache_memory, kv_cache_fraction, tokens_per_block),
                   SchedulerConfig(max_num_batched_tokens, max_beam_width, max_seq_len))
