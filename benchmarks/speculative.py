"""Speculative decoding vs plain decoding on the default model, in one process: prompt lookup
(ngram) and a bfloat16 copy of the model as its own draft, for greedy (W=1) and beam search (W>1),
on a copy-heavy task and on free text.

    python benchmarks/speculative.py                      # full run (~10 min on 2 cores)
    python benchmarks/speculative.py --quick              # smoke run (a minute or two)
    python benchmarks/speculative.py --widths 1 --configs plain ngram --num-speculative-tokens 3 5

Every engine is built once (float32 target, same weights) and warmed up once; every (task, W) runs
its configurations back to back, --repeats times in alternating order, and keeps each one's best
wall time (the host is shared: each run's 1-minute load average is recorded in the JSON). W=1 runs one prompt
at a time (the latency case speculation is for; the wall time is the sum over prompts) and, unless
--no-w1-batch, also all prompts in one batch; W>1 runs all prompts of the task in one batch. Every
configuration's token ids are checked against plain's (all returned beams, in order): a mismatch is
printed loudly and recorded, never hidden.

Writes benchmarks/results/speculative.json and speculative.md (the table in docs/speculative-decoding.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from tables import machine_info, markdown_table, print_table

from widebeam.llm import LLM
from widebeam.memstats import reset_peak_rss, rss_bytes
from widebeam.params import BeamSearchParams, SamplingParams

MODEL = "smollm2-135m-instruct"
GIB, MIB = 2**30, 2**20

PARAGRAPHS = [
    ("The old lighthouse stood at the edge of the cliff for more than a hundred years. Every night its "
     "keeper climbed the narrow stairs, trimmed the wick and polished the great lens until it shone. Ships "
     "passing in the dark counted the flashes to know where they were, and none of them ever struck the "
     "rocks below while the light was burning."),
    ("To make simple bread, mix flour, water, salt and a little yeast in a large bowl. Knead the dough for "
     "ten minutes until it is smooth, then cover it and let it rise in a warm place for two hours. Shape "
     "it into a loaf, let it rise again, and bake it in a hot oven for about forty minutes."),
    ("Our team meeting has moved from Tuesday to Thursday at three in the afternoon. Please bring the "
     "latest sales figures, the draft budget for next year and any questions about the new travel policy. "
     "The meeting will take place in the large conference room on the second floor."),
    ("Teh river flows slowly thrugh the valley, past fields of wheat and smal villages. In the spring the "
     "water rises and covers the low meadows, and farmers wait for it to go down befor they plant. "
     "Children swim in it during the long sumer afternoons."),
    ("Our libary opens at nine in the morning and closes at six in the evning. Members can borow up to "
     "five books at a time for three weeks. Late books cost ten cents a day, and lost books must be "
     "replaced or payed for at the front desk."),
    ("The new phone has a larger screan, a faster procesor and a battery that lasts two full days. It "
     "comes in three colors and ships with a charger in the box. Early revews praise the camera but say "
     "the price is to high for most buyers."),
]
COPY_MESSAGES = (
    [f"Repeat this text exactly:\n\n{p}" for p in PARAGRAPHS[:3]]
    + [f"Fix the typos in the following text and return the corrected text:\n\n{p}" for p in PARAGRAPHS[3:]]
)
FREE_MESSAGES = [
    "Write a short story about a robot who learns to paint.",
    "Write a short story about a lost dog finding its way home.",
    "What are the main causes of climate change? Explain briefly.",
    "Describe a perfect day at the beach.",
    "Give me some advice for learning a new language.",
    "Why is the sky blue? Explain it to a child.",
]
TASKS = {"copy": COPY_MESSAGES, "free": FREE_MESSAGES}


def build_configs(names: list[str], ds: list[int], draft_dtype: str) -> list[tuple[str, dict]]:
    """(label, LLM kwargs) for each configuration: plain first (the reference)."""
    configs = [("plain", {})]
    for d in ds:
        if "ngram" in names:
            configs.append((f"ngram D={d}", {"speculative_method": "ngram", "num_speculative_tokens": d}))
        if "ngram-fixed" in names:  # the A/B of the adaptive draft length: always draft D
            configs.append((f"ngram D={d} fixed", {"speculative_method": "ngram", "num_speculative_tokens": d,
                                                   "speculative_adaptive": False}))
        if "draft" in names:
            configs.append((f"{draft_dtype} draft D={d}",
                            {"speculative_model": MODEL, "speculative_dtype": draft_dtype,
                             "num_speculative_tokens": d}))
    return configs


def spec_counts(llm: LLM) -> dict:
    spec = llm.stats().get("speculative")
    keys = ("rounds", "steps", "drafted_tokens", "accepted_tokens")
    return {k: spec[k] for k in keys} if spec else dict.fromkeys(keys, 0)


def run_case(llm: LLM, prompts: list[str], params, one_by_one: bool) -> tuple[float, list, dict, int | None]:
    """Wall seconds (summed over prompts when one_by_one), outputs, the speculative counters' change,
    and the process's peak RSS during the runs."""
    before = spec_counts(llm)
    reset_peak_rss(trim_heap=True)
    if one_by_one:
        outputs, wall = [], 0.0
        for prompt in prompts:
            start = time.perf_counter()
            outputs.extend(llm.generate([prompt], params, use_tqdm=False))
            wall += time.perf_counter() - start
    else:
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
    peak = rss_bytes("VmHWM")
    after = spec_counts(llm)
    return wall, outputs, {k: after[k] - before[k] for k in after}, peak


