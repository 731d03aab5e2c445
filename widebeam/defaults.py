"""Defaults defined once: every CLI flag, config dataclass and planner reads them from here."""

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_TOKENS_PER_BLOCK = 16
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
DEFAULT_MAX_BEAM_WIDTH = 256
DEFAULT_KV_CACHE_FRACTION = 0.9
# float32 CPU linears: "auto" (weight packed once for 4-128 rows, else F.linear; model/packed_linear.py),
# "onednn" (packed at every row count) or "torch" (F.linear)
DEFAULT_LINEAR_BACKEND = "auto"
# On a CPU host the KV cache shares memory with everything else the user runs, and tests and
# users may hold several engines in one process: without `kv_cache_memory`, take at most this.
DEFAULT_CPU_KV_CACHE_BYTES = 2 * 2**30
