"""One wide beam search on the default model: time, peak KV blocks held vs required, and what a
per-beam-copy cache (transformers) would need for the same request.

    python benchmarks/wide_beam.py --beam-width 256 --prompt-len 2048 --max-new-tokens 32
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from widebeam.llm import LLM
from widebeam.params import BeamSearchParams
from widebeam.units import format_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--beam-width", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-cache-memory", default="2GiB")
    parser.add_argument("--out", default="benchmarks/results/wide_beam.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    llm = LLM(dtype=args.dtype, kv_cache_memory=args.kv_cache_memory, max_beam_width=args.beam_width,
              enable_prefix_caching=False)  # every run computes its prompt
    tokenizer = llm.tokenizer
    text = " ".join(f"Item {i} is a {'red' if i % 2 else 'blue'} box." for i in range(args.prompt_len))
    prompt_ids = tokenizer.encode(text)[: args.prompt_len]
    params = BeamSearchParams(beam_width=args.beam_width, max_new_tokens=args.max_new_tokens, ignore_eos=True)
    start = time.perf_counter()
    (out,) = llm.generate([{"prompt_token_ids": prompt_ids}], params, use_tqdm=False)
    elapsed_s = time.perf_counter() - start

    spec = llm.engine.cache["self"].spec
    t = llm.engine.cache.tokens_per_block
    bytes_per_block = spec.bytes_per_block(t)
    naive_tokens = args.beam_width * (args.prompt_len + args.max_new_tokens)
    result = {
        "model": "smollm2-135m-instruct", "dtype": args.dtype, "threads": args.threads,
        "beam_width": args.beam_width, "prompt_len": len(prompt_ids), "max_new_tokens": args.max_new_tokens,
        "wall_s": round(elapsed_s, 2),
        "beam_tokens_per_s": round(args.beam_width * args.max_new_tokens / elapsed_s, 1),
        "peak_blocks": out.peak_blocks["self"], "required_blocks": out.required_blocks["self"],
        "peak_kv_bytes": out.peak_blocks["self"] * bytes_per_block,
        "naive_kv_tokens": naive_tokens, "naive_kv_bytes": naive_tokens * spec.bytes_per_token,
        "best": out.outputs[0].text[:80], "best_score": out.outputs[0].score,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    print(f"peak KV {format_bytes(result['peak_kv_bytes'])} vs per-beam copies "
          f"{format_bytes(result['naive_kv_bytes'])}")


if __name__ == "__main__":
    main()
