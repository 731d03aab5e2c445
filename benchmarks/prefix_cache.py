"""Prefix reuse on the default model, in one process: many requests sharing a long system prompt,
with the prefix cache off, on, and with the system prompt pinned at start-up.

    python benchmarks/prefix_cache.py                  # 64 requests, 2,048 + 64 tokens, W in {1, 16}
    python benchmarks/prefix_cache.py --quick          # smoke run (a minute)

Every configuration has its own engine (same float32 weights, same KV memory), built once; the
widths run in turn, and for each the configurations run back to back on the same prompts:
- **batch**: all requests submitted at once, run to the end (the prefix cache emptied first, so
  the first request computes the system prompt and the rest may hit it; a pinned prefix stays);
  wall time, beam-tokens/s, mean time to first token, hit tokens;
- **TTFT of a hit**: then, --ttft-repeats times, one new request (a fresh user part) alone on the
  warm engine: its time to first token (the median is reported). Without the cache that request
  computes all P tokens; with it, only the user part.
Every configuration's best beam (and every returned beam) must equal no-cache's, request by
request; a mismatch is printed and recorded, never hidden.

Writes benchmarks/results/prefix_cache.json and prefix_cache.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from tables import machine_info, markdown_table, print_table

from widebeam.engine import LLM
from widebeam.memstats import rss_bytes
from widebeam.params import BeamSearchParams, SamplingParams

MODEL = "smollm2-135m-instruct"
RESULTS = Path(__file__).parent / "results"
TEXT = Path(__file__).parents[1] / "README.md"


def token_parts(tokenizer, system_tokens: int, user_tokens: int, count: int) -> tuple[list[int], list[list[int]]]:
    """A system prompt of exactly `system_tokens` tokens of real text, and `count` distinct user parts."""
    words = TEXT.read_text().split()
    ids = tokenizer.encode(" ".join(words), add_special_tokens=False)
    while len(ids) < system_tokens + count * user_tokens:
        ids = ids + ids
    system = ids[:system_tokens]
    users = [ids[system_tokens + i * user_tokens: system_tokens + (i + 1) * user_tokens] for i in range(count)]
    # a distinct first token per user part: no two requests share more than the system prompt
    return system, [[10_000 + i] + part[1:] for i, part in enumerate(users)]


def run_batch(llm: LLM, prompts: list[list[int]], params) -> dict:
    """All prompts at once: wall time, per-request time to first token, outputs, hits."""
    engine = llm.engine
    start = time.perf_counter()
    arrival, first, outputs = {}, {}, {}
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": ids}, params)
        arrival[f"r{i}"] = time.perf_counter()
    while engine.has_unfinished():
        for delta in engine.step():
            now = time.perf_counter()
            if delta.first_token:
                first[delta.request_id] = now - arrival[delta.request_id]
            if delta.finished:
                outputs[delta.request_id] = delta.output
    wall = time.perf_counter() - start
    ordered = [outputs[f"r{i}"] for i in range(len(prompts))]
    beam_tokens = sum(len(c.token_ids) for out in ordered for c in out.outputs)
    return {"wall_s": wall, "mean_ttft_s": statistics.mean(first.values()), "beam_tokens": beam_tokens,
            "beam_tokens_per_s": beam_tokens / wall, "hit_tokens": sum(o.num_cached_tokens for o in ordered),
            "outputs": [[c.token_ids for c in out.outputs] for out in ordered]}


def ttft_alone(llm: LLM, ids: list[int], params) -> tuple[float, int]:
    """One request alone: seconds from add_request to the step that chose its first token."""
    engine = llm.engine
    start = time.perf_counter()
    engine.add_request("alone", {"prompt_token_ids": ids}, params)
    ttft, cached = None, 0
    while engine.has_unfinished():
        for delta in engine.step():
            if delta.first_token and ttft is None:
                ttft = time.perf_counter() - start
            if delta.finished:
                cached = delta.output.num_cached_tokens
    return ttft, cached


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--system-tokens", type=int, default=2048)
    ap.add_argument("--user-tokens", type=int, default=64)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--ttft-repeats", type=int, default=3)
    ap.add_argument("--kv-cache-memory", default="4GiB", help="per engine; three engines are alive at once")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="256 + 16 tokens, 4 requests, W in {1, 2}, N=4")
    ap.add_argument("--out", type=Path, default=RESULTS / "prefix_cache.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.system_tokens, args.user_tokens, args.num_requests, args.widths = 256, 16, 4, [1, 2]
        args.max_new_tokens, args.ttft_repeats, args.kv_cache_memory = 4, 2, "1GiB"
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    configs = {"no-cache": {"enable_prefix_caching": False}, "cache": {}, "pinned": {}}
    llms, build_s = {}, {}
    plain = LLM(MODEL, device="cpu", kv_cache_memory=args.kv_cache_memory, enable_prefix_caching=False)
    system, users = token_parts(plain.tokenizer, args.system_tokens, args.user_tokens,
                                args.num_requests + args.ttft_repeats * len(args.widths))
    configs["pinned"] = {"pinned_prefixes": [system]}
    llms["no-cache"], build_s["no-cache"] = plain, 0.0
    for name in ("cache", "pinned"):
        start = time.perf_counter()
        llms[name] = LLM(MODEL, device="cpu", kv_cache_memory=args.kv_cache_memory, **configs[name])
        build_s[name] = time.perf_counter() - start
    pools = {name: llm.stats()["pools"]["self"] for name, llm in llms.items()}
    print(f"pools: {pools}", flush=True)
    batch_prompts = [system + user for user in users[:args.num_requests]]
    spare = iter(users[args.num_requests:])
    results = []
    for width in args.widths:
        params = (SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0, ignore_eos=True) if width == 1
                  else BeamSearchParams(beam_width=width, max_new_tokens=args.max_new_tokens, ignore_eos=True))
        ttft_users = [next(spare) for _ in range(args.ttft_repeats)]
        rows = {}
        for name, llm in llms.items():
            llm.engine.reset_prefix_cache()
            batch = run_batch(llm, batch_prompts, params)
            alone = [ttft_alone(llm, system + user, params) for user in ttft_users]
            batch["ttft_hit_s"] = statistics.median(t for t, _ in alone)
            batch["ttft_hit_cached_tokens"] = alone[0][1]
            rows[name] = batch
            print(f"W={width} {name}: batch {batch['wall_s']:.1f} s, hit tokens {batch['hit_tokens']}, "
                  f"TTFT alone {batch['ttft_hit_s']:.3f} s ({alone[0][1]} cached)", flush=True)
        reference = rows["no-cache"]["outputs"]
        for name, row in rows.items():
            row["same_outputs"] = row.pop("outputs") == reference
            if not row["same_outputs"]:
                print(f"MISMATCH: W={width} {name} differs from no-cache", file=sys.stderr, flush=True)
            results.append({"width": width, "config": name, **row})
    base = {r["width"]: r for r in results if r["config"] == "no-cache"}
    for r in results:
        b = base[r["width"]]
        r["ttft_speedup"] = b["ttft_hit_s"] / r["ttft_hit_s"]
        r["batch_speedup"] = b["wall_s"] / r["wall_s"]
    headers = ["W", "config", "batch s", "x vs no-cache", "beam-tok/s", "mean TTFT in batch s", "TTFT of a hit s",
               "x vs no-cache", "hit tokens", "same beams"]
    table = [[str(r["width"]), r["config"], f"{r['wall_s']:.2f}", f"{r['batch_speedup']:.2f}",
              f"{r['beam_tokens_per_s']:.1f}", f"{r['mean_ttft_s']:.2f}", f"{r['ttft_hit_s']:.3f}",
              f"{r['ttft_speedup']:.1f}", str(r["hit_tokens"]), "yes" if r["same_outputs"] else "NO"]
             for r in results]
    aligns = "rlrrrrrrrl"
    print_table("prefix reuse", headers, table, aligns)
    targets = {f"ttft_hit_10x_W{w}": next(r["ttft_speedup"] >= 10 for r in results
                                           if r["width"] == w and r["config"] == "cache") for w in args.widths}
    targets.update({f"batch_2x_W{w}": next(r["batch_speedup"] >= 2 for r in results
                                           if r["width"] == w and r["config"] == "cache") for w in args.widths if w > 1})
    print(f"targets (>= 10x TTFT for a hit, >= 2x batch at W > 1): {targets}")
    report = {"command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
              "model": MODEL, "system_tokens": args.system_tokens, "user_tokens": args.user_tokens,
              "num_requests": args.num_requests, "max_new_tokens": args.max_new_tokens,
              "kv_cache_memory": args.kv_cache_memory, "pinned_build_s": build_s["pinned"],
              "cache_build_s": build_s["cache"], "peak_rss_bytes": rss_bytes("VmHWM"), "targets": targets,
              "total_s": time.perf_counter() - t0, "machine": machine_info(args.threads), "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    md = (f"Prefix reuse, {MODEL} float32, {args.threads} threads: {args.num_requests} requests of "
          f"{args.system_tokens} shared + {args.user_tokens} own prompt tokens, {args.max_new_tokens} new tokens "
          f"(`{report['command']}`).\n\n" + markdown_table(headers, table, aligns) + "\n")
    args.out.with_suffix(".md").write_text(md)
    print(f"wrote {args.out} and {args.out.with_suffix('.md')} in {report['total_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
