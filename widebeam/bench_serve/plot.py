"""A rate sweep's picture: latency percentiles and goodput against request rate, one line per server, to a
PNG beside the JSON. An infinite rate (all at once) is drawn at the right edge, past the finite ones."""

from __future__ import annotations

import math
from pathlib import Path


def _x_positions(rates: list[float]) -> tuple[dict[float, float], list[str]]:
    finite = sorted({r for r in rates if math.isfinite(r)})
    edge = (finite[-1] * 1.25 if finite else 1.0)
    positions = {r: r for r in finite}
    labels = [f"{r:g}" for r in finite]
    if any(math.isinf(r) for r in rates):
        positions[float("inf")] = edge
        labels.append("inf")
    return positions, labels


def plot_sweep(runs: list[dict], path: Path, percentiles: list[float]) -> Path | None:
    """`runs`: result dicts with `base_url` and `request_rate`. Returns the PNG's path, or None without
    matplotlib."""
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed: no plot ({path}); pip install matplotlib")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from widebeam.bench_serve.metrics import percentile_key

    positions, labels = _x_positions([r["request_rate"] for r in runs])
    fig, (latency_ax, rate_ax) = plt.subplots(1, 2, figsize=(11, 4))
    servers = list(dict.fromkeys(r["base_url"] for r in runs))
    for server in servers:
        rows = sorted((r for r in runs if r["base_url"] == server),
                      key=lambda r: positions[r["request_rate"]])
        xs = [positions[r["request_rate"]] for r in rows]
        tag = f" {server}" if len(servers) > 1 else ""
        # a beam answer's TTFT is its e2el (it arrives whole): distinct markers keep both visible
        for metric, marker in (("ttft", "s"), ("e2el", "o")):
            for key, style in [("median", ":"), *((percentile_key(p), "-") for p in percentiles)]:
                ys = [r.get(f"{key}_{metric}_ms") for r in rows]
                if any(y is not None for y in ys):
                    latency_ax.plot(xs, [math.nan if y is None else y for y in ys], style, marker=marker,
                                    fillstyle="none" if metric == "ttft" else "full",
                                    label=f"{key} {metric}{tag}")
        rate_ax.plot(xs, [r["request_throughput"] for r in rows], "-", marker="o", label=f"completed/s{tag}")
        if any(r.get("request_goodput") is not None for r in rows):
            rate_ax.plot(xs, [r["request_goodput"] or 0 for r in rows], "--", marker="s",
                         label=f"goodput/s{tag}")
        rate_ax.plot(xs, [r["rejected"] / r["duration"] for r in rows], ":", marker="x",
                     label=f"rejected/s{tag}")
    for ax in (latency_ax, rate_ax):
        ax.set_xticks(sorted(positions.values()), labels)
        ax.set_xlabel("request rate (requests/s)")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    latency_ax.set_ylabel("latency (ms)")
    latency_ax.set_yscale("log")
    rate_ax.set_ylabel("requests/s")
    fig.suptitle(f"widebeam bench serve: {runs[0].get('workload', '')}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
