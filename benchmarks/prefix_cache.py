"""Prefix reuse on the default model, in one process: many requests sharing a long system prompt,
with the prefix cache off, on, and with the system prompt pinned at start-up.

    python benchmarks/prefix_cache.py                # 64 x (2,048 + 64) tokens, W 1 and 16 (~18 min, 2 cores)
    python benchmarks/prefix_cache.py --quick        # smoke run (about a minute); writes to the temp dir

The prompts: a system prompt of exactly --system-tokens token ids of real text (this repository's
README as of c716efb, kept in benchmarks/data/ so the recorded results reproduce, tokenized with the
model's tokenizer) and, per request, --user-tokens ids of the text that follows, with a distinct
first token so that no two requests share more than the system prompt.

Three engines (same float32 weights, same --kv-cache-memory each), built once and warmed up once:
- **no-cache**: `enable_prefix_caching=False`, every request computes its whole prompt;
- **cache**: `enable_prefix_caching=True`, the first request computes the system prompt and the rest
  may hit it (the cache is emptied before every batch);
- **pinned**: also `pinned_prefixes=[system prompt]`, computed at start-up (its build time is reported
  separately) and never evicted.
For each width the configurations run in turn (their order rotates from width to width):
- **batch**: all --num-requests requests submitted at once and run to the end: wall time, beam-tokens/s
  (W x generated tokens per request, summed, over the wall time), mean time to first token in the
  batch, hit tokens and hit rate (`llm.stats()["prefix_cache"]`, this batch's share), the most KV
  blocks held at once, the peak RSS during the batch;
- **TTFT of a hit**: then, --ttft-repeats times, one new request (a fresh user part, the same one for
  every configuration, configurations interleaved) alone on the warm engine: its time to first token,
  median reported. Without the cache that request computes all P tokens; with it, only the user part.
Every request's best beam (and, separately, every returned beam) is compared with no-cache's; a
mismatch is printed and recorded, never hidden. The issue's targets (>= 10x TTFT for a hit at
P=2,048, whole batch >= 2x faster at W=16) are printed as met or missed, never asserted.

Writes benchmarks/results/prefix_cache.json and prefix_cache.md (--quick: the temp dir, unless --out).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from tables import machine_info, markdown_table, print_table

from widebeam.defaults import DEFAULT_MAX_BEAM_WIDTH, DEFAULT_MODEL
from widebeam.kv.budget import KVRequest
from widebeam.llm import LLM
from widebeam.memstats import reset_peak_rss, rss_bytes
from widebeam.params import BeamSearchParams, SamplingParams

MODEL = DEFAULT_MODEL
GIB, MIB = 2**30, 2**20
RESULTS = Path(__file__).parent / "results"
# the README as it was when results/prefix_cache.json was recorded (c716efb): the prompts are its text
TEXT = Path(__file__).parent / "data" / "prefix_cache_text.md"
CONFIGS = ("no-cache", "cache", "pinned")


def token_parts(tokenizer, system_tokens: int, user_tokens: int,
                count: int) -> tuple[list[int], list[list[int]]]:
    """A system prompt of exactly `system_tokens` tokens of real text, and `count` distinct user parts."""
    words = TEXT.read_text().split()
    ids = tokenizer.encode(" ".join(words), add_special_tokens=False)
    while len(ids) < system_tokens + count * user_tokens:
        ids = ids + ids
    system = ids[:system_tokens]
    users = [ids[system_tokens + i * user_tokens: system_tokens + (i + 1) * user_tokens]
             for i in range(count)]
    # a distinct first token per user part: no two requests share more than the system prompt
    return system, [[10_000 + i] + part[1:] for i, part in enumerate(users)]


def make_params(width: int, new_tokens: int):
    """Greedy at W=1, beam search above; every request generates exactly `new_tokens` tokens."""
    if width == 1:
        return SamplingParams(max_new_tokens=new_tokens, min_new_tokens=new_tokens, temperature=0.0,
                              ignore_eos=True)
    return BeamSearchParams(beam_width=width, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                            ignore_eos=True)


def held_blocks(llm: LLM) -> int:
    """KV blocks held right now, all pools: neither free nor cached-evictable (pinned ones count)."""
    return sum(p["total_blocks"] - p["free_blocks"] - p["evictable_blocks"]
               for p in llm.stats()["pools"].values())


def run_batch(llm: LLM, prompts: list[list[int]], params) -> dict:
    """All prompts at once: wall time, per-request time to first token, outputs, hits, peak blocks and RSS."""
    engine = llm.engine
    before = llm.stats()["prefix_cache"]
    load_before = os.getloadavg()[0]
    reset_peak_rss(trim_heap=True)
    start = time.perf_counter()
    arrival, first, outputs = {}, {}, {}
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": ids}, params)
        arrival[f"r{i}"] = time.perf_counter()
    peak_held = held_blocks(llm)
    while engine.has_unfinished():
        for delta in engine.step():
            now = time.perf_counter()
            if delta.first_token:
                first[delta.request_id] = now - arrival[delta.request_id]
            if delta.finished:
                outputs[delta.request_id] = delta.output
        peak_held = max(peak_held, held_blocks(llm))
    wall = time.perf_counter() - start
    after = llm.stats()["prefix_cache"]
    ordered = [outputs[f"r{i}"] for i in range(len(prompts))]
    beam_tokens = sum(len(c.token_ids) for out in ordered for c in out.outputs)
    queried = after["queried_tokens"] - before["queried_tokens"]
    hits = after["hit_tokens"] - before["hit_tokens"]
    return {"wall_s": wall, "mean_ttft_s": statistics.mean(first.values()), "beam_tokens": beam_tokens,
            "beam_tokens_per_s": beam_tokens / wall,
            "hit_tokens": sum(o.num_cached_tokens for o in ordered),  # RequestOutput.num_cached_tokens
            "stats_hit_tokens": hits, "stats_queried_tokens": queried,
            "hit_rate": hits / queried if queried else 0.0,
            "peak_held_blocks": peak_held, "peak_rss_bytes": rss_bytes("VmHWM"),
            "load1_before_after": [load_before, os.getloadavg()[0]],  # the host is shared: its 1-min load
            "required_blocks": sum(sum(o.required_blocks.values()) for o in ordered),
            "best": [list(out.outputs[0].token_ids) for out in ordered],
            "beams": [[list(c.token_ids) for c in out.outputs] for out in ordered]}


def ttft_alone(llm: LLM, ids: list[int], params, request_id: str) -> tuple[float, int]:
    """One request alone: seconds from add_request to the step that chose its first token, cached tokens."""
    engine = llm.engine
    start = time.perf_counter()
    engine.add_request(request_id, {"prompt_token_ids": ids}, params)
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
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 256 + 16 tokens, 4 requests, W in {1, 2}, N=4, 2 TTFT repeats, 1GiB")
    ap.add_argument("--out", type=Path, default=None,
                    help="JSON path, the markdown beside it (default benchmarks/results/prefix_cache.json; "
                         "--quick: the temp dir)")
    args = ap.parse_args(argv)
    if args.quick:
        args.system_tokens, args.user_tokens, args.num_requests, args.widths = 256, 16, 4, [1, 2]
        args.max_new_tokens, args.ttft_repeats, args.kv_cache_memory = 4, 2, "1GiB"
    if args.out is None:
        args.out = (Path(tempfile.gettempdir()) / "prefix_cache_quick.json" if args.quick
                    else RESULTS / "prefix_cache.json")
    command = " ".join([Path(sys.argv[0]).as_posix(), *(argv if argv is not None else sys.argv[1:])])
    torch.set_num_threads(args.threads)
    max_width = max(args.widths)
    t0 = time.perf_counter()

    # -- engines ------------------------------------------------------------------------------------
    common = {"device": "cpu", "dtype": "float32", "kv_cache_memory": args.kv_cache_memory}
    if max_width > DEFAULT_MAX_BEAM_WIDTH:
        common["max_beam_width"] = max_width
    llms, build_s = {}, {}
    start = time.perf_counter()
    llms["no-cache"] = LLM(MODEL, enable_prefix_caching=False, **common)
    build_s["no-cache"] = time.perf_counter() - start
    tokenizer = llms["no-cache"].tokenizer
    system, users = token_parts(tokenizer, args.system_tokens, args.user_tokens,
                                args.num_requests + args.ttft_repeats * len(args.widths))
    for name, extra in (("cache", {}), ("pinned", {"pinned_prefixes": [system]})):
        start = time.perf_counter()
        llms[name] = LLM(MODEL, enable_prefix_caching=True, **extra, **common)
        build_s[name] = time.perf_counter() - start
    print(f"built (s): {', '.join(f'{n} {s:.2f}' for n, s in build_s.items())}; the pinned engine's start-up "
          f"includes computing the {len(system)}-token prefix", flush=True)
    t = llms["no-cache"].engine.cache.tokens_per_block
    pools = {name: llm.stats()["pools"] for name, llm in llms.items()}
    for name, p in pools.items():
        print(f"pools {name}: " + "; ".join(f"{pool} total {s['total_blocks']} free {s['free_blocks']} "
                                            f"pinned {s['pinned_blocks']}" for pool, s in p.items()),
              flush=True)
    prompt_len = args.system_tokens + args.user_tokens
    whole_batch = {w: args.num_requests
                   * sum(b.required_blocks for b in llms["no-cache"].engine.cache.budgets(
                       KVRequest(prompt_tokens=prompt_len, max_new_tokens=args.max_new_tokens, beam_width=w)))
                   for w in args.widths}
    capacity = sum(s["total_blocks"] for s in pools["no-cache"].values())
    for w, need in whole_batch.items():
        print(f"W={w}: the whole batch without reuse needs {need} blocks at once, the pool holds {capacity} "
              f"({'fits' if need <= capacity else 'requests wait for blocks'})", flush=True)

    # -- warm-up, then one timed P+U-token prefill (for the estimate) ---------------------------------
    # a full-length prompt sharing nothing with the timed ones: the first long forward's one-off costs
    warm_ids = [11_000 + k % 1_000 for k in range(prompt_len)]
    for llm in llms.values():
        ttft_alone(llm, warm_ids, make_params(max_width, 2), "warm-up")
        llm.engine.reset_prefix_cache()
    own = [12_000 + k for k in range(args.user_tokens)]  # a user part no timed request uses
    prefill_s, _ = ttft_alone(llms["no-cache"], system + own, make_params(1, 1), "prefill")
    lower = len(args.widths) * (args.num_requests + args.ttft_repeats) * prefill_s
    print(f"one {prompt_len}-token prefill: {prefill_s:.2f} s; the no-cache runs alone will take at least "
          f"{lower:.0f} s (prefill only; decode and the cached configurations come on top)", flush=True)

    # -- the runs -------------------------------------------------------------------------------------
    batch_prompts = [system + user for user in users[:args.num_requests]]
    spare = iter(users[args.num_requests:])
    full_blocks = args.system_tokens // t * t  # system-prompt tokens in full blocks: what a hit can take
    results = []
    for wi, width in enumerate(args.widths):
        params = make_params(width, args.max_new_tokens)
        order = list(CONFIGS[wi % 3:] + CONFIGS[:wi % 3])
        rows = {}
        for name in order:
            llm = llms[name]
            llm.engine.reset_prefix_cache()
            rows[name] = run_batch(llm, batch_prompts, params)
            r = rows[name]
            print(f"W={width} {name}: batch {r['wall_s']:.1f} s, hit tokens {r['hit_tokens']} (stats "
                  f"{r['stats_hit_tokens']} of {r['stats_queried_tokens']}, {r['hit_rate']:.1%}), peak held "
                  f"{r['peak_held_blocks']} blocks, peak RSS {r['peak_rss_bytes'] / GIB:.2f} GiB, load "
                  f"{r['load1_before_after'][0]:.1f} -> {r['load1_before_after'][1]:.1f}", flush=True)
        ttft = {name: [] for name in CONFIGS}
        for rep in range(args.ttft_repeats):
            user = next(spare)
            for name in order[rep % 3:] + order[:rep % 3]:
                ttft[name].append(ttft_alone(llms[name], system + user, params, f"alone-{width}-{rep}"))
        for name in CONFIGS:
            rows[name]["ttft_hit_s"] = statistics.median(s for s, _ in ttft[name])
            rows[name]["ttft_hit_runs_s"] = [s for s, _ in ttft[name]]
            rows[name]["ttft_hit_cached_tokens"] = [c for _, c in ttft[name]]
            runs = ", ".join(f"{s:.3f}" for s in rows[name]["ttft_hit_runs_s"])
            print(f"W={width} {name}: TTFT alone {rows[name]['ttft_hit_s']:.3f} s (runs {runs}; "
                  f"cached {rows[name]['ttft_hit_cached_tokens']})", flush=True)
        expected = {"no-cache": (0, 0), "cache": ((args.num_requests - 1) * full_blocks, full_blocks),
                    "pinned": (args.num_requests * full_blocks, full_blocks)}
        for name in CONFIGS:
            row = rows[name]
            want_batch, want_alone = expected[name]
            row["expected_hit_tokens"] = want_batch
            if row["hit_tokens"] != want_batch or row["stats_hit_tokens"] != row["hit_tokens"] \
                    or any(c != want_alone for c in row["ttft_hit_cached_tokens"]):
                print(f"NOTE: W={width} {name}: hit tokens {row['hit_tokens']} (stats "
                      f"{row['stats_hit_tokens']}), expected {want_batch}; alone "
                      f"{row['ttft_hit_cached_tokens']}, expected {want_alone} each",
                      file=sys.stderr, flush=True)
        reference = rows["no-cache"]
        for name in CONFIGS:
            row = rows[name]
            row["same_best"] = row["best"] == reference["best"]
            row["same_beams"] = row["beams"] == reference["beams"]
            if not (row["same_best"] and row["same_beams"]):
                diff = [i for i, (a, b) in enumerate(zip(row["best"], reference["best"])) if a != b]
                print(f"MISMATCH: W={width} {name} differs from no-cache: best beam of requests {diff}, "
                      f"all beams same: {row['same_beams']}", file=sys.stderr, flush=True)
        for name in CONFIGS:
            row = rows.pop(name)
            row.pop("best"), row.pop("beams")
            results.append({"width": width, "config": name, **row})

    base = {r["width"]: r for r in results if r["config"] == "no-cache"}
    for r in results:
        b = base[r["width"]]
        r["ttft_speedup"] = b["ttft_hit_s"] / r["ttft_hit_s"]
        r["batch_speedup"] = b["wall_s"] / r["wall_s"]
    headers = ["W", "config", "batch s", "x vs no-cache", "beam-tok/s", "mean TTFT in batch s",
               "TTFT of a hit s", "x vs no-cache", "hit tokens", "hit rate", "peak blocks", "peak RSS GiB",
               "same best", "same beams"]
    aligns = "rlrrrrrrrrrrll"

    def cells(r: dict, rich: bool) -> list[str]:
        def flag(ok: bool) -> str:
            return "yes" if ok else ("[bold red]NO[/]" if rich else "NO")
        return [str(r["width"]), r["config"], f"{r['wall_s']:.2f}", f"{r['batch_speedup']:.2f}",
                f"{r['beam_tokens_per_s']:.1f}", f"{r['mean_ttft_s']:.2f}", f"{r['ttft_hit_s']:.3f}",
                f"{r['ttft_speedup']:.1f}", str(r["hit_tokens"]), f"{r['hit_rate']:.1%}",
                str(r["peak_held_blocks"]),
                f"{r['peak_rss_bytes'] / GIB:.2f}" if r["peak_rss_bytes"] else "-", flag(r["same_best"]),
                flag(r["same_beams"])]

    print_table("prefix reuse", headers, [cells(r, True) for r in results], aligns,
                plain_rows=[cells(r, False) for r in results])
    cache_rows = {r["width"]: r for r in results if r["config"] == "cache"}
    targets = {f"ttft_hit_10x_W{w}": cache_rows[w]["ttft_speedup"] >= 10 for w in args.widths}
    targets.update({f"batch_2x_W{w}": cache_rows[w]["batch_speedup"] >= 2 for w in args.widths if w > 1})
    at_issue_size = args.system_tokens == 2048 and args.user_tokens == 64 and args.num_requests == 64
    lines = []
    for w in args.widths:
        lines.append(f"TTFT of a hit >= 10x at W={w}: {cache_rows[w]['ttft_speedup']:.1f}x, "
                     f"{'met' if targets[f'ttft_hit_10x_W{w}'] else 'MISSED'}")
        if w > 1:
            lines.append(f"whole batch >= 2x at W={w}: {cache_rows[w]['batch_speedup']:.2f}x, "
                         f"{'met' if targets[f'batch_2x_W{w}'] else 'MISSED'}")
    print("targets (cache vs no-cache"
          + ("" if at_issue_size else "; NOT the issue's sizes, for information") + "):")
    for line in lines:
        print("  " + line)
    total_s = time.perf_counter() - t0
    report = {"command": command, "quick": args.quick, "model": MODEL, "dtype": "float32",
              "system_tokens": args.system_tokens, "user_tokens": args.user_tokens,
              "num_requests": args.num_requests, "widths": args.widths, "max_new_tokens": args.max_new_tokens,
              "ttft_repeats": args.ttft_repeats, "kv_cache_memory": args.kv_cache_memory,
              "tokens_per_block": t,
              "pools": pools, "whole_batch_blocks_without_reuse": whole_batch, "build_s": build_s,
              "pinned_startup_s": build_s["pinned"], "prefill_s": prefill_s, "targets": targets,
              "targets_at_issue_size": at_issue_size, "peak_rss_bytes": rss_bytes("VmHWM"),
              "total_s": total_s, "machine": machine_info(args.threads), "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    md = (f"Prefix reuse, {MODEL} float32, {args.threads} threads, {args.kv_cache_memory} of KV per engine: "
          f"{args.num_requests} requests of {args.system_tokens} shared + {args.user_tokens} own prompt "
          f"tokens, {args.max_new_tokens} new tokens (`{command}`). Engine start-up: "
          + ", ".join(f"{n} {s:.1f} s" for n, s in build_s.items())
          + f" (pinned computes the {args.system_tokens}-token prefix).\n\n"
          + markdown_table(headers, [cells(r, False) for r in results], aligns) + "\n"
          + "\n".join(f"- {line}" for line in lines) + "\n")
    args.out.with_suffix(".md").write_text(md)
    print(f"wrote {args.out} and {args.out.with_suffix('.md')} in {total_s:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
