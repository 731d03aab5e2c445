"""The shared-prompt read three ways, interleaved in one process: the tiled C++ path (flash_rows.h), the
few-row C++ path of the same op (`set_flash_min_rows` moved past the rows), and PyTorch's fused CPU kernel
(`backends.chunk_attention`, the torch path). One KV head's rows are a decode group's beams x grouped heads
against a run of float32 slots, as a wide step reads its prompt in every layer.

    python benchmarks/prompt_attention_ab.py                       # the grid below
    python benchmarks/prompt_attention_ab.py --rows 768 --keys 2048 --kv-heads 3

Prints each point's best times (ms), GFLOP/s (4 x rows x keys x head_dim x KV heads) and the ratios to
PyTorch's kernel; writes benchmarks/results/prompt_attention_ab.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from interleaved import best_times

from widebeam.model import kernels
from widebeam.model.attention.backends import chunk_attention

ROOT = Path(__file__).resolve().parent.parent
NEVER = 2**62


def point(rows: int, keys: int, kv_heads: int, head_dim: int, repeats: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(keys + 64, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(keys + 64, kv_heads, head_dim, generator=gen)
    q_rows = torch.randn(kv_heads, rows, head_dim, generator=gen) * head_dim**-0.5
    start, end = 32, 32 + keys

    def kernel(min_rows: int):
        def run():  # min_rows 1 and any work: tiled; NEVER: the few-row path
            saved = torch.ops.widebeam.set_flash_min_rows(min_rows, 0)
            try:
                return torch.ops.widebeam.dense_attention(q_rows, k_cache, v_cache, start, end, None)
            finally:
                torch.ops.widebeam.set_flash_min_rows(saved, kernels.FLASH_MIN_WORK)
        return run

    runs = {"tiled": kernel(1), "few-row": kernel(NEVER),
            "torch fused": lambda: chunk_attention(q_rows, k_cache[start:end], v_cache[start:end])}
    best, results = best_times(runs, repeats)
    reference = results["torch fused"][0]
    for name in ("tiled", "few-row"):  # the same answer every way
        torch.testing.assert_close(results[name][0], reference, atol=1e-4, rtol=1e-4)
    flops = 4 * rows * keys * head_dim * kv_heads
    return {"rows": rows, "keys": keys, "kv_heads": kv_heads, "head_dim": head_dim,
            "ms": {name: 1e3 * s for name, s in best.items()},
            "gflops": {name: flops / s / 1e9 for name, s in best.items()},
            "x_torch": {name: s / best["torch fused"] for name, s in best.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[3, 12, 48, 96, 192, 768, 3072])
    parser.add_argument("--keys", type=int, nargs="+", default=[300, 2048])
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64, choices=sorted(kernels.FLASH_HEAD_DIMS))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/prompt_attention_ab.json")
    args = parser.parse_args()
    if not kernels.available():
        raise SystemExit("the C++ kernels are not built: make setup")
    torch.set_num_threads(args.threads)
    points = []
    for keys in args.keys:
        for rows in args.rows:
            p = point(rows, keys, args.kv_heads, args.head_dim, args.repeats)
            points.append(p)
            print(f"rows {rows:5d} keys {keys:5d}: " + ", ".join(
                f"{name} {p['ms'][name]:.3f} ms ({p['gflops'][name]:.0f} GFLOP/s, {p['x_torch'][name]:.2f}x)"
                for name in p["ms"]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"threads": args.threads, "points": points}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
