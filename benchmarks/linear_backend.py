"""A/B of the float32 linear backend (issue #19): `linear_backend="torch"` (F.linear, the reference)
against `"onednn"` (every linear's weight packed once for oneDNN, widebeam/model/packed_linear.py),
two engines over the same SmolLM2-135M weights in one process.

    python benchmarks/linear_backend.py [--widths 1 4 16 64] [--prompt-len 512] [--new-tokens 32] [--repeats 5]

The same prompt as `widebeam bench` (`bench.make_prompt`), min_new_tokens = N, float32, 2 threads.
Each repeat runs every point on both engines back to back, the order alternating between repeats;
a "prefill" point (W=1, N=1) times the 512-token prompt alone. Reports the median wall seconds of
each backend and the ratio torch/onednn (> 1: oneDNN faster), and asserts both engines return the
same best beam. Writes benchmarks/results/linear_backend.json (or `--out`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
from pathlib import Path

import torch

from widebeam.bench import make_prompt, run_widebeam
from widebeam.engine import LLM

BACKENDS = ("torch", "onednn")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2,
                        help="1 on a busy host: two threads on two shared cores stall at every barrier")
    parser.add_argument("--out", default="benchmarks/results/linear_backend.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    llms = {b: LLM(args.model, dtype="float32", device="cpu", linear_backend=b, kv_cache_memory="512MiB",
                   max_beam_width=max(args.widths)) for b in BACKENDS}
    some = llms["torch"]
    prompt = make_prompt(some.tokenizer, args.prompt_len, some.engine.model.arch.vocab_size)
    for llm in llms.values():  # warm-up: oneDNN builds its primitives on first use of each shape
        run_widebeam(llm, prompt[:64], 4, 4)
        run_widebeam(llm, prompt, 1, 2)
    points = [("prefill", 1, 1)] + [(f"W={w}", w, args.new_tokens) for w in args.widths]
    runs = {(name, b): [] for name, _, _ in points for b in BACKENDS}
    best = {}
    for repeat in range(args.repeats):
        order = BACKENDS if repeat % 2 == 0 else BACKENDS[::-1]
        for name, width, new_tokens in points:
            for b in order:
                result = run_widebeam(llms[b], prompt, width, new_tokens)
                runs[name, b].append(result["wall_s"])
                best.setdefault((name, b), result["best"])
                assert result["best"] == best[name, b], f"{name} {b}: the best beam changed between repeats"
            print(json.dumps({"repeat": repeat, "point": name,
                              **{b: round(runs[name, b][-1], 3) for b in BACKENDS}}), flush=True)
    rows = []
    for name, width, new_tokens in points:
        medians = {b: statistics.median(runs[name, b]) for b in BACKENDS}
        same = best[name, "torch"] == best[name, "onednn"]
        rows.append({"point": name, "beam_width": width, "prompt_len": len(prompt), "max_new_tokens": new_tokens,
                     "torch_median_s": round(medians["torch"], 3), "onednn_median_s": round(medians["onednn"], 3),
                     "torch_over_onednn": round(medians["torch"] / medians["onednn"], 3), "same_best_beam": same,
                     "torch_runs_s": [round(t, 3) for t in runs[name, "torch"]],
                     "onednn_runs_s": [round(t, 3) for t in runs[name, "onednn"]]})
        print(json.dumps({k: v for k, v in rows[-1].items() if not k.endswith("runs_s")}), flush=True)
    revision = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=False).stdout.strip()
    meta = {"revision": revision, "threads": args.threads, "cpus": os.cpu_count(), "machine": platform.machine(),
            "torch": torch.__version__, "load_average_at_end": os.getloadavg(), "model": args.model,
            "dtype": "float32", "repeats": args.repeats}
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    assert all(r["same_best_beam"] for r in rows), "the backends disagree on a best beam"


if __name__ == "__main__":
    main()
