"""Result tables shared by the benchmark scripts: markdown for benchmarks/results/*.md and the README,
and a rich table on the terminal (cells may carry rich markup there, never in markdown)."""

from __future__ import annotations

from collections.abc import Sequence

_MARKDOWN_ALIGN = {"l": "---", "r": "--:", "c": ":-:"}
_RICH_JUSTIFY = {"l": "left", "r": "right", "c": "center"}


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]], aligns: str) -> str:
    """`aligns`: one of l / r / c per column."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(_MARKDOWN_ALIGN[a] for a in aligns) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[str]], aligns: str,
                width: int = 150, plain_rows: Sequence[Sequence[str]] | None = None) -> None:
    """A rich table of `rows` (markup allowed); without rich, the markdown of `plain_rows` (or `rows`)."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(markdown_table(headers, plain_rows or rows, aligns))
        return
    table = Table(title=title)
    for header, align in zip(headers, aligns):
        table.add_column(header, justify=_RICH_JUSTIFY[align])
    for row in rows:
        table.add_row(*row)
    Console(width=max(Console().width, width)).print(table)


def machine_info(threads: int) -> dict:
    """What the numbers were measured on: CPU model and count, torch threads and version, platform."""
    import os
    import platform

    import torch

    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    return {"cpu_count": os.cpu_count(), "cpu": cpu, "torch_threads": torch.get_num_threads(),
            "threads_requested": threads, "torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform()}
