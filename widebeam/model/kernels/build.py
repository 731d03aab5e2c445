"""Compile the C++ kernels (int8 KV cache, beam selection, few-row linears):
`python -m widebeam.model.kernels.build` (run by `make setup`).

The one place they are compiled: nothing compiles at import or at run time. The library goes to
`_build/` beside this file with the hash of its sources, the torch version it was built against and the
vector capability torch dispatches to (`kernels.stamp`); a build whose stamp does not match the current
sources is not loaded (`__init__.py`). Compiled with -march=native for the machine that runs it (`make`
builds on the machine it runs on), with torch's CPU_CAPABILITY defines for the capability torch uses here,
so `Vectorized<float>` in row_top.cpp is the one torch's log-softmax runs with.

Without a C++ compiler it says so and exits 0 (the torch path serves every read and write); with one, a
failed build exits non-zero, so `make` fails loudly instead of leaving the kernels silently off.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import time

import torch
from torch.utils import cpp_extension

from widebeam.model.kernels import BUILD_DIR, LIBRARY, SOURCES, STAMP, cpu_capability, source_stamp

# no -ffast-math: the write must round as the torch path does (kernels/int8_kv.cpp)
# torch 2.13 headers use a C++20 bit-field initializer (GCC accepts it) and leave a register undefined on
# purpose in Vectorized<float>'s reductions (_mm512_undefined_ps): neither is ours to fix
CXX_FLAGS = ["-O3", "-march=native", "-std=c++17", "-fPIC", "-fopenmp", "-Wall", "-Wno-c++20-extensions",
             "-Wno-maybe-uninitialized"]


def compiler() -> str | None:
    """The C++ compiler to use: $CXX, else c++ / g++ on PATH, else None."""
    for name in (os.environ.get("CXX"), "c++", "g++"):
        if name and shutil.which(name):
            return name
    return None


def capability_defines(capability: str) -> list[str]:
    """The defines torch compiles its kernels for `capability` with (ATen/cpu/vec picks Vectorized by them);
    DEFAULT (or one this file does not know) defines none: the scalar Vectorized."""
    if capability in ("AVX512", "AVX2"):
        return [f"-DCPU_CAPABILITY={capability}", f"-DCPU_CAPABILITY_{capability}"]
    return []


def command(cxx: str, output: str, capability: str) -> list[str]:
    """The one compile-and-link line (every source in one call: no ninja, no object files)."""
    includes = [f"-I{path}" for path in cpp_extension.include_paths()]
    libraries = cpp_extension.library_paths()
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    return [cxx, *CXX_FLAGS, abi, "-DTORCH_API_INCLUDE_EXTENSION_H", *capability_defines(capability),
            *includes, f"-I{sysconfig.get_paths()['include']}", *map(str, SOURCES), "-shared", "-o", output,
            *(f"-L{path}" for path in libraries), *(f"-Wl,-rpath,{path}" for path in libraries),
            "-lc10", "-ltorch_cpu", "-ltorch"]


def build(force: bool = False) -> bool:
    """Build the library unless the current one matches the source; False when there is no compiler."""
    capability = cpu_capability()
    stamp = source_stamp(capability)
    if not force and LIBRARY.exists() and STAMP.exists() and STAMP.read_text() == stamp:
        STAMP.touch()  # newer than what make compares it with, so make stops asking
        print(f"C++ kernels up to date: {LIBRARY}")
        return True
    cxx = compiler()
    if cxx is None:
        print("no C++ compiler on PATH: C++ kernels not built (the torch path is used)", file=sys.stderr)
        return False
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    STAMP.unlink(missing_ok=True)  # a half-finished build must never look current
    partial = BUILD_DIR / (LIBRARY.name + ".tmp")
    started_s = time.perf_counter()
    subprocess.run(command(cxx, str(partial), capability), check=True)
    partial.replace(LIBRARY)
    STAMP.write_text(stamp)
    print(f"C++ kernels built for {capability} in {time.perf_counter() - started_s:.1f} s: {LIBRARY}")
    return True


def main() -> None:
    try:
        build(force="--force" in sys.argv[1:])
    except subprocess.CalledProcessError as error:
        sys.exit(f"building the C++ kernels failed ({error.returncode})")


if __name__ == "__main__":
    main()
