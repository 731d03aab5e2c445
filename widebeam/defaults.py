"""Defaults defined once: every CLI flag, config dataclass and planner reads them from here."""

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_TOKENS_PER_BLOCK = 16
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
DEFAULT_MAX_BEAM_WIDTH = 256
DEFAULT_KV_CACHE_FRACTION = 0.9
# float32 CPU linears: "torch" (F.linear), "auto" (the weight also packed once for oneDNN, run at 4-128
# rows: 1.06-1.15x at W=4-64, but every linear weight held twice) or "onednn" (packed at every row count:
# slower at 1-3 rows). "torch" stays the default: "auto" doubles the weights' memory (model/packed_linear.py).
LINEAR_BACKENDS = ("torch", "auto", "onednn")
DEFAULT_LINEAR_BACKEND = "torch"
# On a CPU host the KV cache shares memory with everything else the user runs, and tests and
# users may hold several engines in one process: without `kv_cache_memory`, take at most this.
DEFAULT_CPU_KV_CACHE_BYTES = 2 * 2**30
