"""Priorities under load: small urgent requests beside wide searches arriving past capacity.

    python benchmarks/priority_mix.py --priority-yield 4

One `widebeam serve` with `--priority-yield N`. First the background's capacity: `widebeam bench serve`'s
genrec load (widths 64 and 256) all at once, requests per second. Then, each with `widebeam bench serve`
(open loop):
1. the foreground alone: greedy completions (32 tokens) at `--fg-rate`;
2. background at 1.2x its capacity and the foreground beside it, every request priority 0;
3. the same with the foreground at priority -1 (lower runs first).
Reported: the foreground's p99 end-to-end latency in 2 and 3 against 1, and the background's
throughput in 3 against 2 (what the urgent requests cost it). Writes JSON.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from router_ab import bench_serve, free_port, pools_after, start_server_command, stop_server, wait_ready
from router_ab import load_result as result

ROOT = Path(__file__).resolve().parent.parent
FG_PROMPTS = (
    "Name three colours.",
    "What is the capital of France?",
    "Write a haiku about rain.",
    "Explain beam search in one sentence.",
    "List two prime numbers.",
)


def bench(url: str, out_dir: Path, name: str, args: list[str]) -> subprocess.Popen:
    return bench_serve(url, out_dir, name, ["--seed", "0", *args], quiet=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kv-cache-memory", default="256MiB")
    parser.add_argument("--priority-yield", type=int, default=4)
    parser.add_argument("--priority-preemption", action="store_true",
                        help="the server's --priority-preemption")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="the server's --max-num-batched-tokens (bounds one step: a W=256 decode is 256)")
    parser.add_argument("--bg-width-mix", default="64:0.5,256:0.5")
    parser.add_argument("--bg-num-prompts", type=int, default=24)
    parser.add_argument("--overload", type=float, default=1.2, help="background rate / its capacity")
    parser.add_argument("--fg-rate", type=float, default=0.5)
    parser.add_argument("--fg-num-prompts", type=int, default=16)
    parser.add_argument("--fg-output-len", type=int, default=32)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/priority_mix.json")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        tmp_dir = Path(tmp)
        port = free_port()
        proc = subprocess.Popen(
            start_server_command(
                port,
                args.model,
                args.dtype,
                args.kv_cache_memory,
                256,
                ["--priority-yield", str(args.priority_yield)]
                + (["--priority-preemption"] if args.priority_preemption else [])
                + (["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
                   if args.max_num_batched_tokens else []),
                replicas=0,
            ),
            stdout=open(tmp_dir / "server.log", "wb"),  # noqa: SIM115  (open while the server runs)
            stderr=subprocess.STDOUT,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            wait_ready(proc, url, tmp_dir / "server.log")
            genrec = [
                "--workload",
                "genrec",
                "--width-mix",
                args.bg_width_mix,
                "--prefix-words",
                "100",
                "--output-len",
                "4",
            ]
            bench(
                url,
                tmp_dir,
                "capacity",
                [*genrec, "--num-prompts", "8", "--request-rate", "inf", "--num-warmups", "1"],
            ).wait()
            capacity = result(tmp_dir, "capacity")["request_throughput"]
            fg_files = {}
            for priority in (0, -1):
                path = tmp_dir / f"fg{priority}.jsonl"
                path.write_text(
                    "".join(
                        json.dumps(
                            {
                                "prompt": text,
                                "max_tokens": args.fg_output_len,
                                "temperature": 0,
                                "ignore_eos": True,
                                "priority": priority,
                            }
                        )
                        + "\n"
                        for text in FG_PROMPTS
                    )
                )
                fg_files[priority] = path
            fg = [
                "--workload",
                "jsonl",
                "--num-prompts",
                str(args.fg_num_prompts),
                "--request-rate",
                str(args.fg_rate),
            ]
            bench(
                url, tmp_dir, "fg_alone", [*fg, "--dataset-path", str(fg_files[-1]), "--num-warmups", "1"]
            ).wait()
            runs = {}
            for name, priority in (("mixed_no_priority", 0), ("mixed_priority", -1)):
                background = bench(
                    url,
                    tmp_dir,
                    f"{name}_bg",
                    [
                        *genrec,
                        "--num-prompts",
                        str(args.bg_num_prompts),
                        "--request-rate",
                        str(capacity * args.overload),
                    ],
                )
                foreground = bench(
                    url, tmp_dir, f"{name}_fg", [*fg, "--dataset-path", str(fg_files[priority])]
                )
                foreground.wait()
                background.wait()
                runs[name] = {"fg": result(tmp_dir, f"{name}_fg"), "bg": result(tmp_dir, f"{name}_bg")}
            alone = result(tmp_dir, "fg_alone")
            pools = pools_after(url)
        finally:
            stop_server(proc)
    keys = (
        "completed",
        "failed",
        "rejected",
        "request_throughput",
        "median_e2el_ms",
        "p99_e2el_ms",
        "median_ttft_ms",
        "p99_ttft_ms",
        "median_tpot_ms",
        "p99_tpot_ms",
        "duration",
    )
    out = {
        "command": " ".join(sys.argv),
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "background_capacity_req_per_s": capacity,
        "fg_alone": {k: alone[k] for k in keys},
        **{name: {part: {k: r[k] for k in keys} for part, r in run.items()} for name, run in runs.items()},
        "pools_after": pools,
    }
    p99_alone = alone["p99_e2el_ms"]
    out["summary"] = {
        "fg_p99_over_alone_no_priority": runs["mixed_no_priority"]["fg"]["p99_e2el_ms"] / p99_alone,
        "fg_p99_over_alone_priority": runs["mixed_priority"]["fg"]["p99_e2el_ms"] / p99_alone,
        "bg_throughput_priority_over_no_priority": (
            runs["mixed_priority"]["bg"]["request_throughput"]
            / runs["mixed_no_priority"]["bg"]["request_throughput"]
        ),
        "none_lost": all(r[k]["completed"] + r[k]["rejected"] == n and r[k]["failed"] == 0
                         for r in runs.values() for k, n in (("fg", args.fg_num_prompts),
                                                              ("bg", args.bg_num_prompts))),
        "pools_whole": all(free == total for free, total in pools.values()),
    }
    args.out.write_text(json.dumps(out, indent=2))
    print(json.dumps(out["summary"], indent=2))


if __name__ == "__main__":
    main()
