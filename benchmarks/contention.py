"""Telling a measurement from a machine busy with other work: CPU time other processes used during
a timed section (from /proc/stat minus our own getrusage), waiting for an idle machine, retrying
disturbed measurements. Used by runner_throughput.py.
"""

from __future__ import annotations

import argparse
import os
import resource
import time

from rich.console import Console


def _system_busy_s() -> float | None:
    """CPU seconds all processes have spent busy since boot (from /proc/stat), or None off Linux."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(v) for v in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """How much CPU other processes took while a measurement ran (the benchmark assumes an idle host)."""

    @staticmethod
    def _own_cpu_s() -> float:
        # This process (all threads) and its waited-for children (the load subprocesses).
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        return time.process_time() + children.ru_utime + children.ru_stime

    def __enter__(self) -> CpuMeter:  # noqa: PYI034
        self.busy0, self.own0, self.wall0 = _system_busy_s(), self._own_cpu_s(), time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        busy1 = _system_busy_s()
        self.wall_s = time.perf_counter() - self.wall0
        self.own_cpu_s = self._own_cpu_s() - self.own0
        self.other_cpu_s = None if busy1 is None else max(busy1 - self.busy0 - self.own_cpu_s, 0.0)

    @property
    def other_share(self) -> float | None:
        """Other processes' CPU as a share of the whole machine over the measurement."""
        if self.other_cpu_s is None:
            return None
        return self.other_cpu_s / max(self.wall_s * (os.cpu_count() or 1), 1e-9)

    def as_dict(self) -> dict:
        return {"wall_s": self.wall_s, "own_cpu_s": self.own_cpu_s, "other_cpu_s": self.other_cpu_s,
                "other_cpu_share": self.other_share}


def spare_cpus(args: argparse.Namespace) -> int:
    """CPUs the benchmark's threads leave to others: work there does not disturb it."""
    return max((os.cpu_count() or 1) - args.threads, 0)


def contended(meter: CpuMeter, args: argparse.Namespace) -> bool:
    """Whether other processes took more than the spare CPUs plus --max-other-share of all CPUs
    during `meter`, allowing for /proc/stat's coarse ticks (two of them) on short measurements."""
    if meter.other_cpu_s is None:
        return False
    slack = 2.0 / os.sysconf("SC_CLK_TCK")
    allowed = (spare_cpus(args) + args.max_other_share * (os.cpu_count() or 1)) * meter.wall_s
    return meter.other_cpu_s > allowed + slack


def measured(args: argparse.Namespace, console: Console, label: str, fn, before_retry=None):
    """Run `fn()` on a quiet machine; if other processes took more than --max-other-share of the CPUs
    meanwhile, wait and measure again (at most --retries times). Returns (fn's result, cpu record):
    the record holds every attempt and `contended` when even the last one was disturbed."""
    attempts = []
    for attempt in range(args.retries + 1):
        idle = wait_for_idle(args.idle_wait_s, idle_threshold(args), console)
        with CpuMeter() as meter:
            result = fn()
        attempts.append({**meter.as_dict(), "idle_wait": idle})
        disturbed = contended(meter, args)
        if not disturbed:
            break
        if attempt < args.retries:
            console.log(f"[yellow]{label}: other processes took {meter.other_share:.0%} of the CPUs; "
                        "measuring again[/]")
            if before_retry is not None:
                before_retry(result)
    if disturbed:
        console.log(f"[red]{label}: still contended ({meter.other_share:.0%} of the CPUs) after "
                    f"{args.retries} retries[/]")
    return result, {**attempts[-1], "attempts": len(attempts), "contended": disturbed,
                    "discarded_attempts": attempts[:-1]}


def idle_threshold(args: argparse.Namespace) -> float:
    """'Quiet enough': --idle-threshold of all CPUs busy, plus the spare CPUs."""
    return args.idle_threshold + spare_cpus(args) / (os.cpu_count() or 1)


def wait_for_idle(max_wait_s: float, threshold: float, console: Console) -> dict:
    """Wait (up to max_wait_s) until the other processes use under `threshold` of the machine's CPUs
    over one second; return what was seen."""
    started = time.perf_counter()
    share = None
    while True:
        busy0 = _system_busy_s()
        if busy0 is None:
            return {"waited_s": 0.0, "busy_share": None}
        time.sleep(1.0)
        share = (_system_busy_s() - busy0) / (os.cpu_count() or 1)
        waited = time.perf_counter() - started
        if share < threshold or waited >= max_wait_s:
            if waited > 2:
                console.log(f"waited {waited:.0f} s for an idle machine (busy share now {share:.0%})")
            return {"waited_s": waited, "busy_share": share}