def token_ids(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in out.outputs] for out in outputs]


def compare(reference, outputs) -> dict:
    """Token ids of every returned sequence equal to plain's; score drift where they are."""
    ref_ids, ids = token_ids(reference), token_ids(outputs)
    mismatches = [i for i, (a, b) in enumerate(zip(ref_ids, ids)) if a != b]
    drift = 0.0
    for a, b in zip(reference, outputs):
        for ca, cb in zip(a.outputs, b.outputs):
            if ca.token_ids == cb.token_ids:
                drift = max(drift, abs(ca.cumulative_logprob - cb.cumulative_logprob))
    first = None
    if mismatches:
        i = mismatches[0]
        first = {"prompt": i, "plain": ref_ids[i][0][:40], "this": ids[i][0][:40],
                 "best_same": ref_ids[i][0] == ids[i][0]}
    return {"identical": not mismatches, "mismatched_prompts": mismatches, "first_mismatch": first,
            "max_logprob_drift": drift}


def fmt_row(r: dict) -> list[str]:
    s = r["spec"]
    spr = f"{s['steps'] / s['rounds']:.2f}" if s["rounds"] else "-"
    acc = f"{s['accepted_tokens'] / s['drafted_tokens']:.2f}" if s["drafted_tokens"] else "-"
    same = "-" if r["config"] == "plain" else ("yes" if r["check"]["identical"] else "NO")
    return [r["task"], r["mode"], r["config"], f"{r['wall_s']:.2f}", f"{r['tokens_per_s']:.1f}",
            f"{r['speedup']:.2f}x", spr, acc, same,
            f"{r['peak_rss_bytes'] / GIB:.2f}" if r["peak_rss_bytes"] else "-"]


HEADERS = ["task", "W / mode", "config", "wall s", "tokens/s", "speed-up", "steps/round", "accepted/drafted",
           "same ids", "process peak RSS GiB"]


ALIGNS = "lllrrrrrcr"


def markdown(rows: list[dict]) -> str:
    return markdown_table(HEADERS, [fmt_row(r) for r in rows], ALIGNS)


def styled(r: dict) -> list[str]:
    cells = fmt_row(r)
    if cells[8] == "NO":
        cells[8] = "[bold red]NO[/]"
    if r["speedup"] < 1 and r["config"] != "plain":
        cells[5] = f"[yellow]{cells[5]}[/]"
    return cells


