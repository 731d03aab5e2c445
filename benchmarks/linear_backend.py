"""A/B of the float32 linear backend (issue #19): `linear_backend="torch"` (F.linear, the reference)
against `"auto"` (the default: every linear's weight packed once for oneDNN and run at 4-128 rows,
F.linear at other row counts; or `--candidate onednn`, packed at every row count;
widebeam/model/packed_linear.py),
two engines over the same SmolLM2-135M weights in one process.

    python benchmarks/linear_backend.py [--widths 1 4 16 64] [--prompt-len 512] [--new-tokens 32] [--repeats 5]

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
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

from widebeam.bench import make_prompt, run_widebeam
from widebeam.engine import LLM

BACKENDS = ["torch", "auto"]  # the reference, then the candidate (--candidate)


def linears_only(llms: dict, repeats: int) -> list[dict]:
    """One pass over every linear layer of each model per sample, the backends alternating."""
    layers = {b: [m for m in llm.engine.model.modules() if hasattr(m, "in_features")] for b, llm in llms.items()}
    candidate = BACKENDS[1]
    rows_out = []
    with torch.inference_mode():
        for rows in (1, 2, 4, 16, 64, 128, 256, 512):
            inputs = {n: torch.randn(rows, n) for n in {m.in_features for m in layers["torch"]}}
            times = {b: [] for b in BACKENDS}
            ratios = []
            for i in range(repeats if rows < 512 else max(3, repeats // 10)):
                for b in (BACKENDS if i % 2 == 0 else BACKENDS[::-1]):
                    start = time.perf_counter()
                    for m in layers[b]:
                        m(inputs[m.in_features])
                    times[b].append(time.perf_counter() - start)
                ratios.append(times["torch"][-1] / times[candidate][-1])
            rows_out.append({"rows": rows, "layers": len(layers["torch"]), "pairs": len(ratios),
                             **{f"{b}_median_ms": round(statistics.median(times[b]) * 1e3, 2) for b in BACKENDS},
                             **{f"{b}_min_ms": round(min(times[b]) * 1e3, 2) for b in BACKENDS},
                             f"median_pair_ratio_torch_over_{candidate}": round(statistics.median(ratios), 3)})
            print(json.dumps(rows_out[-1]), flush=True)
    return rows_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2,
                        help="1 on a busy host: two threads on two shared cores stall at every barrier")
    parser.add_argument("--candidate", choices=["auto", "onednn"], default="auto",
                        help="the backend set against torch (default auto, the engine's default)")
    parser.add_argument("--linears-only", action="store_true", help="time the linear layers alone")
    parser.add_argument("--out", default="benchmarks/results/linear_backend.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    BACKENDS[1] = args.candidate
    llms = {b: LLM(args.model, dtype="float32", device="cpu", linear_backend=b, kv_cache_memory="512MiB",
                   max_beam_width=max(args.widths)) for b in BACKENDS}
    revision = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=False).stdout.strip()
    meta = {"revision": revision, "candidate": args.candidate, "threads": args.threads, "cpus": os.cpu_count(), "machine": platform.machine(),
            "torch": torch.__version__, "model": args.model, "dtype": "float32", "repeats": args.repeats}
    if args.linears_only:
        rows = linears_only(llms, args.repeats)
        meta["load_average_at_end"] = os.getloadavg()
        Path(args.out).write_text(json.dumps({"meta": meta, "linears_only": rows}, indent=2) + "\n")
        return
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
        reference, candidate = BACKENDS
        rows.append({"point": name, "beam_width": width, "prompt_len": len(prompt), "max_new_tokens": new_tokens,
                     **{f"{b}_median_s": round(medians[b], 3) for b in BACKENDS},
                     f"torch_over_{candidate}": round(medians[reference] / medians[candidate], 3),
                     "same_best_beam": best[name, reference] == best[name, candidate],
                     **{f"{b}_runs_s": [round(t, 3) for t in runs[name, b]] for b in BACKENDS}})
        print(json.dumps({k: v for k, v in rows[-1].items() if not k.endswith("runs_s")}), flush=True)
    meta["load_average_at_end"] = os.getloadavg()
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    assert all(r["same_best_beam"] for r in rows), "the backends disagree on a best beam"


if __name__ == "__main__":
    main()
