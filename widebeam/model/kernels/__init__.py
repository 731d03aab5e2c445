"""C++ kernels for the int8 KV cache on the CPU (`int8_kv.cpp`): `torch.ops.widebeam.quantize_write`
and `torch.ops.widebeam.int8_attention`.

Why: at small beam widths an int8 cache's cost is kernel launches, not bytes: per layer ~15 eager ops to
quantize and write a step's K/V and ~8 to dequantize what attention reads (one decode step of
SmolLM2-135M over 512 prompt tokens at W=1: 37 ms against 28 ms with float32 KV). Each kernel is one op.

Built only by `python -m widebeam.model.kernels.build` (`make setup`), never at import or run time. The
library is loaded here when its stamp matches the current source and torch; a missing or stale build
leaves `available()` False and the torch path (quantized_kv.py, backends.py: the reference, and the only
path on CUDA) serves everything. WIDEBEAM_KERNELS=0 turns the kernels off for a process; `ENABLED` (read
at every call through `enabled()`) turns them off from code, so benchmarks A/B them in one process.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

SOURCE = Path(__file__).resolve().parent / "int8_kv.cpp"
BUILD_DIR = SOURCE.parent / "_build"
LIBRARY = BUILD_DIR / "int8_kv.so"
STAMP = BUILD_DIR / "int8_kv.stamp"  # the source hash and torch version the library was built from
KERNELS_ENV = "WIDEBEAM_KERNELS"

ENABLED = os.environ.get(KERNELS_ENV, "1") != "0"


def source_stamp() -> str:
    """What a current build's stamp holds: the source's sha256 and the torch it was compiled against."""
    return f"{hashlib.sha256(SOURCE.read_bytes()).hexdigest()} torch {torch.__version__}\n"


def _load() -> bool:
    if not (LIBRARY.exists() and STAMP.exists() and STAMP.read_text() == source_stamp()):
        return False
    if not hasattr(torch.ops.widebeam, "int8_attention"):  # loaded once per process
        torch.ops.load_library(str(LIBRARY))
    return True


_AVAILABLE = _load()


def available() -> bool:
    """Whether the compiled kernels are loaded (built, and from the current source)."""
    return _AVAILABLE


def enabled() -> bool:
    """Whether int8 KV reads and writes on the CPU go through the kernels: loaded and not switched off."""
    return _AVAILABLE and ENABLED
