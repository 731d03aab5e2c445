"""A/B in one process: the few-row linears (`few_rows_linear`) of this tree against a git revision's.

    python benchmarks/few_rows_revision_ab.py --base 712ad95 [--rows 1 2 4] [--points 1x320x24 4x320x24]

The base revision's `widebeam/model/kernels/few_rows.cpp` is compiled on the spot under another op
namespace (benchmarks/base_kernel.py). Two measures, each interleaved (benchmarks/interleaved.py):
- linears: one pass over every split linear of the default model (SmolLM2-135M, float32, its real weights,
  lm_head included) at each of `--rows`, each op in turn; GB/s over the weights' bytes;
- generate: whole beam searches at each `--points` WxPxN (the bench prompt, min_new_tokens = N, the
  prefix cache off), the split linears calling one op or the other; the best sequences must be equal.
Reports base/this per point (> 1: this tree is faster); writes benchmarks/results/few_rows_revision_ab.json.
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="git revision whose few_rows.cpp is the A side")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--points", nargs="*", default=["1x320x24", "4x320x24"], help="WxPxN")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/few_rows_revision_ab.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from widebeam.bench import make_prompt
    from widebeam.llm import LLM
    from widebeam.model import kernels
    from widebeam.model.linears.split import SplitLinear
    from widebeam.params import BeamSearchParams

    if not kernels.linear_enabled():
        sys.exit("the few-row kernel is not built here: run `make setup`")
    with tempfile.TemporaryDirectory() as scratch:
        load_base_kernel(args.base, "few_rows.cpp", Path(scratch))
    ops = {"base": torch.ops.widebeam_base.few_rows_linear, "this": torch.ops.widebeam.few_rows_linear}
    llm = LLM(dtype="float32", device="cpu", kv_cache_memory="1GiB", enable_prefix_caching=False,
              max_beam_width=max([int(p.split("x")[0]) for p in args.points] or [1]))
    layers = [m for m in llm.engine.model.modules() if isinstance(m, SplitLinear) and m.can_split()]
    weight_bytes = sum(m.weight.numel() * m.weight.element_size() for m in layers)
    result = {"command": "python benchmarks/few_rows_revision_ab.py " + shlex.join(sys.argv[1:]),
              "base": args.base, "threads": args.threads, "layers": len(layers), "weight_bytes": weight_bytes,
              "cpu_capability": kernels.cpu_capability(), "linears": [], "generate": []}
    with torch.inference_mode():
        for rows in args.rows:
            inputs = {n: torch.randn(rows, n) for n in {m.in_features for m in layers}}

            def one_pass(op, inputs=inputs):
                return lambda: [op(inputs[m.in_features], m.weight, m.bias) for m in layers]

            best, out = best_times({name: one_pass(op) for name, op in ops.items()}, args.repeats)
            worst_diff = max((a - b).abs().max().item() for a, b in zip(out["base"], out["this"]))
            point = {"rows": rows, **{f"{k}_ms": 1e3 * v for k, v in best.items()},
                     **{f"{k}_gb_s": weight_bytes / v / 1e9 for k, v in best.items()},
                     "base_over_this": best["base"] / best["this"], "max_abs_difference": worst_diff}
            result["linears"].append(point)
            print(json.dumps(point), flush=True)

    real_op = SplitLinear.split_product

    def with_op(op, prompt, params):
        def split_product(self, rows):  # the kernel branch of SplitLinear.split_product, the op chosen
            return op(rows if rows.stride(-1) == 1 else rows.contiguous(), self.weight, self.bias)

        def go():
            SplitLinear.split_product = split_product
            try:
                return llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
            finally:
                SplitLinear.split_product = real_op
        return go

    for spec in args.points:
        width, prompt_len, new_tokens = map(int, spec.split("x"))
        prompt = make_prompt(llm.tokenizer, prompt_len, llm.engine.model.arch.vocab_size)
        params = BeamSearchParams(beam_width=width, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
        best, out = best_times({name: with_op(op, prompt, params) for name, op in ops.items()}, args.repeats)
        same = out["base"].outputs[0].token_ids == out["this"].outputs[0].token_ids
        point = {"beam_width": width, "prompt_len": prompt_len, "max_new_tokens": new_tokens,
                 **{f"{k}_s": v for k, v in best.items()}, "base_over_this": best["base"] / best["this"],
                 "same_best_sequence": same}
        result["generate"].append(point)
        print(json.dumps(point), flush=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
