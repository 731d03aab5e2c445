"""A/B in one process: the beam selection with this tree's `log_softmax_topk` against a git revision's.

    python benchmarks/selection_revision_ab.py --base 775aa57 --widths 256 1024

The base revision's `widebeam/model/kernels/row_top.cpp` is compiled on the spot under another op
namespace (`widebeam_base`, benchmarks/base_kernel.py). The logits are real: a beam search of the
default model at each width (P = `--prompt-len`, `--steps` decode steps) records every step's
`top_candidates` arguments. Then `top_candidates` runs over those steps with each op in turn, interleaved
(benchmarks/interleaved.py); the base op is called as the base revision's ranking called it (a deeper
row gathered first, its max and exps computed again). The candidates must be equal, bit for bit. Reports
milliseconds per step and the ratio; writes benchmarks/results/selection_revision_ab.json.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
from pathlib import Path

import torch
from base_kernel import load_base_kernel
from interleaved import best_times

ROOT = Path(__file__).resolve().parent.parent


def load_base_op(revision: str, into: Path):
    """The base revision's row_top.cpp compiled under the `widebeam_base` op namespace."""
    load_base_kernel(revision, "row_top.cpp", into)
    return torch.ops.widebeam_base.log_softmax_topk


def record_steps(width: int, prompt_len: int, steps: int) -> list[tuple]:
    """Every decode step's `top_candidates` arguments of one beam search at `width`."""
    from widebeam.beam import ranking, search
    from widebeam.llm import LLM
    from widebeam.params import BeamSearchParams

    llm = LLM(max_beam_width=width, kv_cache_memory="3GiB", device="cpu", enable_prefix_caching=False,
              max_num_batched_tokens=prompt_len)
    recorded = []

    def record(lp, running, num, eos, normalize=False):
        if lp.shape[0] == width:  # decode steps (the prefill's single row stands for all beams)
            recorded.append((lp.clone(), running.clone(), num, eos, normalize))
        return ranking.top_candidates(lp, running, num, eos, normalize)

    real = search.top_candidates
    search.top_candidates = record
    try:
        prompt = [(7 * i) % 1000 + 100 for i in range(prompt_len)]
        params = BeamSearchParams(beam_width=width, max_new_tokens=steps + 1, min_new_tokens=steps + 1)
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    finally:
        search.top_candidates = real
    return recorded


def main() -> None:
    from widebeam.beam import ranking

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="git revision whose row_top.cpp is the A side")
    parser.add_argument("--widths", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/selection_revision_ab.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from widebeam.model import kernels

    if not kernels.selection_enabled():
        sys.exit("the selection kernel is not built here: run `make setup`")
    with tempfile.TemporaryDirectory() as scratch:
        base_op = load_base_op(args.base, Path(scratch))

    def base_impl(x, k, rows=None, shifts=None):
        if rows is not None:
            x = x.index_select(0, rows)
        return (*base_op(x, k)[:2], None)

    this_impl = ranking._log_softmax_topk
    points = []
    for width in args.widths:
        steps = record_steps(width, args.prompt_len, args.steps)

        def run(impl, steps=steps):
            def go():
                ranking._log_softmax_topk = impl
                try:
                    return [ranking.top_candidates(*step) for step in steps]
                finally:
                    ranking._log_softmax_topk = this_impl
            return go

        best, results = best_times({"base": run(base_impl), "this": run(this_impl)}, args.repeats)
        same = all(torch.equal(a, b) for x, y in zip(results["base"], results["this"]) for a, b in zip(x, y))
        base_ms, this_ms = 1e3 * best["base"] / len(steps), 1e3 * best["this"] / len(steps)
        point = {"beam_width": width, "steps": len(steps), "base_ms_per_step": base_ms,
                 "this_ms_per_step": this_ms, "this_over_base": this_ms / base_ms, "same_candidates": same}
        points.append(point)
        print(f"W={width}: base {base_ms:.2f} ms/step, this {this_ms:.2f}, "
              f"this/base {this_ms / base_ms:.3f}, same candidates {same}", flush=True)
    args.out.write_text(json.dumps({
        "command": "python benchmarks/selection_revision_ab.py " + shlex.join(sys.argv[1:]),
        "base": args.base, "prompt_len": args.prompt_len, "repeats": args.repeats, "points": points},
        indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