def print_results(rows: list[dict]) -> None:
    print_table("speculative decoding vs plain (same process, same weights)", HEADERS,
                [styled(r) for r in rows], ALIGNS, plain_rows=[fmt_row(r) for r in rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="new tokens for every width (default: 64 at W=1, 32 for beams)")
    parser.add_argument("--num-speculative-tokens", type=int, nargs="+", default=[4],
                        help="D; several values build one engine per (method, D)")
    parser.add_argument("--configs", nargs="+", default=["ngram", "draft"],
                        choices=["ngram", "ngram-fixed", "draft"])
    parser.add_argument("--draft-dtype", default="bfloat16")
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--num-prompts", type=int, default=6)
    parser.add_argument("--no-w1-batch", action="store_true", help="W=1 one prompt at a time only")
    parser.add_argument("--repeats", type=int, default=2,
                        help="timed runs per (task, W, config), configurations alternating; the best is kept")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-cache-memory", default="512MiB")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 2 prompts, 8/16 new tokens, W 1 and 4")
    parser.add_argument("--out", default=None,
                        help="JSON path (default benchmarks/results/speculative.json, speculative_quick.json "
                             "with --quick: a smoke run does not replace the full run's results)")
    args = parser.parse_args()
    args.out = args.out or f"benchmarks/results/speculative{'_quick' if args.quick else ''}.json"
    if args.quick:
        args.num_prompts = min(args.num_prompts, 2)
        args.widths = [w for w in args.widths if w <= 4] or [1]
        args.repeats = 1
    torch.set_num_threads(args.threads)
    max_width = max(args.widths)

    def new_tokens(width: int) -> int:
        if args.max_new_tokens:
            return args.max_new_tokens
        if args.quick:
            return 16 if width == 1 else 8
        return 64 if width == 1 else 32

    configs = build_configs(args.configs, args.num_speculative_tokens, args.draft_dtype)
    engines: dict[str, LLM] = {}
    build = {}
    for label, kwargs in configs:
        rss0, start = rss_bytes(), time.perf_counter()
        # repeats run the same prompts: each must compute them, so no prefix cache
        engines[label] = LLM(MODEL, dtype="float32", kv_cache_memory=args.kv_cache_memory,
                             max_beam_width=max_width, enable_prefix_caching=False, **kwargs)
        build[label] = {"kwargs": kwargs, "build_s": round(time.perf_counter() - start, 2),
                        "rss_added_bytes": (rss_bytes() or 0) - (rss0 or 0)}
        print(f"built {label}: {build[label]['build_s']} s, "
              f"+{build[label]['rss_added_bytes'] / MIB:.0f} MiB RSS",
              flush=True)
    chat = engines["plain"].engine.apply_chat_template
    prompts = {task: [chat(m) for m in TASKS[task][:args.num_prompts]] for task in args.tasks}

    # warm-up: every engine once, each kind of request, before any timing. Each measured width runs
    # for at least as many tokens as its timed requests: the adaptive draft policy remembers per shape
    # (drafter, width) whether drafting paid, as a serving engine does from its earlier requests, so
    # the timed runs see its steady state, not the first request's learning.
    for label, llm in engines.items():
        start = time.perf_counter()
        llm.generate([chat("Repeat this text exactly: warm up the engine.")],
                     SamplingParams(temperature=0, max_new_tokens=max(8, new_tokens(1))), use_tqdm=False)
        for width in sorted({w for w in args.widths if w > 1}):
            llm.generate([chat("Describe your favourite city in a few sentences.")],
                         BeamSearchParams(beam_width=width, max_new_tokens=2 * new_tokens(width)),
                         use_tqdm=False)
        print(f"warmed {label}: {time.perf_counter() - start:.1f} s", flush=True)

    modes = []
    for w in args.widths:
        if w == 1:
            modes.append(("1 (1-by-1)", 1, True))
            if not args.no_w1_batch:
                modes.append(("1 (batch)", 1, False))
        else:
            modes.append((f"{w} (batch)", w, False))

    rows, problems = [], []
    t_all = time.perf_counter()
    for task in args.tasks:
        for mode, width, one_by_one in modes:
            n = new_tokens(width)
            params = (SamplingParams(temperature=0, max_new_tokens=n) if width == 1
                      else BeamSearchParams(beam_width=width, max_new_tokens=n))
            runs = {label: [] for label, _ in configs}
            for rep in range(args.repeats):
                order = configs if rep % 2 == 0 else configs[::-1]  # alternate, so drift hits all alike
                for label, _ in order:
                    load = os.getloadavg()[0]
                    wall, outputs, spec, peak = run_case(engines[label], prompts[task], params, one_by_one)
                    runs[label].append({"wall_s": wall, "outputs": outputs, "spec": spec, "peak": peak,
                                        "loadavg_1m_before": load})
            reference = runs["plain"][0]["outputs"]
            plain_s = min(r["wall_s"] for r in runs["plain"])
            for label, _ in configs:
                best = min(runs[label], key=lambda r: r["wall_s"])
                wall, spec = best["wall_s"], best["spec"]
                # every repeat's outputs are checked (plain's own repeats too: the engine is deterministic)
                checks = [compare(reference, r["outputs"]) for r in runs[label]]
                bad = [c for c in checks if not c["identical"]]
                check = bad[0] if bad else checks[0]
                if bad:
                    msg = (f"!!! OUTPUTS DIFFER FROM PLAIN: task={task} W={width} mode={mode} config={label} "
                           f"({len(bad)} of {len(checks)} runs) prompts {check['mismatched_prompts']}; "
                           f"first: {check['first_mismatch']}")
                    print("\n" + "!" * 100 + "\n" + msg + "\n" + "!" * 100 + "\n", file=sys.stderr,
                          flush=True)
                    problems.append(msg)
                generated = sum(len(out.outputs[0].token_ids) for out in best["outputs"])
                row = {"task": task, "mode": mode, "beam_width": width, "one_by_one": one_by_one,
                       "config": label, "max_new_tokens": n, "num_prompts": len(prompts[task]),
                       "wall_s": wall, "all_wall_s": [round(r["wall_s"], 3) for r in runs[label]],
                       "loadavg_1m_before": [round(r["loadavg_1m_before"], 2) for r in runs[label]],
                       "generated_tokens": generated, "tokens_per_s": generated / wall,
                       "speedup": plain_s / wall, "spec": spec, "check": check,
                       "peak_rss_bytes": max(r["peak"] or 0 for r in runs[label]) or None}
                rows.append(row)
                s = spec
                print(f"{task:5s} W={mode:11s} {label:20s} {wall:7.2f} s  {generated / wall:6.1f} tok/s  "
                      f"x{plain_s / wall:.2f}  steps/round "
                      f"{s['steps'] / s['rounds'] if s['rounds'] else 0:.2f}  acc "
                      f"{s['accepted_tokens'] / s['drafted_tokens'] if s['drafted_tokens'] else 0:.2f}  "
                      f"same={'yes' if check['identical'] else 'NO'}  runs {row['all_wall_s']}", flush=True)
    total_s = time.perf_counter() - t_all

    print_results(rows)
    if problems:
        print(f"\n{len(problems)} configuration(s) with outputs different from plain:", file=sys.stderr)
        for p in problems:
            print("  " + p, file=sys.stderr)
    else:
        print("\nall greedy / beam outputs identical to plain (token ids of every returned sequence)")
    result = {
        "model": MODEL, "target_dtype": "float32", "draft_dtype": args.draft_dtype,
        "machine": machine_info(args.threads), "kv_cache_memory": args.kv_cache_memory,
        "command": " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:]),
        "quick": args.quick, "repeats": args.repeats, "engines": build, "timed_s": round(total_s, 1),
        "tokens_counted": "generated tokens of each request's best sequence (identical across configs)",
        "w1_one_by_one": "wall time summed over prompts run one at a time",
        "prompts": {task: TASKS[task][:args.num_prompts] for task in args.tasks},
        "rows": rows, "problems": problems,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(rows))
    plot_speedups(rows, out.with_suffix(".png"))
    print(f"wrote {out}, {out.with_suffix('.md')} and {out.with_suffix('.png')} ({total_s:.0f} s timed)")


def plot_speedups(rows: list[dict], path: Path) -> list[str]:
    """Speed-up over plain against beam width, one line per (task, configuration); returns the labels.
    W=1 uses the batched run when there is one (the width axis compares like with like)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for task in sorted({r["task"] for r in rows}):
        for config in sorted({r["config"] for r in rows if r["config"] != "plain"}):
            by_width = {}
            for r in rows:
                if r["task"] == task and r["config"] == config and not (r["one_by_one"] and by_width.get(1)):
                    by_width[r["beam_width"]] = r["speedup"]
            if by_width:
                widths = sorted(by_width)
                ax.plot(widths, [by_width[w] for w in widths], "o-" if task == "copy" else "s--",
                        label=f"{task}: {config}")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("beam width")
    ax.set_ylabel("speed-up over plain decoding")
    ax.set_title("speculative decoding vs plain, same engine and outputs")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [line.get_label() for line in ax.get_lines() if not line.get_label().startswith("_")]


if __name__ == "__main__":
    main()
