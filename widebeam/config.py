"""The engine's settings as frozen dataclasses, defaults from widebeam/defaults.py (defined once).

Derived values (blocks per pool, `max_seq_len`, the activation reserve) live on the engine, not here.
"""

from __future__ import annotations

from dataclasses import dataclass

from widebeam.defaults import (
    DEFAULT_DTYPE,
    DEFAULT_KV_CACHE_FRACTION,
    DEFAULT_LINEAR_BACKEND,
    DEFAULT_MAX_BEAM_WIDTH,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MODEL,
    DEFAULT_TOKENS_PER_BLOCK,
    FLOAT_DTYPES,
    KV_CACHE_DTYPES,
    LINEAR_BACKENDS,
    MAX_NUM_SPECULATIVE_TOKENS,
)
from widebeam.errors import InvalidParameterError


@dataclass(frozen=True)
class ModelConfig:
    model: str = DEFAULT_MODEL  # alias, Hugging Face directory or .gguf file
    dtype: str = DEFAULT_DTYPE
    device: str | None = None  # None: cuda when available, else cpu
    # None: $WIDEBEAM_ATTENTION_BACKEND, else "sdpa" (model/attention/backends.py); chosen once
    attention_backend: str | None = None
    # "torch" | "auto" | "onednn": float32 CPU linears with the weight packed once for oneDNN
    # (model/linears/packed.py)
    linear_backend: str = DEFAULT_LINEAR_BACKEND

    def __post_init__(self) -> None:
        if self.linear_backend not in LINEAR_BACKENDS:
            raise InvalidParameterError("linear_backend", "{linear_backend} must be one of "
                                        f"{', '.join(LINEAR_BACKENDS)}, got {{value!r}}",
                                        value=self.linear_backend)


@dataclass(frozen=True)
class CacheConfig:
    kv_cache_memory: int | str | None = None  # None: what is left after the measured activations
    kv_cache_fraction: float = DEFAULT_KV_CACHE_FRACTION
    tokens_per_block: int = DEFAULT_TOKENS_PER_BLOCK
    enable_prefix_caching: bool = True  # computed prompt blocks stay cached for later requests
    # Prompts (text or token ids) computed at start-up whose blocks stay cached for good.
    pinned_prefixes: tuple[str | tuple[int, ...], ...] = ()
    # What every pool stores: "auto" (the model's KV dtype), a float type, or int8 with scales (kv/spec.py)
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidParameterError("kv_cache_dtype", "{kv_cache_dtype} must be one of "
                                        f"{', '.join(KV_CACHE_DTYPES)}, got {{value!r}}",
                                        value=self.kv_cache_dtype)
        if not 0 < self.kv_cache_fraction <= 1:
            raise InvalidParameterError("kv_cache_fraction",
                                        "{kv_cache_fraction} must be in (0, 1], got {value}",
                                        value=self.kv_cache_fraction)
        if self.tokens_per_block < 1:
            raise InvalidParameterError("tokens_per_block", "{tokens_per_block} must be >= 1, got {value}",
                                        value=self.tokens_per_block)


