"""Throughput of concurrent beam requests vs the same requests one at a time, in one run.

    python benchmarks/concurrent_beams.py --requests 16 --beam-width 8 --max-new-tokens 32

Writes benchmarks/results/concurrent_beams.json. Figures: wall time and generated beam-tokens/s
(beam-tokens = live beams x decode steps, summed over requests) for both orders, on the same engine.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from widebeam.llm import LLM
from widebeam.params import BeamSearchParams

TOPICS = ["the sea", "a robot", "winter", "a library", "coffee", "the moon", "a garden", "trains",
          "mountains", "a city at night", "music", "rain", "a lighthouse", "bread", "a cat", "the desert"]


def beam_tokens(outputs, beam_width: int) -> int:
    # every decode step advances `beam_width` live beams; the longest hypothesis bounds the steps
    return sum(beam_width * max(len(c.token_ids) for c in out.outputs) for out in outputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--beam-width", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/concurrent_beams.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    llm = LLM(dtype=args.dtype, kv_cache_memory="1GiB", max_beam_width=args.beam_width,
              enable_prefix_caching=False)  # every run computes its prompts
    prompts = [llm.engine.apply_chat_template(f"Write one sentence about {TOPICS[i % len(TOPICS)]}.")
               for i in range(args.requests)]
    params = BeamSearchParams(beam_width=args.beam_width, max_new_tokens=args.max_new_tokens, ignore_eos=True)
    llm.generate(prompts[:1], params, use_tqdm=False)  # warm-up

    start = time.perf_counter()
    together = llm.generate(prompts, params, use_tqdm=False)
    concurrent_s = time.perf_counter() - start
    start = time.perf_counter()
    alone = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    sequential_s = time.perf_counter() - start

    same = all([c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
               for a, b in zip(together, alone))
    tokens = beam_tokens(together, args.beam_width)
    result = {
        "model": "smollm2-135m-instruct", "dtype": args.dtype, "threads": args.threads,
        "device": str(llm.engine.device),
        "requests": args.requests, "beam_width": args.beam_width, "max_new_tokens": args.max_new_tokens,
        "beam_tokens": tokens,
        "concurrent_s": round(concurrent_s, 3), "sequential_s": round(sequential_s, 3),
        "concurrent_beam_tokens_per_s": round(tokens / concurrent_s, 1),
        "sequential_beam_tokens_per_s": round(tokens / sequential_s, 1),
        "speedup": round(sequential_s / concurrent_s, 2),
        "same_outputs": same,
        "torch": torch.__version__,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
