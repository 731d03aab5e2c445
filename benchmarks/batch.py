"""`widebeam batch` throughput: the in-process default and Ray Data with 1 and 2 engine replicas, on
the same rows and weights, in one process.

    python benchmarks/batch.py                 # 64 rows, beam width 4, 16 new tokens, default model
    python benchmarks/batch.py --quick         # 8 rows, N=4

On this 2-core machine, replicas share the same two cores (each replica gets one CPU slot and one
thread; the in-process engine runs with --threads and with one thread), so the figures show the
overhead and the scaling of the Ray path, not a cluster's throughput. Wall times include each
job's engine start-up (the model is converted once into the cache before the first). On a cluster the same
command line runs with `--replicas N --ray-address auto`, one GPU per replica where there are GPUs (see
docs/batch-and-ray.md). Every configuration's beams are checked against the in-process run's.

Writes benchmarks/results/batch.json and batch.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from tables import machine_info, markdown_table, print_table

from widebeam.batch import read_output, run

MODEL = "smollm2-135m-instruct"
RESULTS = Path(__file__).parent / "results"
QUESTIONS = ["Name a colour.", "Suggest a book.", "What is a prime number?", "Describe the sea.",
             "Give a synonym for happy.", "Why do leaves fall?", "Name a planet.", "Suggest a film."]


def write_rows(path: Path, num_rows: int) -> None:
    with open(path, "w") as f:
        for i in range(num_rows):
            row = {"id": f"q{i}",
                   "messages": [{"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} ({i})"}]}
            f.write(json.dumps(row) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-rows", type=int, default=64)
    ap.add_argument("--beam-width", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--kv-cache-memory", default="1GiB")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS / "batch.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.num_rows, args.max_new_tokens = 8, 4
    torch.set_num_threads(args.threads)
    work = Path(f"/tmp/widebeam-batch-bench-{time.time_ns()}")
    work.mkdir(parents=True)
    source = work / "rows.jsonl"
    write_rows(source, args.num_rows)
    defaults = {"beam_width": args.beam_width, "max_new_tokens": args.max_new_tokens, "ignore_eos": True}
    engine = {"device": "cpu", "kv_cache_memory": args.kv_cache_memory}
    # (label, replicas, torch threads of the in-process engine)
    configs = [(f"in-process, {args.threads} threads", 0, args.threads), ("in-process, 1 thread", 0, 1)]
    configs += [(f"ray x{n}", n, 1) for n in args.replicas]
    results, reference = [], None
    import ray

    for name, replicas, threads in configs:
        torch.set_num_threads(threads)
        if replicas and not ray.is_initialized():
            ray.init(num_cpus=max(args.replicas), include_dashboard=False, log_to_driver=False)
        out = work / f"{name.replace(' ', '-').replace(',', '')}.jsonl"
        start = time.perf_counter()
        summary = run(source, out, MODEL, defaults=defaults, replicas=replicas, progress=False, **engine)
        wall = time.perf_counter() - start  # engine start-up included: a job pays it
        records = {r["id"]: [o["token_ids"] for o in r["outputs"]] for r in read_output(out)}
        reference = reference or records
        results.append({"config": name, "replicas": replicas, "wall_s": wall, "rows": summary.num_written,
                        "errors": summary.num_errors, "rows_per_s": summary.num_written / wall,
                        "beam_tokens_per_s": summary.num_generated_tokens / wall,
                        "same_beams": records == reference})
        print(f"{name}: {wall:.1f} s, {summary.num_written} rows", flush=True)
    headers = ["config", "wall s (start-up incl.)", "rows/s", "beam-tokens/s", "errors", "same beams"]
    table = [[r["config"], f"{r['wall_s']:.1f}", f"{r['rows_per_s']:.2f}", f"{r['beam_tokens_per_s']:.1f}",
              str(r["errors"]), "yes" if r["same_beams"] else "NO"] for r in results]
    print_table("widebeam batch", headers, table, "lrrrrl")
    report = {"command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
              "model": MODEL, "num_rows": args.num_rows, "beam_width": args.beam_width,
              "max_new_tokens": args.max_new_tokens, "machine": machine_info(args.threads),
              "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    md = (f"`widebeam batch`, {MODEL} float32, {args.num_rows} chat rows, beam width {args.beam_width}, "
          f"{args.max_new_tokens} new tokens, {machine_info(args.threads)['cpu_count']} cores "
          f"(`{report['command']}`).\n\n" + markdown_table(headers, table, "lrrrrl") + "\n")
    args.out.with_suffix(".md").write_text(md)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