# Capacity policies (TensorRT-LLM's names): "guaranteed_no_evict" admits a request when its worst
# case fits beside the running ones' (nothing is ever evicted); "max_utilization" admits on the next
# step's blocks and preempts the most recently admitted request when a step runs short (it resumes
# by recomputation; widebeam/sched/preemption.py).
SCHEDULING_POLICIES = ("guaranteed_no_evict", "max_utilization")
DEFAULT_MAX_PREEMPTIONS = 3


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_beam_width: int = DEFAULT_MAX_BEAM_WIDTH
    max_seq_len: int | None = None  # None: the model's limit bounded by the cache's capacity
    scheduling_policy: str = "guaranteed_no_evict"
    # max_utilization: a request preempted this many times next runs under the guaranteed policy's
    # reservation (never preempted again), before any newer request is admitted
    max_preemptions: int = DEFAULT_MAX_PREEMPTIONS
    # The waiting queue's bounds (None: unbounded, as offline batches queue every prompt at once): past
    # either, add_request raises QueueFullError (a server's 429) instead of queueing. Blocks: the waiting
    # requests' reservations summed, per pool.
    max_waiting_requests: int | None = None
    max_waiting_blocks: int | None = None
    # A queue head that does not fit preempts running requests of a lower priority (sched/scheduler.py);
    # admission then counts every request's re-feed after a preemption.
    priority_preemption: bool = False
    # Compute for the urgent (sched/scheduler.py): while a request of a more urgent priority runs, the
    # others run one step in this many (0: every step, off).
    priority_yield: int = 0

    def __post_init__(self) -> None:
        for name in ("max_waiting_requests", "max_waiting_blocks"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise InvalidParameterError(name, f"{{{name}}} must be an integer >= 1, got {{value!r}}",
                                            value=value)
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise InvalidParameterError("scheduling_policy", "{scheduling_policy} must be one of "
                                        f"{', '.join(SCHEDULING_POLICIES)}, got {{value!r}}",
                                        value=self.scheduling_policy)
        if isinstance(self.max_preemptions, bool) or not isinstance(self.max_preemptions, int) \
                or self.max_preemptions < 0:
            raise InvalidParameterError("max_preemptions",
                                        "{max_preemptions} must be an integer >= 0, got {value!r}",
                                        value=self.max_preemptions)
        if isinstance(self.priority_yield, bool) or not isinstance(self.priority_yield, int) \
                or self.priority_yield < 0 or self.priority_yield == 1:
            raise InvalidParameterError("priority_yield", "{priority_yield} must be 0 (off) or an integer "
                                        ">= 2, got {value!r}", value=self.priority_yield)
        if self.max_beam_width < 1:
            raise InvalidParameterError("max_beam_width", "{max_beam_width} must be >= 1, got {value}",
                                        value=self.max_beam_width)
        if self.max_num_batched_tokens < 1:
            raise InvalidParameterError("max_num_batched_tokens",
                                        "{max_num_batched_tokens} must be >= 1, got {value}",
                                        value=self.max_num_batched_tokens)


SPECULATIVE_METHODS = ("draft", "ngram")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: a draft proposes up to `num_speculative_tokens` (D) tokens per sequence
    each round, the target verifies them in one pass. "draft": a second model (`model`, same
    tokenizer) in its own worker and KV pools; "ngram": prompt lookup, copied from the request's own
    prompt and output, no draft model. D is also what every per-sequence pool reserves per sequence."""

    method: str = "draft"
    model: str | None = None
    num_speculative_tokens: int = 4
    dtype: str | None = None  # the draft model's weights and KV (None: the target's): bfloat16 self-drafts
    adaptive: bool = True  # a request whose drafts are rarely accepted stops drafting for a while (policy.py)

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise InvalidParameterError("speculative_method", "{speculative_method} must be one of "
                                        f"{', '.join(SPECULATIVE_METHODS)}, got {{value!r}}",
                                        value=self.method)
        if self.method == "draft" and not self.model:
            raise InvalidParameterError("speculative_model", "{speculative_model} is required with "
                                        "{speculative_method}='draft'")
        if self.method == "ngram" and self.model:
            raise InvalidParameterError("speculative_model",
                                        "{speculative_method}='ngram' takes no draft model, "
                                        "got {value!r}", value=self.model)
        if self.dtype is not None and self.dtype not in FLOAT_DTYPES:
            floats = f"{', '.join(FLOAT_DTYPES[:-1])} or {FLOAT_DTYPES[-1]}"
            raise InvalidParameterError("speculative_dtype", f"{{speculative_dtype}} must be {floats}, "
                                        "got {value!r}", value=self.dtype)
        if self.method == "ngram" and self.dtype is not None:
            raise InvalidParameterError("speculative_dtype",
                                        "{speculative_method}='ngram' has no draft model "
                                        "to give {speculative_dtype}")
        if isinstance(self.num_speculative_tokens, bool) or not isinstance(self.num_speculative_tokens, int) \
                or not 1 <= self.num_speculative_tokens <= MAX_NUM_SPECULATIVE_TOKENS:
            raise InvalidParameterError("num_speculative_tokens",
                                        "{num_speculative_tokens} must be an integer in "
                                        f"[1, {MAX_NUM_SPECULATIVE_TOKENS}], got {{value!r}}",
                                        value=self.num_speculative_tokens)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = ModelConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding

    @classmethod
    def from_kwargs(cls, model: str = DEFAULT_MODEL, *, dtype: str = DEFAULT_DTYPE, device: str | None = None,
                    attention_backend: str | None = None, linear_backend: str = DEFAULT_LINEAR_BACKEND,
                    kv_cache_memory: int | str | None = None,
                    kv_cache_fraction: float = DEFAULT_KV_CACHE_FRACTION,
                    tokens_per_block: int = DEFAULT_TOKENS_PER_BLOCK, kv_cache_dtype: str = "auto",
                    max_seq_len: int | None = None,
                    max_beam_width: int = DEFAULT_MAX_BEAM_WIDTH,
                    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
                    speculative_model: str | None = None, num_speculative_tokens: int | None = None,
                    speculative_method: str | None = None, speculative_dtype: str | None = None,
                    speculative_adaptive: bool = True, enable_prefix_caching: bool = True,
                    pinned_prefixes=(), scheduling_policy: str = "guaranteed_no_evict",
                    max_preemptions: int = DEFAULT_MAX_PREEMPTIONS, max_waiting_requests: int | None = None,
                    max_waiting_blocks: int | None = None, priority_preemption: bool = False,
                    priority_yield: int = 0) -> EngineConfig:
        """The flat keyword arguments `LLMEngine` and `LLM` take, grouped. Speculation is on when
        `speculative_model` or `speculative_method` is given (the method defaults to "draft" with a
        model, and D to 4)."""
        speculative = None
        if speculative_model is not None or speculative_method is not None:
            speculative = SpeculativeConfig(speculative_method or "draft", speculative_model,
                                            4 if num_speculative_tokens is None else num_speculative_tokens,
                                            speculative_dtype, speculative_adaptive)
        elif num_speculative_tokens is not None:
            raise InvalidParameterError("num_speculative_tokens", "{num_speculative_tokens} needs "
                                        "{speculative_model} or {speculative_method}")
        return cls(ModelConfig(model, dtype, device, attention_backend, linear_backend),
                   CacheConfig(kv_cache_memory, kv_cache_fraction, tokens_per_block,
                               bool(enable_prefix_caching),
                               _pinned_prefixes(pinned_prefixes, enable_prefix_caching), kv_cache_dtype),
                   SchedulerConfig(max_num_batched_tokens, max_beam_width, max_seq_len, scheduling_policy,
                                   max_preemptions, max_waiting_requests, max_waiting_blocks,
                                   bool(priority_preemption), priority_yield), speculative)


def _pinned_prefixes(prefixes, enable_prefix_caching: bool) -> tuple[str | tuple[int, ...], ...]:
    """Validated pinned prefixes: strings or token-id lists (tuples once frozen)."""
    if isinstance(prefixes, (str, bytes)) or (prefixes and all(isinstance(t, int) for t in prefixes)):
        prefixes = [prefixes]  # one prefix given bare
    out = []
    for i, prefix in enumerate(prefixes or ()):
        if isinstance(prefix, str) and prefix:
            out.append(prefix)
        elif isinstance(prefix, (list, tuple)) and prefix and all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prefix):
            out.append(tuple(prefix))
        else:
            raise InvalidParameterError("pinned_prefixes",
                                        "{pinned_prefixes}[{index}] must be a non-empty string or "
                                        "list of token ids, got {value!r}", index=i, value=prefix)
    if out and not enable_prefix_caching:
        raise InvalidParameterError("pinned_prefixes", "{pinned_prefixes} need prefix caching: drop "
                                    "enable_prefix_caching=False (--no-prefix-caching) or the pins")
    return tuple(out)
