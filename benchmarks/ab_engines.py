"""The A/B loop two kernel benchmarks share (linear_backend.py, int8_kernels.py): two engines over
the same weights in one process, every point run on both back to back, the order alternating
between repeats, medians and the reference/candidate ratio reported, the best beams compared.

`linears_only`: the models' own linear layers alone, one pass over all of them per sample at 1 to
512 rows, the arms alternating pass by pass: the kernel's share without the rest of a step, less
exposed to the host's load.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import time

import torch

from widebeam.bench import make_prompt, run_widebeam


def add_ab_arguments(parser) -> None:
    """The options every A/B script takes: the model, the points, the repeats, the threads."""
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2,
                        help="1 on a busy host: two threads on two shared cores stall at every barrier")
    parser.add_argument("--linears-only", action="store_true", help="time the linear layers alone")


def run_meta(**extra) -> dict:
    revision = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=False).stdout.strip()
    return {"revision": revision, "cpus": os.cpu_count(), "machine": platform.machine(),
            "torch": torch.__version__, "threads": torch.get_num_threads(), **extra}


def linears_only(llms: dict, repeats: int, row_counts=(1, 2, 4, 16, 64, 128, 256, 512)) -> list[dict]:
    """One pass over every linear layer of each model per sample, the arms alternating; `llms`:
    {arm: LLM}, the reference first."""
    arms = list(llms)
    reference, candidate = arms
    layers = {a: [m for m in llm.engine.model.modules() if hasattr(m, "in_features")]
              for a, llm in llms.items()}
    rows_out = []
    with torch.inference_mode():
        for rows in row_counts:
            inputs = {n: torch.randn(rows, n) for n in {m.in_features for m in layers[reference]}}
            times = {a: [] for a in arms}
            ratios = []
            for i in range(repeats if rows < 512 else max(3, repeats // 10)):
                for a in (arms if i % 2 == 0 else arms[::-1]):
                    start = time.perf_counter()
                    for m in layers[a]:
                        m(inputs[m.in_features])
                    times[a].append(time.perf_counter() - start)
                ratios.append(times[reference][-1] / times[candidate][-1])
            rows_out.append({"rows": rows, "layers": len(layers[reference]), "pairs": len(ratios),
                             **{f"{a}_median_ms": round(statistics.median(times[a]) * 1e3, 2) for a in arms},
                             **{f"{a}_min_ms": round(min(times[a]) * 1e3, 2) for a in arms},
                             f"median_pair_ratio_{reference}_over_{candidate}":
                             round(statistics.median(ratios), 3)})
            print(json.dumps(rows_out[-1]), flush=True)
    return rows_out


def ab_points(llms: dict, widths: list[int], prompt_len: int, new_tokens: int, repeats: int) -> list[dict]:
    """A "prefill" point (W=1, N=1: the prompt alone) and one point per width; `llms`: {arm: LLM},
    the reference first. Asserts each arm returns the same best beam at every repeat."""
    arms = list(llms)
    reference, candidate = arms
    some = llms[reference]
    prompt = make_prompt(some.tokenizer, prompt_len, some.engine.model.arch.vocab_size)
    for llm in llms.values():  # warm-up: kernels build their primitives on first use of each shape
        run_widebeam(llm, prompt[:64], 4, 4)
        run_widebeam(llm, prompt, 1, 2)
    points = [("prefill", 1, 1)] + [(f"W={w}", w, new_tokens) for w in widths]
    runs = {(name, a): [] for name, _, _ in points for a in arms}
    best = {}
    for repeat in range(repeats):
        order = arms if repeat % 2 == 0 else arms[::-1]
        for name, width, n in points:
            for a in order:
                result = run_widebeam(llms[a], prompt, width, n)
                runs[name, a].append(result["wall_s"])
                best.setdefault((name, a), result["best"])
                assert result["best"] == best[name, a], f"{name} {a}: the best beam changed between repeats"
            print(json.dumps({"repeat": repeat, "point": name,
                              **{a: round(runs[name, a][-1], 3) for a in arms}}),
                  flush=True)
    rows = []
    for name, width, n in points:
        medians = {a: statistics.median(runs[name, a]) for a in arms}
        rows.append({"point": name, "beam_width": width, "prompt_len": len(prompt), "max_new_tokens": n,
                     **{f"{a}_median_s": round(medians[a], 3) for a in arms},
                     f"{reference}_over_{candidate}": round(medians[reference] / medians[candidate], 3),
                     "same_best_beam": best[name, reference] == best[name, candidate],
                     **{f"{a}_runs_s": [round(t, 3) for t in runs[name, a]] for a in arms}})
        print(json.dumps({k: v for k, v in rows[-1].items() if not k.endswith("runs_s")}), flush=True)
    return rows
