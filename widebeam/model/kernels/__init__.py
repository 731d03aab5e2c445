"""C++ kernels on the CPU, one library: the int8 KV cache's write (`int8_kv.cpp`: `torch.ops.widebeam.
quantize_write`), attention of a few rows over an int8 or a float32/bfloat16 cache (`attention.cpp`:
`int8_attention`, `int8_group_attention`, `dense_attention`, `dense_group_attention`), a beam step's
selection (`row_top.cpp`: `torch.ops.widebeam.log_softmax_topk`) and linears at 1-8 rows, float32 or
16-bit (`few_rows.cpp`: `torch.ops.widebeam.few_rows_linear`, run by model/linears/split.py), RMSNorm and
the rotary embedding and the gated MLP's activation (`elementwise.cpp`: `rms_norm`, `rotary`, `silu_and_mul`,
run by model/families/layers.py), many query rows tiled (`flash_rows.h`, through the attention ops past
`FLASH_MIN_ROWS`), and rows of a KV cache copied by index (`copy_rows.cpp`: the step's K/V write and the
copy-on-write copies), and an int8 linear's activations quantized per row (`quantize_rows.cpp`, run by
model/linears/int8.py).

Why: at small beam widths an int8 cache's cost is kernel launches, not bytes: per layer ~15 eager ops to
quantize and write a step's K/V and ~8 to dequantize what attention reads (one decode step of
SmolLM2-135M over 512 prompt tokens at W=1: 37 ms against 28 ms with float32 KV). Each kernel is one op.
At wide beams the selection's cost is what torch.topk copies: every row as (value, index) pairs before a
partial sort; `log_softmax_topk` reads each row from cache instead (beam/ranking.py).

Built only by `python -m widebeam.model.kernels.build` (`make setup`), never at import or run time. The
library is loaded here when its stamp matches the current sources and torch; a missing or stale build
leaves `available()` False and the torch path (quantized_kv.py, backends.py, beam/ranking.py: the
reference, and the only path on CUDA) serves everything. `log_softmax_topk` is built for the vector
capability torch dispatches to at build time (its values are torch's log-softmax bit for bit only there),
so it serves only while torch still reports that capability (`ATEN_CPU_CAPABILITY` can change it).
WIDEBEAM_KERNELS=0 turns the kernels off for a process; `ENABLED` (read at every call through `enabled()`;
`SELECTION_ENABLED` for the selection, `LINEAR_ENABLED` for the linears, `DENSE_ATTENTION_ENABLED` for a
float cache's attention, `ELEMENTWISE_ENABLED` for the norms, rotary and activation) turns them off from
code, so benchmarks A/B them in one process.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
SOURCES = (HERE / "int8_kv.cpp", HERE / "attention.cpp", HERE / "row_top.cpp", HERE / "few_rows.cpp",
           HERE / "elementwise.cpp", HERE / "copy_rows.cpp", HERE / "quantize_rows.cpp",
           HERE / "int8_rows.cpp")
# in the stamp, not on the compile line
HEADERS = (HERE / "common.h", HERE / "sources.h", HERE / "flash_rows.h", HERE / "few_row_keys.h")
BUILD_DIR = HERE / "_build"
LIBRARY = BUILD_DIR / "kernels.so"
# the sources' hash, the torch version and the vector capability the library was built for
STAMP = BUILD_DIR / "kernels.stamp"
KERNELS_ENV = "WIDEBEAM_KERNELS"

ENABLED = os.environ.get(KERNELS_ENV, "1") != "0"
# the selection's own switch (from code: benchmarks A/B it apart from the int8 KV kernels)
SELECTION_ENABLED = ENABLED
# the few-row linears' own switch (model/linears/split.py probes again when it changes)
LINEAR_ENABLED = ENABLED
# float32/bfloat16 caches' attention through `dense_attention` (model/attention/backends.py)
DENSE_ATTENTION_ENABLED = ENABLED
# ... where the library was built for one of these: its reads hold 16 floats as one value (common.h's
# Vec16), one AVX-512 register. Built for AVX2 they lost end to end on a 2-core AVX2 EPYC: 1.11-1.73x the
# torch path's time at W=4/16, P=320/2,048 (benchmarks/results/dense_attention_enabled_ab_float32_avx2.json)
# and 2-5x a read of one row (SDPA's fused kernel 79-375 us a layer, the kernel 174-1,900 at 150-2,100 keys)
DENSE_ATTENTION_CAPABILITIES = ("AVX512",)
# RMSNorm and the rotary embedding as one op each (model/families/layers.py)
ELEMENTWISE_ENABLED = ENABLED
# many query rows (a wide group against its prompt) through the tiled kernel (flash_rows.h), past the
# few-row caps of model/attention/backends.py; `set_flash_rows` moves the C++ side with it
FLASH_ROWS_ENABLED = ENABLED
# an int8 linear's activations quantized per row in one op (quantize_rows.cpp, model/linears/int8.py)
QUANTIZE_ROWS_ENABLED = ENABLED
# an int8 linear's 1-8 rows read from its int8 weight, exact, where FBGEMM is not (int8_rows.cpp)
INT8_ROWS_ENABLED = ENABLED
# the step's K/V write and the copy-on-write copies as one row-copying op each (copy_rows.cpp)
COPY_ROWS_ENABLED = ENABLED
# the head sizes flash_rows.h serves (its products are unrolled for them)
FLASH_HEAD_DIMS = (64, 128)
# from this many rows the C++ reads take the tiled path (kernel / few-row path at 2,048 keys, 5 KV heads:
# 6 rows 0.85, 12 rows 0.81, 48 rows 0.66; at 300 keys, 3 KV heads: 6 rows 1.07, 12 rows 0.95)
FLASH_MIN_ROWS = 12
# ... and from this many rows x keys (a short prompt reads as fast on the few-row path); attention.cpp's
# default, restated so `set_flash_rows` restores both
FLASH_MIN_WORK = 6144


def cpu_capability() -> str:
    """The vector capability torch's own CPU kernels run with here (AVX512, AVX2, DEFAULT, ...)."""
    return torch.backends.cpu.get_cpu_capability()


