"""A git revision's C++ kernel source compiled beside this tree's, for A/Bs in one process.

The ops of two revisions cannot load side by side under one name, so the base revision's source
(`widebeam/model/kernels/<name>`) is compiled on the spot (torch.utils.cpp_extension, the flags build.py
uses) with its ops registered under another namespace, `torch.ops.widebeam_base`. Used by
benchmarks/selection_revision_ab.py (row_top.cpp) and benchmarks/few_rows_revision_ab.py (few_rows.cpp).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def load_base_kernel(revision: str, source_name: str, into: Path) -> None:
    """Compile `revision`'s `widebeam/model/kernels/<source_name>` into `into`, its ops under
    `torch.ops.widebeam_base`."""
    from torch.utils.cpp_extension import load

    from widebeam.model import kernels
    from widebeam.model.kernels import build

    source = subprocess.run(["git", "show", f"{revision}:widebeam/model/kernels/{source_name}"], cwd=ROOT,
                            check=True, capture_output=True, text=True).stdout
    source = re.sub(r"TORCH_LIBRARY_(FRAGMENT|IMPL)\(widebeam,", r"TORCH_LIBRARY_\1(widebeam_base,", source)
    stem = Path(source_name).stem + "_base"
    path = into / f"{stem}.cpp"
    path.write_text(source)
    # a header the source includes by name is this tree's (kernels/*.h), not the revision's
    flags = (["-O3", "-march=native", "-std=c++17", "-fopenmp", f"-I{kernels.HERE}"]
             + build.capability_defines(kernels.cpu_capability()))
    load(stem, [str(path)], extra_cflags=flags, extra_ldflags=["-fopenmp"], is_python_module=False,
         build_directory=str(into))
