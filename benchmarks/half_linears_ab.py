"""A/B in one process: a 16-bit model's linears through the few-row kernel against `F.linear`.

    python benchmarks/half_linears_ab.py --dtype bfloat16 --widths 1 4 8 --prompt-len 128 --max-new-tokens 32

Two engines on the same weights: one loaded with the kernel switched off (its linears stay `nn.Linear`:
`F.linear`, the reference), one with it on (`SplitLinear`s running `few_rows_linear` at the row counts
the start-up probe keeps). They alternate every repeat (the order flips each time); each keeps its best
time after a warm-up. Beam search with `min_new_tokens = N`; the best beams must be equal. Writes
benchmarks/results/half_linears_ab.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from interleaved import best_times

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/half_linears_ab.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from widebeam.llm import LLM
    from widebeam.model import kernels
    from widebeam.params import BeamSearchParams

    if not kernels.available():
        raise SystemExit("the C++ kernels are not built: run `make setup`")
    engines = {}
    for name, enabled in (("f_linear", False), ("kernel", True)):
        kernels.LINEAR_ENABLED = enabled  # read when the model is loaded: which linears it swaps
        engines[name] = LLM(kv_cache_memory="1GiB", dtype=args.dtype, enable_prefix_caching=False)
    kernels.LINEAR_ENABLED = True  # the kernel engine's SplitLinears ask at every call
    split_rows = list(engines["kernel"].engine.model.lm_head.split_rows)
    prompt = {"prompt_token_ids": [(i * 7919) % 40000 + 100 for i in range(args.prompt_len)]}
    rows = []
    for width in args.widths:
        params = BeamSearchParams(beam_width=width, max_new_tokens=args.max_new_tokens,
                                  min_new_tokens=args.max_new_tokens)
        runs = {name: (lambda llm=llm, params=params: llm.generate(prompt, params, use_tqdm=False))
                for name, llm in engines.items()}
        best, outputs = best_times(runs, args.repeats)
        beams = {name: out[0].outputs[0].token_ids for name, out in outputs.items()}
        row = {"beam_width": width, "f_linear_s": round(best["f_linear"], 3),
               "kernel_s": round(best["kernel"], 3),
               "kernel_over_f_linear": round(best["kernel"] / best["f_linear"], 3),
               "same_best_beam": beams["f_linear"] == beams["kernel"]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"dtype": args.dtype, "prompt_len": args.prompt_len,
                                    "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
                                    "threads": args.threads, "split_rows": split_rows, "rows": rows},
                                   indent=2) + "\n")


if __name__ == "__main__":
    main()
