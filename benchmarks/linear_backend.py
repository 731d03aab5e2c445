"""A/B of the float32 linear backend (issue #19): `linear_backend="torch"` (F.linear, the reference)
against `--candidate`: "split" (the default backend: 1-4 rows as batched blocks of output rows on
every thread; widebeam/model/linears/split.py), "auto" (every linear's weight also packed once for
oneDNN and run at 4-128 rows) or "onednn" (packed at every row count; widebeam/model/linears/packed.py),
two engines over the same SmolLM2-135M weights in one process.

    python benchmarks/linear_backend.py [--widths 1 4 16 64] [--prompt-len 512] [--new-tokens 32]
        [--repeats 5]

The same prompt as `widebeam bench` (`bench.make_prompt`), min_new_tokens = N, float32, 2 threads.
Each repeat runs every point on both engines back to back, the order alternating between repeats;
a "prefill" point (W=1, N=1) times the 512-token prompt alone. Reports the median wall seconds of
each backend and the ratio torch/candidate (> 1: the candidate is faster), and asserts both engines return the
same best beam. Writes benchmarks/results/linear_backend.json (or `--out`).

`--linears-only`: the models' own 211 linear layers (lm_head included) alone, one pass over all of
them at 1 to 512 rows, the backends alternating pass by pass (`--repeats` pairs, median of the
pairs' ratios): the kernel's share without the rest of a step, less exposed to the host's load.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from ab_engines import ab_points, add_ab_arguments, linears_only, run_meta

from widebeam.llm import LLM

BACKENDS = ["torch", "split"]  # the reference, then the candidate (--candidate)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_ab_arguments(parser)
    parser.add_argument("--candidate", choices=["split", "auto", "onednn"], default="split",
                        help="the backend set against torch (default split, the engine's default)")
    parser.add_argument("--out", default="benchmarks/results/linear_backend.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    BACKENDS[1] = args.candidate
    llms = {b: LLM(args.model, dtype="float32", device="cpu", linear_backend=b, kv_cache_memory="512MiB",
                   max_beam_width=max(args.widths)) for b in BACKENDS}
    meta = run_meta(candidate=args.candidate, model=args.model, dtype="float32", repeats=args.repeats)
    if args.linears_only:
        rows = linears_only(llms, args.repeats)
        meta["load_average_at_end"] = os.getloadavg()
        Path(args.out).write_text(json.dumps({"meta": meta, "linears_only": rows}, indent=2) + "\n")
        return
    rows = ab_points(llms, args.widths, args.prompt_len, args.new_tokens, args.repeats)
    meta["load_average_at_end"] = os.getloadavg()
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    assert all(r["same_best_beam"] for r in rows), "the backends disagree on a best beam"


if __name__ == "__main__":
    main()
