"""Side by side in one process: each repeat runs every contender, the order reversed every other repeat
(load drift favours none), each keeps its best time after one warm-up repeat. Shared by
benchmarks/ab_revision.py (two revisions) and benchmarks/kv_dtype_ab.py (KV dtypes)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping


def best_times(runs: Mapping[str, Callable[[], object]], repeats: int) -> tuple[dict[str, float], dict]:
    """(each contender's best seconds over `repeats` after a warm-up, each one's last result)."""
    best = dict.fromkeys(runs, float("inf"))
    results: dict = {}
    for repeat in range(repeats + 1):  # repeat 0 warms every contender up
        order = list(runs.items()) if repeat % 2 == 0 else list(reversed(runs.items()))
        for name, run in order:
            start = time.perf_counter()
            results[name] = run()
            elapsed = time.perf_counter() - start
            if repeat:
                best[name] = min(best[name], elapsed)
    return best, results
