"""The README's plan table (Llama-3-8B on a 141 GiB GPU, beam 256, prompt 4096, 1024 new tokens) is what
`widebeam plan` prints for that command: pinned here, so a change to the sizing or the cost model
that moves a figure must update the README too."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"
COMMAND = ["plan", "--model", "llama-3-8b", "--memory", "141GiB", "--beam-width", "256", "--prompt-len",
           "4096", "--max-new-tokens", "1024", "--json"]


def readme_rows() -> dict[str, tuple[int, int, bool, int]]:
    """model -> (max_seq_len, required blocks, fits, requests at once), from the README's table."""
    rows = {}
    for line in README.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0] in ("widebeam (shared prompt)", "naive (prompt x beam)"):
            max_seq_len, required, fits, at_once = cells[1:]
            rows[cells[0]] = (int(max_seq_len.replace(",", "")), int(required.replace(",", "")),
                              fits == "yes", int(at_once))
    return rows


def test_readme_plan_table_is_what_plan_prints():
    rows = readme_rows()
    assert set(rows) == {"widebeam (shared prompt)", "naive (prompt x beam)"}
    assert re.search(r"widebeam plan --model llama-3-8b --memory 141GiB --beam-width 256 \\\s+"
                     r"--prompt-len 4096 --max-new-tokens 1024", README.read_text())
    proc = subprocess.run([sys.executable, "-m", "widebeam", *COMMAND], capture_output=True, text=True,
                          timeout=120, check=True)
    plan = json.loads(proc.stdout)
    (pool,) = plan["pools"]
    assert rows["widebeam (shared prompt)"] == (plan["max_seq_len"], pool["required_blocks"], plan["fits"],
                                                plan["max_concurrent_requests"])
    naive = plan["naive"]
    assert rows["naive (prompt x beam)"] == (naive["max_seq_len"], naive["required_blocks"], naive["fits"],
                                             naive["max_concurrent_requests"])
