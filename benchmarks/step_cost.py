"""What one decode step costs against the rows it carries: the fixed part every step pays (the weights
read, the step's own work) and the part each row adds. This is what request priority trades on
(docs/scheduling-and-capacity.md, "Priority results"): a step run for an urgent request alone pays the
fixed part and buys the others nothing.

    python benchmarks/step_cost.py [--dtype bfloat16] [--widths 1 4 8 16 32 64 128 256]

Beam search at each width over one prompt (prefix cache off), `min_new_tokens` = N so every beam runs;
a step's time is the difference of two lengths (10 and 2 new tokens) over 8, which cancels the prefill.
Best of 3 after a warm-up. Prints and writes each width's step time, and a least-squares line
(fixed ms + ms per row) over the widths up to 128.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def best_s(run, repeats: int) -> float:
    run()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64, 128, 256])
    parser.add_argument("--prompt-len", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/step_cost.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from widebeam.heap import freeze_startup_heap
    from widebeam.llm import LLM
    from widebeam.params import BeamSearchParams

    llm = LLM(model=args.model, dtype=args.dtype, kv_cache_memory="1GiB", enable_prefix_caching=False,
              max_beam_width=max(args.widths))
    freeze_startup_heap()
    prompt = {"prompt_token_ids": [(i * 7919) % 40000 + 100 for i in range(args.prompt_len)]}
    rows = []
    for width in args.widths:
        times = {}
        for num_tokens in (2, 10):
            params = BeamSearchParams(beam_width=width, max_new_tokens=num_tokens, min_new_tokens=num_tokens)
            times[num_tokens] = best_s(lambda p=params: llm.generate(prompt, p, use_tqdm=False), args.repeats)
        step_ms = (times[10] - times[2]) / 8 * 1000
        rows.append({"beam_width": width, "step_ms": round(step_ms, 2),
                     "ms_per_row": round(step_ms / width, 3)})
        print(json.dumps(rows[-1]), flush=True)
    fit = [r for r in rows if r["beam_width"] <= 128]
    n = len(fit)
    mean_w = sum(r["beam_width"] for r in fit) / n
    mean_t = sum(r["step_ms"] for r in fit) / n
    slope = (sum((r["beam_width"] - mean_w) * (r["step_ms"] - mean_t) for r in fit)
             / sum((r["beam_width"] - mean_w) ** 2 for r in fit))
    line = {"fixed_ms": round(mean_t - slope * mean_w, 2), "ms_per_row": round(slope, 3)}
    print(json.dumps({"fit_up_to_128_rows": line}))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"command": "python benchmarks/step_cost.py", "settings": {
        k: v for k, v in vars(args).items() if k != "out"}, "rows": rows, "fit_up_to_128_rows": line},
        indent=2) + "\n")


if __name__ == "__main__":
    main()
