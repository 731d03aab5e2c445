"""A GGUF conversion's repeated parsing done once: the file's metadata, and gguf-py's tensor-name map.

transformers' GGUF path (`load_gguf_checkpoint`) builds a fresh `gguf.GGUFReader` each time it is called,
and a conversion (sources.py: _convert_gguf) calls it three times: for the config, for the weights and,
inside AutoTokenizer, for the config again. The reader walks the metadata one numpy slice per value,
and gemma3-270m's metadata is a 262,144-token vocabulary with a score and a type per token: ~2.4 M
slices, each through `np.memmap`'s Python-level `__getitem__` and `__array_finalize__`. Measured on 2
cores: 10-15 s a parse, three parses in a ~60 s conversion. Then, mapping GGUF tensor names to the
model's, `get_gguf_hf_weights_map` recurses into every submodule and builds gguf-py's `TensorNameMap`
(every name pattern formatted for every layer) afresh at each: 397 maps for SmolLM2 (~6 s), 313 for
gemma3-270m (~3 s), all equal.

`gguf_parsed_once()` makes the `gguf.GGUFReader` and `gguf.get_tensor_name_map` that transformers
imports (it does so inside its functions, at call time) hand out one reader per file and one name map per
(architecture, layer count) for as long as the block runs. The reader slices a plain ndarray view of the
same read-only mapping (no copy: pages are still read on demand). Same fields, same tensors, same names:
the converted directory is byte-for-byte the one the stock functions give (checked on gemma3-270m and
SmolLM2: every file's sha256), in ~25 s instead of ~60 s for gemma3-270m, ~10 s instead of ~18 s for
SmolLM2.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

# One patched block at a time: two conversions in two threads must not restore each other's original.
_LOCK = threading.Lock()


@contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """While the block runs, `gguf.GGUFReader(path)` in read-only mode returns one plain-array reader
    per path (any other mode: the stock reader, as before), and `gguf.get_tensor_name_map(arch, n)`
    one map per (arch, n)."""
    import gguf

    stock_reader, stock_name_map = gguf.GGUFReader, gguf.get_tensor_name_map

    class PlainArrayReader(stock_reader):
        """gguf-py's reader over `np.asarray(memmap)`: an ndarray view of the mapping, sliced at C speed."""

        @property
        def data(self) -> np.ndarray:
            return self._plain_data

        @data.setter
        def data(self, value) -> None:  # GGUFReader.__init__ assigns `self.data = np.memmap(path, mode)`
            self._plain_data = np.asarray(value)

    readers: dict[str, PlainArrayReader] = {}
    name_maps: dict[tuple, object] = {}

    def reader(path, mode="r"):
        if mode != "r":
            return stock_reader(path, mode)
        key = os.path.realpath(os.fspath(path))
        if key not in readers:
            readers[key] = PlainArrayReader(path, mode)
        return readers[key]

    def name_map(arch, n_blocks):
        key = (arch, n_blocks)
        if key not in name_maps:
            name_maps[key] = stock_name_map(arch, n_blocks)
        return name_maps[key]

    with _LOCK:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = stock_reader, stock_name_map
            readers.clear()
            name_maps.clear()
