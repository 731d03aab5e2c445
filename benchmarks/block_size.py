"""Peak KV held by one wide beam search at several block sizes (`tokens_per_block` T): smaller blocks
share more of the beams' common history. widebeam alone (transformers' KV is W x (P + N) tokens
whatever T: 1,530 MiB at W=64, P=512, N=32 for SmolLM2-135M float32, from `widebeam bench`).

    python benchmarks/block_size.py [--widths 64] [--prompt-len 512] [--blocks 16 8 4] [--repeats 2]

The same prompt as `widebeam bench` (`bench.make_prompt`), N = 32 with min_new_tokens = N, float32,
`kv_cache_memory` 2 GiB; best wall time of `--repeats` runs, alternating the block sizes. Writes
benchmarks/results/block_size.json (or `--out`). The KV figures are exact and repeatable; the times
move with the host's load.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
from pathlib import Path

import torch

from widebeam.bench import make_prompt, run_widebeam
from widebeam.llm import LLM

MIB = 1 << 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[64])
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--blocks", type=int, nargs="+", default=[16, 8, 4])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/block_size.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    llms = {t: LLM(tokens_per_block=t, kv_cache_memory="2GiB", dtype="float32",
                   max_beam_width=max(args.widths))
            for t in args.blocks}
    some = next(iter(llms.values()))
    prompt = make_prompt(some.tokenizer, args.prompt_len, some.engine.model.arch.vocab_size)
    for llm in llms.values():  # warm-up
        run_widebeam(llm, prompt[:64], 2, 4)
    rows = []
    for width in args.widths:
        runs = {t: [] for t in args.blocks}
        for _ in range(args.repeats):
            for t, llm in llms.items():
                runs[t].append(run_widebeam(llm, prompt, width, args.new_tokens))
        best_beams = {t: r[0]["best"] for t, r in runs.items()}
        for t, results in runs.items():
            rows.append({"beam_width": width, "prompt_len": len(prompt), "max_new_tokens": args.new_tokens,
                         "tokens_per_block": t, "wall_s": min(r["wall_s"] for r in results),
                         "peak_kv_mib": round(results[0]["peak_kv_bytes"] / MIB, 1),
                         "same_best_beam_as_first_block_size": best_beams[t] == best_beams[args.blocks[0]]})
            print(json.dumps(rows[-1]))
    revision = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=False).stdout.strip()
    meta = {"revision": revision, "threads": args.threads, "cpus": os.cpu_count(),
            "machine": platform.machine(),
            "load_average": os.getloadavg(), "model": "smollm2-135m-instruct", "dtype": "float32"}
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
