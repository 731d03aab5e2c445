"""The generative-retrieval benchmark's report (benchmarks/genrec.py): its table, in the terminal and
as markdown, and the targets it checks."""

from __future__ import annotations

from tables import markdown_table, print_table

from widebeam.units import format_bytes

GIB, MIB = 2**30, 2**20


def size_label(n: int) -> str:
    if n >= 1_000_000 and n % 1_000_000 == 0:
        return f"{n // 1_000_000}M"
    if n >= 1000 and n % 1000 == 0:
        return f"{n // 1000}k"
    return str(n)


HEADERS = ["P", "W", "catalogue", "trie MiB", "build s", "constrained s", "unconstrained s", "c / u",
           "items/s", "invalid", "peak KV blocks (MiB)", "peak RSS GiB", "constraint % wall / decode",
           "transformers s", "speed-up", "same best item"]


def fmt_row(r: dict) -> list[str]:
    c, u, cat = r["constrained"], r["unconstrained"], r["catalogue"]
    hf = r.get("transformers")
    if hf is None:
        hf_s, speedup, same = "-", "-", "-"
    elif "skipped" in hf:
        hf_s, speedup, same = "skipped", "-", "-"
    else:
        hf_s, speedup = f"{hf['wall_s']:.1f}", f"{r['speedup']:.0f}x"
        same = "yes" if r["same_best_item"] else "NO"
    share_d = c["constraint_share_of_decode"]
    return [str(r["prompt_len"]), str(r["beam_width"]), size_label(cat["items_drawn"]),
            f"{cat['bytes'] / MIB:.1f}", f"{cat['build_s']:.2f}", f"{c['wall_s']:.2f}", f"{u['wall_s']:.2f}",
            f"{r['constrained_over_unconstrained']:.3f}", f"{c['items_per_s']:.1f}", str(c["invalid"]),
            f"{c['peak_blocks']} ({c['peak_kv_bytes'] / MIB:.0f})",
            f"{c['peak_rss_bytes'] / GIB:.2f}" if c["peak_rss_bytes"] else "-",
            (f"{100 * c['constraint_share_of_wall']:.1f} / {100 * share_d:.1f}" if share_d is not None
             else "-"),
            hf_s, speedup, same]


ALIGNS = "rrl" + "r" * 12 + "c"


def markdown(rows: list[dict]) -> str:
    return markdown_table(HEADERS, [fmt_row(r) for r in rows], ALIGNS)


def styled(r: dict) -> list[str]:
    cells = fmt_row(r)
    if cells[9] != "0":
        cells[9] = f"[bold red]{cells[9]}[/]"
    if cells[15] == "NO":
        cells[15] = "[bold red]NO[/]"
    return cells


def print_results(rows: list[dict]) -> None:
    print_table("generative retrieval: constrained vs unconstrained widebeam vs transformers (same run)",
                HEADERS, [styled(r) for r in rows], ALIGNS, width=200, plain_rows=[fmt_row(r) for r in rows])


def evaluate_targets(rows: list[dict], kv_budget: int) -> list[dict]:
    targets = []
    hf_rows = [r for r in rows if r["beam_width"] == 64 and r["prompt_len"] == 1024
               and "wall_s" in (r.get("transformers") or {})]
    targets.append({"target": ">= 80x transformers (prefix_allowed_tokens_fn) at W=64, P=1,024",
                    "measured": [{"catalogue": size_label(r["catalogue"]["items_drawn"]),
                                  "speedup": round(r["speedup"], 1)} for r in hf_rows],
                    "hit": bool(hf_rows) and all(r["speedup"] >= 80 for r in hf_rows) if hf_rows else None})
    slow_rows = [r for r in rows if r["beam_width"] == 256 and r["catalogue"]["items_drawn"] == 1_000_000]
    targets.append({"target": "constrained at most 5% slower than unconstrained at 1M items, W=256",
                    "measured": [{"prompt_len": r["prompt_len"], "constrained_over_unconstrained":
                                  round(r["constrained_over_unconstrained"], 3)} for r in slow_rows],
                    "hit": (all(r["constrained_over_unconstrained"] <= 1.05 for r in slow_rows) if slow_rows
                            else None)})
    wide = [r for r in rows if r["beam_width"] == 1024 and r["prompt_len"] == 2048]
    targets.append({"target": f"W=1,024 over a 2,048-token prompt within a {format_bytes(kv_budget)} "
                              "KV budget",
                    "measured": [{"catalogue": size_label(r["catalogue"]["items_drawn"]),
                                  "peak_kv_bytes": r["constrained"]["peak_kv_bytes"],
                                  "peak_kv": format_bytes(r["constrained"]["peak_kv_bytes"]),
                                  "returned": r["constrained"]["returned"],
                                  "invalid": r["constrained"]["invalid"]}
                                 for r in wide],
                    "hit": all(r["constrained"]["peak_kv_bytes"] <= kv_budget
                               and r["constrained"]["returned"] > 0
                               and r["constrained"]["invalid"] == 0 for r in wide) if wide else None})
    targets.append({"target": "no invalid item returned (every point, widebeam and transformers)",
                    "measured": sum(r["constrained"]["invalid"] for r in rows)
                    + sum(r["transformers"].get("invalid", 0) for r in rows if r.get("transformers")),
                    "hit": all(r["constrained"]["invalid"] == 0 for r in rows)
                    and all(r["transformers"].get("invalid", 0) == 0 for r in rows if r.get("transformers"))})
    return targets
