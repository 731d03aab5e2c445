"""Overload at a multiple of capacity: the waiting queue stays within its bound, the rest are told 429 with
Retry-After, nothing fails, and every completed answer is the one the same request gets alone.

    python benchmarks/overload.py --overload 3

One `widebeam serve` with `--max-waiting-requests B`. First its capacity on the workload (genrec beam
searches over a shared prefix, widths from `--width-mix`): requests per second with B requests in flight
(a closed loop at the bound, so nothing is refused). Then an open-loop run (`widebeam bench serve`'s
runner) at `--overload` times that rate while a poller reads `/v1/stats` every 50 ms (the queue's depth).
Then each completed request is sent again, alone, and its beams compared with the answer it got under
load. Reported: completed / rejected (429, with and without Retry-After) / failed (5xx, timeouts, cut
streams), the deepest queue seen against the bound, the answers equal to alone, the pools after. Writes
JSON.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
from router_ab import free_port, pools_after, start_server_command, stop_server, wait_ready

from widebeam.bench_serve.records import Outcome
from widebeam.bench_serve.runner import RunConfig, run
from widebeam.bench_serve.workloads import WorkloadConfig, build_requests

ROOT = Path(__file__).resolve().parent.parent


class QueuePoller(threading.Thread):
    """Reads /v1/stats every `period_s`: the deepest waiting queue and the most refusals seen."""

    def __init__(self, url: str, period_s: float = 0.05):
        super().__init__(daemon=True)
        self.url, self.period_s = url, period_s
        self.max_waiting = 0
        self.num_samples = 0
        self._done = threading.Event()

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=5.0) as client:
            while not self._done.is_set():
                stats = client.get("/v1/stats").json()
                self.max_waiting = max(self.max_waiting, stats["waiting"])
                self.num_samples += 1
                time.sleep(self.period_s)

    def stop(self) -> None:
        self._done.set()
        self.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kv-cache-memory", default="128MiB")
    parser.add_argument("--max-waiting-requests", type=int, default=8)
    parser.add_argument("--width-mix", default="4:0.5,16:0.5")
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--overload", type=float, default=3.0, help="the offered rate / capacity")
    parser.add_argument("--num-prompts", type=int, default=120, help="requests in the overload run")
    parser.add_argument("--capacity-prompts", type=int, default=24)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/overload.json")
    args = parser.parse_args()

    def workload(num: int, seed: int):
        return build_requests(WorkloadConfig(workload="genrec", num_requests=num, seed=seed,
                                             width_mix=args.width_mix, output_len=args.output_len,
                                             prefix_num_words=100))

    with tempfile.TemporaryDirectory() as tmp:
        log_path = Path(tmp) / "server.log"
        port = free_port()
        proc = subprocess.Popen(
            start_server_command(port, args.model, args.dtype, args.kv_cache_memory, 64,
                                 ["--max-waiting-requests", str(args.max_waiting_requests)], replicas=0),
            stdout=open(log_path, "wb"),  # noqa: SIM115  (open while the server runs)
            stderr=subprocess.STDOUT,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            wait_ready(proc, url, log_path)
            quiet = {"show_progress": False}
            run(workload(2, seed=99), RunConfig(url, **quiet))  # warm-up
            capacity_run = run(workload(args.capacity_prompts, seed=1),
                               RunConfig(url, max_concurrency=args.max_waiting_requests, **quiet))
            assert all(r.outcome is Outcome.COMPLETED for r in capacity_run.records), "capacity run refused"
            capacity = len(capacity_run.records) / capacity_run.duration_s
            rate = args.overload * capacity
            poller = QueuePoller(url)
            poller.start()
            loaded = run(workload(args.num_prompts, seed=2),
                         RunConfig(url, request_rate=rate, seed=2, **quiet))
            poller.stop()
            records = loaded.records
            completed = [r for r in records if r.outcome is Outcome.COMPLETED]
            # each completed request again, alone
            alone = [run([r.spec], RunConfig(url, **quiet)).records[0] for r in completed]
            equal = sum(a.outcome is Outcome.COMPLETED and a.choice_texts == r.choice_texts
                        for r, a in zip(completed, alone, strict=True))
            stats = httpx.get(f"{url}/v1/stats").json()
            pools = pools_after(url)
        finally:
            stop_server(proc)

    rejected = [r for r in records if r.outcome is Outcome.REJECTED]
    failed = [r for r in records if r.outcome is Outcome.FAILED]
    out = {
        "command": " ".join(sys.argv),
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "capacity_req_per_s": capacity,
        "offered_req_per_s": rate,
        "offered_over_capacity": rate / capacity,
        "requests": len(records),
        "completed": len(completed),
        "rejected": len(rejected),
        "rejected_by_status": dict(Counter(str(r.http_status) for r in rejected)),
        "rejected_429_without_retry_after": sum(r.http_status == 429 and not r.retry_after for r in rejected),
        "retry_after_values_s": sorted({r.retry_after for r in rejected if r.retry_after}),
        "failed": len(failed),
        "failed_5xx": sum((r.http_status or 0) >= 500 for r in failed),
        "failed_reasons": dict(Counter(r.reason for r in failed)),
        "max_waiting_seen": poller.max_waiting,
        "max_waiting_requests": args.max_waiting_requests,
        "queue_samples": poller.num_samples,
        "completed_equal_to_alone": equal,
        "completed_throughput_req_per_s": len(completed) / loaded.duration_s,
        "duration_s": loaded.duration_s,
        "pools_after": pools,
        "queue_refused_counted": stats["queue"]["refused"],
    }
    args.out.write_text(json.dumps(out, indent=2))
    print(json.dumps({k: v for k, v in out.items() if k not in ("command", "settings")}, indent=2))


if __name__ == "__main__":
    main()
