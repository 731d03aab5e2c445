"""A/B of the int8 linear kernel (issue #19): "int_mm" (`torch._int_mm`, the reference) against
"fbgemm" (the default where it is exact: FBGEMM's linear with the weight prepacked once;
widebeam/model/int8_linear.py), two `dtype="int8"` engines over the same SmolLM2-135M weights in
one process. Both compute the same int32 products and scales, bit for bit, so the best beams must
agree.

    python benchmarks/int8_kernels.py [--widths 1 4 16 64] [--repeats 5] [--threads 2]
    python benchmarks/int8_kernels.py --linears-only --repeats 30

The same prompt as `widebeam bench` (P=512), N=32, min_new_tokens = N. Reports the median wall
seconds of each kernel and the ratio int_mm/fbgemm (> 1: fbgemm is faster). Writes
benchmarks/results/int8_kernels.json (or `--out`).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from unittest import mock

import torch
from ab_engines import ab_points, linears_only, run_meta

from widebeam.engine import LLM

KERNELS = ("int_mm", "fbgemm")  # the reference, then the candidate


def load(model: str, kernel: str, max_beam_width: int) -> LLM:
    # the engine picks fbgemm wherever it is exact; the reference arm is the fallback it would take
    with mock.patch("widebeam.model.int8_linear.fbgemm_exact", return_value=kernel == "fbgemm"):
        llm = LLM(model, dtype="int8", device="cpu", kv_cache_memory="512MiB", max_beam_width=max_beam_width)
    assert llm.engine.model.lm_head.kernel == kernel, "the int8 kernel was not the one asked for"
    return llm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--linears-only", action="store_true", help="time the linear layers alone")
    parser.add_argument("--out", default="benchmarks/results/int8_kernels.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    llms = {k: load(args.model, k, max(args.widths)) for k in KERNELS}
    meta = run_meta(model=args.model, dtype="int8", repeats=args.repeats)
    if args.linears_only:
        result = {"meta": meta, "linears_only": linears_only(llms, args.repeats)}
    else:
        result = {"meta": meta, "rows": ab_points(llms, args.widths, args.prompt_len, args.new_tokens, args.repeats)}
    result["meta"]["load_average_at_end"] = os.getloadavg()
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    assert all(r["same_best_beam"] for r in result.get("rows", [])), "the kernels disagree on a best beam"


if __name__ == "__main__":
    main()
