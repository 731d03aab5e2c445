"""Tables and provenance for runner_throughput.py: the rich report, speed-up ratios, the source
fingerprint and CPU facts recorded beside the figures."""

from __future__ import annotations

import hashlib
import platform
from datetime import UTC, datetime
from pathlib import Path

from rich.console import Console
from rich.table import Table

REPO_ROOT = Path(__file__).resolve().parent.parent


def fmt(value: float | None, spec: str = ",.1f") -> str:
    return "-" if value is None else format(value, spec)


def share(cpu: dict) -> str:
    """Other processes' CPU during a measurement, as a share of the whole machine (! = still contended)."""
    value = cpu.get("other_cpu_share")
    if value is None:
        return "-"
    tries = f" ({cpu['attempts']} tries)" if cpu.get("attempts", 1) > 1 else ""
    return f"{100 * value:.0f}%{tries}{' !' if cpu.get('contended') else ''}"


def speedups(results: dict, base: str, other: str) -> dict:
    comparison: dict = {"baseline": base, "other": other, "prefill": {}, "decode": {}}
    if base not in results or other not in results:
        return comparison
    for phase in ("prefill", "decode"):
        for batch, row in results[base][phase].items():
            other_row = results[other][phase].get(batch)
            if other_row:
                comparison[phase][batch] = other_row["tokens_per_s"] / row["tokens_per_s"]
    return comparison


def print_report(report: dict, console: Console) -> None:
    meta, results = report["meta"], report["results"]
    table = Table(title=f"widebeam runner throughput: {meta['model']} on CPU, {meta['threads']} threads, "
                        f"torch {meta['torch_version']}")
    table.add_column("dtype")
    table.add_column("cached load s", justify="right")
    batches = [str(b) for b in meta["batch_sizes"]]
    for b in batches:
        table.add_column(f"prefill tok/s B={b}", justify="right")
    for b in batches:
        table.add_column(f"decode tok/s B={b}", justify="right")
    for dtype, r in results.items():
        table.add_row(dtype, fmt(r["cached_load_s"], ".2f"),
                      *[fmt(r["prefill"][b]["tokens_per_s"]) for b in batches],
                      *[fmt(r["decode"][b]["tokens_per_s"]) for b in batches])
    comparison = report.get("comparison") or {}
    if comparison.get("prefill"):
        table.add_row(f"{comparison['other']}/{comparison['baseline']}", "",
                      *[fmt(comparison["prefill"].get(b), ".2f") + "x" for b in batches],
                      *[fmt(comparison["decode"].get(b), ".2f") + "x" for b in batches])
    console.print(table)

    detail = Table(title="configurations")
    for col in ("dtype", "phase", "B", "prompt/context", "seconds", "tok/s", "per step ms (med/min/max)",
                "host bookkeeping", "other procs' CPU", "notes"):
        detail.add_column(col)
    for dtype, r in results.items():
        for b, row in r["prefill"].items():
            detail.add_row(dtype, "prefill", b, str(row["prompt_len"]),
                           f"{row['median_s']:.3f} (median of {row['repeats']})", fmt(row["tokens_per_s"]),
                           "", f"{row['bookkeeping_s_median'] * 1e3:.1f} ms", share(row["cpu"]),
                           "; ".join(row["notes"]))
        for b, row in r["decode"].items():
            detail.add_row(dtype, "decode", b, f"{row['context_start']}->{row['context_end']}",
                           f"{row['total_s']:.3f} ({row['steps']} steps)", fmt(row["tokens_per_s"]),
                           f"{row['step_ms_median']:.1f}/{row['step_ms_min']:.1f}/{row['step_ms_max']:.1f}",
                           f"{row['bookkeeping_ms_per_step']:.2f} ms/step", share(row["cpu"]),
                           "; ".join(row["notes"]))
    console.print(detail)

    loads = report.get("load")
    if loads:
        t = Table(title="load (float32, separate processes)")
        for col in ("cache", "import s", "LLM(...) s", "process wall s", "other procs' CPU"):
            t.add_column(col)
        for name, key in (("empty (GGUF conversion)", "fresh_cache"), ("warm", "warm_cache_fresh_process")):
            row = loads[key]
            t.add_row(name, f"{row['import_s']:.2f}", f"{row['construct_s']:.2f}",
                      f"{row['process_wall_s']:.2f}", share(row["cpu"]))
        console.print(t)

    for dtype, r in results.items():
        for b, prof in r["profile"].items():
            tp = prof["torch_profiler"]
            t = Table(title=f"{dtype} decode B={b}: top ops by self CPU time (torch.profiler, "
                            f"{prof['steps']} steps, context {prof['context_start']}+, "
                            f"{tp['self_cpu_total_ms']:.0f} ms self in all, other processes "
                            f"{share(prof['cpu'])} of the CPUs)")
            for col in ("op", "self ms", "self %", "calls"):
                t.add_column(col)
            for row in tp["top_ops"]:
                t.add_row(row["op"], f"{row['self_cpu_ms']:.1f}", f"{row['self_pct']:.1f}", str(row["calls"]))
            console.print(t)
            cp = prof["cprofile"]
            t = Table(title=f"{dtype} decode B={b}: top functions by self time (cProfile, "
                            f"{prof['steps']} steps, {cp['self_total_ms']:.0f} ms in all)")
            for col in ("function", "self ms", "self %", "calls"):
                t.add_column(col)
            for row in cp["top_functions"]:
                t.add_row(row["function"], f"{row['self_ms']:.1f}", f"{row['self_pct']:.1f}",
                          str(row["calls"]))
            console.print(t)


def source_fingerprint() -> dict:
    """sha256 over widebeam/**/*.py (the figures belong to this exact source), and the newest mtime."""

    digest, newest = hashlib.sha256(), 0.0
    for path in sorted((REPO_ROOT / "widebeam").rglob("*.py")):
        digest.update(str(path.relative_to(REPO_ROOT)).encode() + b"\0" + path.read_bytes())
        newest = max(newest, path.stat().st_mtime)
    return {"widebeam_sources_sha256": digest.hexdigest()[:16],
            "widebeam_newest_mtime": datetime.fromtimestamp(newest, UTC).isoformat(timespec="seconds")}


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def cpu_flags() -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return sorted(f for f in line.split(":", 1)[1].split()
                                  if f.startswith(("avx512_bf16", "avx512f", "amx", "avx2", "avx_vnni")))
    except OSError:
        pass
    return []
