"""Defaults defined once: every CLI flag, config dataclass and planner reads them from here."""

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_TOKENS_PER_BLOCK = 16
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
DEFAULT_MAX_BEAM_WIDTH = 256
DEFAULT_KV_CACHE_FRACTION = 0.9
# float32 CPU linears: "split" (the default: at 1-4 rows the weight's output rows run as batched blocks on
# every thread, F.linear otherwise; no copy; 1.4x at W=1 and 4, model/linears/split.py), "torch" (F.linear,
# the reference), "auto" (the weight also packed once for oneDNN, run at 4-128 rows: every linear weight
# held twice) or "onednn" (packed at every row count; model/linears/packed.py).
LINEAR_BACKENDS = ("torch", "split", "auto", "onednn")
DEFAULT_LINEAR_BACKEND = "split"
# On a CPU host the KV cache shares memory with everything else the user runs, and tests and
# users may hold several engines in one process: without `kv_cache_memory`, take at most this.
DEFAULT_CPU_KV_CACHE_BYTES = 2 * 2**30
# Weights and KV dtypes, written once: every `--dtype` flag and config check reads them from here.
# int8 is a weights-only dtype (int8 linear weights, float32 activations and KV): a draft model or a
# KV pool takes a float one.
FLOAT_DTYPES = ("float32", "bfloat16", "float16")
DTYPES = (*FLOAT_DTYPES, "int8")
# What a KV pool may store (`kv_cache_dtype`): "auto" is the model's KV dtype (kv/spec.py: `kv_dtype`);
# int8 holds each token's K and V per KV head as int8, a float16 scale per group of >= 32 values.
KV_CACHE_DTYPES = ("auto", *FLOAT_DTYPES, "int8")
DEFAULT_DTYPE = "float32"
MAX_NUM_SPECULATIVE_TOKENS = 64  # SpeculativeConfig's bound on D, drafted tokens per sequence and round
