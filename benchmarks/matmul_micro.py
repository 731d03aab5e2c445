"""CPU matmul micro-benchmarks behind three figures in the guides, on SmolLM2-135M's shapes (random weights:
the time of a dense product does not depend on the values, denormals aside, which randn avoids).

- `mlp_pair_1row`: one row through a 576x1536 MLP pair (x @ up^T, then @ down^T), float32 against
  bfloat16, microseconds (the bfloat16 self-draft's cost, docs/speculative-decoding.md).
- `gemv_bandwidth`: `F.linear` at 1-4 rows as GB/s of weight read, at 1 and 2 threads, over the 30
  decoder layers' 210 distinct linears (425 MB, a decode step's weights, far beyond the caches) and
  the lm_head's weight (49152 x 576, 113 MB) at 1 row, against a 2-thread `torch.sum` of the
  lm_head's weight (what the memory delivers to both cores) (docs/benchmarks.md, "Float32 linears").
- `rows_scaling`: one decoder layer's seven float32 linears at 1, 4, 9, 16, 72 rows, each time as a
  multiple of the 1-row time, 2 threads (a verify pass
  of W x (1 + drafted) rows, docs/speculative-decoding.md).

Every figure is the median of `--repeats` timed runs after a warm-up. The host's load average is
stored with them: other processes on a 2-core host slow these down.

    python benchmarks/matmul_micro.py [--repeats 200] [--out benchmarks/results/matmul_micro.json]
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
import torch.nn.functional as F

HIDDEN, INTERMEDIATE, VOCAB, KV = 576, 1536, 49152, 192  # SmolLM2-135M: 9 heads, 3 KV heads of 64


def median_s(fn, repeats: int) -> float:
    for _ in range(max(3, repeats // 10)):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def mlp_pair_1row(repeats: int) -> dict:
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        up = torch.randn(INTERMEDIATE, HIDDEN, dtype=dtype)
        down = torch.randn(HIDDEN, INTERMEDIATE, dtype=dtype)
        x = torch.randn(1, HIDDEN, dtype=dtype)
        with torch.inference_mode():
            seconds = median_s(lambda x=x, up=up, down=down: F.linear(F.linear(x, up), down), repeats)
        out[f"{str(dtype).removeprefix('torch.')}_us"] = round(seconds * 1e6, 1)
    out["bfloat16_over_float32"] = round(out["bfloat16_us"] / out["float32_us"], 3)
    return out


LAYER_SHAPES = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN), (INTERMEDIATE, HIDDEN),
                (INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]  # q, k, v, o, gate, up, down
NUM_LAYERS = 30


def gemv_bandwidth(repeats: int) -> dict:
    """GB/s of float32 weight read by `F.linear` at a decode step's 1-4 rows, at 1 and 2 threads:
    one pass over the 30 decoder layers' 210 distinct linears (425 MB, a decode step's weights), and
    the lm_head's weight alone at 1 row; against a 2-thread `torch.sum` over the lm_head's weight."""
    head = torch.randn(VOCAB, HIDDEN)
    stack = [torch.randn(*shape) for _ in range(NUM_LAYERS) for shape in LAYER_SHAPES]
    head_bytes = head.numel() * head.element_size()
    stack_bytes = sum(w.numel() * w.element_size() for w in stack)
    out = {"lm_head_bytes": head_bytes, "decoder_linears_bytes": stack_bytes,
           "decoder_linears_gb_s": {}, "lm_head_1row_gb_s": {}}
    with torch.inference_mode():
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for rows in (1, 2, 3, 4):
                x = {n: torch.randn(rows, n) for n in (HIDDEN, INTERMEDIATE)}

                def stack_pass(x=x):
                    for w in stack:
                        F.linear(x[w.shape[1]], w)

                out["decoder_linears_gb_s"][f"rows{rows}_threads{threads}"] = round(
                    stack_bytes / median_s(stack_pass, max(15, repeats // 10)) / 1e9, 2)
            x1 = torch.randn(1, HIDDEN)
            out["lm_head_1row_gb_s"][f"threads{threads}"] = round(
                head_bytes / median_s(lambda x1=x1: F.linear(x1, head), repeats) / 1e9, 2)
        torch.set_num_threads(2)
        out["sum_threads2_gb_s"] = round(head_bytes / median_s(lambda: head.sum(), repeats) / 1e9, 2)
    return out


def rows_scaling(repeats: int, row_counts=(1, 4, 9, 16, 72)) -> dict:
    weights = [torch.randn(*shape) for shape in LAYER_SHAPES]
    torch.set_num_threads(2)
    out = {}
    with torch.inference_mode():
        for rows in row_counts:
            inputs = {n: torch.randn(rows, n) for n in {w.shape[1] for w in weights}}

            def layer(inputs=inputs):
                for w in weights:
                    F.linear(inputs[w.shape[1]], w)

            out[rows] = median_s(layer, repeats)
    return {"threads": 2, "layer_us": {str(r): round(s * 1e6, 1) for r, s in out.items()},
            "x_one_row": {str(r): round(s / out[1], 2) for r, s in out.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--out", default="benchmarks/results/matmul_micro.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(2)
    revision = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=False).stdout.strip()
    result = {"meta": {"revision": revision, "torch": torch.__version__, "cpus": os.cpu_count(),
                       "machine": platform.machine(), "repeats": args.repeats,
                       "load_average_at_start": list(os.getloadavg())},
              "mlp_pair_1row": mlp_pair_1row(args.repeats),
              "gemv_bandwidth": gemv_bandwidth(args.repeats),
              "rows_scaling": rows_scaling(args.repeats)}
    result["meta"]["load_average_at_end"] = list(os.getloadavg())
    print(json.dumps(result, indent=2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
