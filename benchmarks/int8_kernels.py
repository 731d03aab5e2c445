"""A/B of the int8 linear layers (issue #19), two `dtype="int8"` engines over the same SmolLM2-135M
weights in one process: the engine as it loads (FBGEMM where exact, q/k/v and gate/up fused;
widebeam/model/linears/int8.py) against a reference arm, `--reference`:
- "int_mm": `torch._int_mm`, every projection its own layer (the int8 path before these changes);
- "unfused": FBGEMM, every projection its own layer (the fusion's share alone).
All compute the same int32 products and scales, bit for bit, so the best beams must agree.

    python benchmarks/int8_kernels.py [--reference int_mm] [--widths 1 4 16 64] [--repeats 5] [--threads 2]
    python benchmarks/int8_kernels.py --linears-only --repeats 30

The same prompt as `widebeam bench` (P=512), N=32, min_new_tokens = N. Reports the median wall
seconds of each arm and the ratio reference/engine (> 1: the engine's layers are faster). Writes
benchmarks/results/int8_kernels.json (or `--out`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from pathlib import Path
from unittest import mock

import torch
from ab_engines import ab_points, add_ab_arguments, linears_only, run_meta

from widebeam.llm import LLM

REFERENCES = ("int_mm", "unfused")


def load(model: str, arm: str, max_beam_width: int) -> LLM:
    """The engine as it loads ("engine"), or a reference arm (see the module docstring)."""
    patches = [mock.patch("widebeam.model.linears.int8.fbgemm_exact", return_value=arm != "int_mm")]
    if arm != "engine":
        patches.append(mock.patch("widebeam.model.loading.build.fuse_int8_projections",
                                  side_effect=lambda m: m))
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        llm = LLM(model, dtype="int8", device="cpu", kv_cache_memory="512MiB", max_beam_width=max_beam_width)
    layer = llm.engine.model.model.layers[0]
    assert llm.engine.model.lm_head.kernel == ("int_mm" if arm == "int_mm" else "fbgemm"), \
        "not the kernel asked for"
    assert (layer.mlp.gate_up is not None) == (arm == "engine"), "not the fusion asked for"
    return llm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_ab_arguments(parser)
    parser.add_argument("--reference", choices=REFERENCES, default="int_mm")
    parser.add_argument("--out", default="benchmarks/results/int8_kernels.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    llms = {arm: load(args.model, arm, max(args.widths)) for arm in (args.reference, "engine")}
    meta = run_meta(model=args.model, dtype="int8", reference=args.reference, repeats=args.repeats)
    if args.linears_only:
        result = {"meta": meta, "linears_only": linears_only(llms, args.repeats)}
    else:
        result = {"meta": meta,
                  "rows": ab_points(llms, args.widths, args.prompt_len, args.new_tokens, args.repeats)}
    result["meta"]["load_average_at_end"] = os.getloadavg()
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    assert all(r["same_best_beam"] for r in result.get("rows", [])), "the arms disagree on a best beam"


if __name__ == "__main__":
    main()
