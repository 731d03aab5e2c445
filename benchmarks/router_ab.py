"""Exact-fit routing against Ray Serve's default router: the same open-loop load on two replicas.

    python benchmarks/router_ab.py --rounds 2 --request-rate 2 --num-prompts 60 \
        --width-mix 1:0.4,16:0.3,64:0.2,256:0.1 --kv-cache-memory 96MiB

Each round starts `widebeam serve --replicas 2 --router R` (one CPU slot per replica, a small KV pool
each) for R in both orders (exact-fit first in odd rounds), sends the same `widebeam bench serve` genrec
load (same seed: the same requests at the same times) and stops it, so the two routers alternate on the
same machine. Per router: requests that met the objective per second (goodput), p99 end-to-end
latency, completed / rejected / failed, and, behind the exact-fit router, how many requests the
replicas themselves refused (never-fit requests refused at the door never reach one). Writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
ROUTERS = ("exact-fit", "serve")
OBJECTIVES_MS = (1000, 2000, 3000, 5000, 10000)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server_command(
    port: int,
    model: str,
    dtype: str,
    kv_cache_memory: str,
    max_beam_width: int,
    extra: list[str],
    replicas: int = 2,
) -> list[str]:
    """`widebeam serve` on loopback; `replicas` 0: one engine in the server process."""
    replica_args = ["--replicas", str(replicas), "--cpus-per-replica", "1"] if replicas else []
    return [
        sys.executable,
        "-m",
        "widebeam",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--model",
        model,
        *replica_args,
        "--kv-cache-memory",
        kv_cache_memory,
        "--max-beam-width",
        str(max_beam_width),
        "--dtype",
        dtype,
        "--log-level",
        "warning",
        *extra,
    ]


def wait_ready(proc: subprocess.Popen, url: str, log_path: Path, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited:\n{log_path.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("server not ready")


def start_server(router: str, args, log_path: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = start_server_command(
        port,
        args.model,
        args.dtype,
        args.kv_cache_memory,
        args.max_beam_width,
        ["--router", router, *args.server_args],
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    proc = subprocess.Popen(command, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT, env=env)  # noqa: SIM115
    url = f"http://127.0.0.1:{port}"
    wait_ready(proc, url, log_path)
    return proc, url


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


def replica_rejections(url: str) -> float | None:
    """Requests the replicas refused themselves (the exact-fit router's /metrics sums them)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    match = re.search(r'^widebeam_requests_rejected_total\{replica="all"\} (\S+)$', text, re.MULTILINE)
    return float(match.group(1)) if match else None


def bench_serve(url: str, out_dir: Path, name: str, extra: list[str],
                quiet: bool = False) -> subprocess.Popen:
    """`widebeam bench serve` against `url` (started, not waited for), its result in `out_dir/name.json`."""
    command = [sys.executable, "-m", "widebeam", "bench", "serve", "--base-url", url, "--disable-tqdm",
               "--save-result", "--result-dir", str(out_dir), "--result-filename", f"{name}.json", *extra]
    return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL if quiet else None)


def pools_after(url: str) -> dict[str, list[int]]:
    """Each pool's [free, total] blocks from /v1/stats (cached blocks no request holds count as free):
    after a run, free == total says every request gave its blocks back."""
    stats = httpx.get(f"{url}/v1/stats", timeout=30).json()
    return {name: [pool["free_blocks"], pool["total_blocks"]] for name, pool in stats["pools"].items()}


def load_result(out_dir: Path, name: str) -> dict:
    data = json.loads((out_dir / f"{name}.json").read_text())
    return data["runs"][0] if "runs" in data else data  # one run: vLLM's flat result


def run_load(url: str, args, out_dir: Path, name: str) -> dict:
    extra = ["--workload", "genrec", "--width-mix", args.width_mix, "--num-prompts", str(args.num_prompts),
             "--request-rate", str(args.request_rate), "--seed", str(args.seed), "--num-warmups", "2",
             "--output-len", str(args.output_len), "--prefix-words", str(args.prefix_words),
             "--goodput", *args.goodput, *args.load_args]
    if bench_serve(url, out_dir, name, extra).wait():
        raise RuntimeError(f"widebeam bench serve failed for {name}")
    return load_result(out_dir, name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kv-cache-memory", default="96MiB", help="per replica")
    parser.add_argument("--max-beam-width", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--request-rate", type=float, default=1.0)
    parser.add_argument("--num-prompts", type=int, default=60)
    parser.add_argument("--width-mix", default="1:0.4,16:0.3,64:0.2,256:0.1")
    parser.add_argument("--output-len", type=int, default=4)
    parser.add_argument("--prefix-words", type=int, default=100)
    parser.add_argument("--goodput", nargs="+", default=["e2el:20000"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--server-args", nargs=argparse.REMAINDER, default=[])
    parser.add_argument("--load-args", nargs="*", default=[])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/router_ab.json")
    args = parser.parse_args()

    runs: dict[str, list[dict]] = {router: [] for router in ROUTERS}
    with tempfile.TemporaryDirectory() as tmp:
        tmp_dir = Path(tmp)
        for round_index in range(args.rounds):
            order = ROUTERS if round_index % 2 == 0 else ROUTERS[::-1]
            for router in order:
                proc, url = start_server(router, args, tmp_dir / f"{router}-{round_index}.log")
                try:
                    result = run_load(url, args, tmp_dir, f"{router}-{round_index}")
                    result["replica_rejections"] = replica_rejections(url) if router == "exact-fit" else None
                finally:
                    stop_server(proc)
                # goodput at a grid of end-to-end objectives, from the same requests' latencies
                result["goodput_at_e2el_ms"] = {
                    ms: sum(1 for e2el_s in result["e2els"] if e2el_s * 1000 <= ms) / result["duration"]
                    for ms in OBJECTIVES_MS
                }
                keep = {
                    k: result[k]
                    for k in (
                        "completed",
                        "failed",
                        "rejected",
                        "rejected_by_status",
                        "duration",
                        "request_throughput",
                        "request_goodput",
                        "p99_e2el_ms",
                        "median_e2el_ms",
                        "mean_e2el_ms",
                        "beams_per_s",
                        "replica_rejections",
                        "goodput_at_e2el_ms",
                    )
                }
                runs[router].append({"round": round_index, **keep})
                print(router, round_index, json.dumps(keep), flush=True)
    summary = {
        router: {
            "goodput_median": statistics.median(r["request_goodput"] for r in rs),
            "p99_e2el_ms_median": statistics.median(r["p99_e2el_ms"] for r in rs),
            "goodput_at_e2el_ms": {
                ms: statistics.median(r["goodput_at_e2el_ms"][ms] for r in rs) for ms in OBJECTIVES_MS
            },
        }
        for router, rs in runs.items()
    }
    summary["goodput_ratio_at_e2el_ms"] = {
        ms: (
            summary["exact-fit"]["goodput_at_e2el_ms"][ms]
            / max(summary["serve"]["goodput_at_e2el_ms"][ms], 1e-9)
        )
        for ms in OBJECTIVES_MS
    }
    baseline = max(summary["serve"]["goodput_median"], 1e-9)
    summary["goodput_ratio"] = summary["exact-fit"]["goodput_median"] / baseline
    out = {
        "command": " ".join(sys.argv),
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "runs": runs,
        "summary": summary,
    }
    args.out.write_text(json.dumps(out, indent=2, default=str))
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
