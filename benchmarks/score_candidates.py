"""Scoring many candidates of one prompt: `LLM.score` against transformers scoring each candidate with its
own forward pass (the log-softmax of prompt + candidate), the generative-retrieval shape of issue #32.

A random Llama-shaped model is built here (no hub access); 1,000 three-token candidates (distinct, random
first tokens from a small alphabet, so some share prefixes) follow one 1,024-token prompt. widebeam
prefills the prompt once and forks one row per distinct prefix (the forward passes' tokens are counted
and must be 1,024 + the distinct prefixes); transformers runs prompt + candidate for each candidate. On a
shared CPU the transformers side is timed on `--hf-candidates` of them and extrapolated to all (its
cost is the same for every candidate: one pass of 1,027 tokens); the values of those candidates are
compared with widebeam's (max |difference| reported, 1e-4 expected).

    python benchmarks/score_candidates.py [--hf-candidates 20] \
        [--out benchmarks/results/score_candidates.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

MODEL = {"vocab_size": 8192, "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--candidates", type=int, default=1000)
    parser.add_argument("--candidate-tokens", type=int, default=3)
    parser.add_argument("--hf-candidates", type=int, default=20,
                        help="candidates transformers scores (timed)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from tiny_models import save_tiny_model
    from transformers import AutoModelForCausalLM

    from widebeam.llm import LLM

    rng = random.Random(0)
    prompt = [rng.randrange(3, MODEL["vocab_size"]) for _ in range(args.prompt_tokens)]
    seen: set[tuple[int, ...]] = set()
    while len(seen) < args.candidates:
        seen.add((rng.randrange(3, 200),) + tuple(rng.randrange(3, MODEL["vocab_size"])
                                                  for _ in range(args.candidate_tokens - 1)))
    candidates = [list(c) for c in sorted(seen, key=lambda c: rng.random())]

    with tempfile.TemporaryDirectory() as tmp:
        save_tiny_model(tmp, "llama", **MODEL)
        llm = LLM(tmp, dtype="float32", device="cpu", kv_cache_memory="256MiB", tokens_per_block=16,
                  max_beam_width=args.candidates, max_num_batched_tokens=2048,
                  max_seq_len=args.prompt_tokens + 64)
        llm.score({"prompt_token_ids": prompt[:32]}, candidates[:4])  # warm-up
        llm.engine.reset_prefix_cache()
        counts: list[int] = []
        schedule = llm.engine.scheduler.schedule

        def counted():
            out = schedule()
            counts.append(out.num_batched_tokens)
            return out

        llm.engine.scheduler.schedule = counted
        start = time.perf_counter()
        scores = llm.score({"prompt_token_ids": prompt}, candidates)
        widebeam_s = time.perf_counter() - start
        distinct = {tuple(c[:d]) for c in candidates for d in range(1, len(c))}
        assert sum(counts) == len(prompt) + len(distinct), (sum(counts), len(prompt), len(distinct))

        hf = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
        max_diff = 0.0
        start = time.perf_counter()
        with torch.no_grad():
            for c, score in zip(candidates[:args.hf_candidates], scores):
                logits = hf(torch.tensor([prompt + c])).logits[0, len(prompt) - 1:len(prompt) - 1 + len(c)]
                expected = torch.log_softmax(logits.float(), -1)[torch.arange(len(c)), c].tolist()
                max_diff = max(max_diff, *(abs(a - b) for a, b in zip(score.token_logprobs, expected)))
        hf_per_candidate_s = (time.perf_counter() - start) / args.hf_candidates

    hf_s = hf_per_candidate_s * args.candidates
    result = {
        "prompt_tokens": args.prompt_tokens, "candidates": args.candidates,
        "candidate_tokens": args.candidate_tokens, "model": MODEL, "threads": args.threads,
        "widebeam_s": round(widebeam_s, 3), "widebeam_forward_tokens": sum(counts),
        "widebeam_forward_passes": len(counts), "distinct_fed_prefixes": len(distinct),
        "hf_candidates_timed": args.hf_candidates, "hf_per_candidate_s": round(hf_per_candidate_s, 4),
        "hf_extrapolated_s": round(hf_s, 2), "speedup": round(hf_s / widebeam_s, 1),
        "max_abs_logprob_difference": max_diff, "load_average": os.getloadavg(),
    }
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