def source_stamp(capability: str | None = None) -> str:
    """What a current build's stamp holds: the sources' sha256, the torch it was compiled against and the
    capability `row_top.cpp` was compiled for (today's, unless given)."""
    digest = hashlib.sha256(b"".join(source.read_bytes() for source in (*SOURCES, *HEADERS))).hexdigest()
    return f"{digest} torch {torch.__version__} {capability or cpu_capability()}\n"


def _built_capability() -> str | None:
    """The capability in the stamp of a library built from the current sources and torch, else None."""
    if not (LIBRARY.exists() and STAMP.exists()):
        return None
    stamp = STAMP.read_text()
    capability = stamp.rsplit(" ", 1)[-1].strip()
    return capability if stamp == source_stamp(capability) else None


def _load() -> str | None:
    capability = _built_capability()
    if capability is not None and not hasattr(torch.ops.widebeam, "int8_attention"):  # once per process
        torch.ops.load_library(str(LIBRARY))
    return capability


_BUILT_FOR = _load()
_AVAILABLE = _BUILT_FOR is not None


def available() -> bool:
    """Whether the compiled kernels are loaded (built, and from the current source)."""
    return _AVAILABLE


def enabled() -> bool:
    """Whether int8 KV reads and writes on the CPU go through the kernels: loaded and not switched off."""
    return _AVAILABLE and ENABLED


def selection_enabled() -> bool:
    """Whether `log_softmax_topk` serves: loaded, switched on, and torch dispatches to the capability it was
    built for."""
    return _AVAILABLE and SELECTION_ENABLED and _BUILT_FOR == cpu_capability()


def dense_attention_enabled() -> bool:
    """Whether a float32 or bfloat16 cache's few-row reads go through `dense_attention` and
    `dense_group_attention`: loaded, switched on, and built for one of DENSE_ATTENTION_CAPABILITIES."""
    return _AVAILABLE and DENSE_ATTENTION_ENABLED and _BUILT_FOR in DENSE_ATTENTION_CAPABILITIES


def flash_rows_enabled() -> bool:
    """Whether reads of many query rows (past backends.py's few-row caps) go through the tiled C++ kernel:
    loaded and on."""
    return _AVAILABLE and FLASH_ROWS_ENABLED


def int8_rows_enabled() -> bool:
    """Whether `int8_few_rows` serves the "float_exact" int8 linears' 1-8 rows: loaded and on."""
    return _AVAILABLE and INT8_ROWS_ENABLED


def quantize_rows_enabled() -> bool:
    """Whether `quantize_rows` quantizes an int8 linear's activations: loaded and on."""
    return _AVAILABLE and QUANTIZE_ROWS_ENABLED


def copy_rows_enabled() -> bool:
    """Whether `copy_rows` writes the step's K/V into a float cache and runs the copy-on-write copies:
    loaded and on."""
    return _AVAILABLE and COPY_ROWS_ENABLED


def set_flash_rows(enabled: bool) -> None:
    """Turn the tiled path on or off on both sides: the Python caps (`FLASH_ROWS_ENABLED`) and the row
    count from which the C++ reads tile (`FLASH_MIN_ROWS` and `FLASH_MIN_WORK`, or never)."""
    global FLASH_ROWS_ENABLED
    FLASH_ROWS_ENABLED = enabled
    if _AVAILABLE:
        torch.ops.widebeam.set_flash_min_rows(FLASH_MIN_ROWS if enabled else 2**62, FLASH_MIN_WORK)


def elementwise_enabled() -> bool:
    """Whether `rms_norm`, `rotary` and `silu_and_mul` serve the decoders' norms, rotary embeddings and
    gated MLPs: loaded and on."""
    return _AVAILABLE and ELEMENTWISE_ENABLED


def linear_enabled() -> bool:
    """Whether `few_rows_linear` serves the split linears' 1-4 row products: loaded and switched on (it is
    compiled for this machine, and reads and writes no torch kernel's bits, so any capability serves)."""
    return _AVAILABLE and LINEAR_ENABLED


set_flash_rows(FLASH_ROWS_ENABLED)  # the C++ side's row count from this module's switch
