"""The results tables of the README and docs/benchmarks.md, from `widebeam bench` JSON files.

    python benchmarks/results_markdown.py benchmarks/results/beam_vs_hf.json [more.json ...]
    python benchmarks/results_markdown.py --peers benchmarks/results/bench_peers_{float32,int8}.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

GIB, MIB = 2**30, 2**20


def rows_to_markdown(points: list[dict]) -> str:
    lines = [
        ("| dtype | W | P | widebeam s | transformers s | speed-up | same best beam | beam-tokens/s wb / hf "
         "| peak RSS wb / hf (GiB) | KV held wb / hf (MiB) | wb x dense floor "
         "| wb x dense+attention floor |"),
        "|---|--:|--:|--:|--:|--:|:-:|--:|--:|--:|--:|--:|",
    ]
    for r in points:
        wb, hf = r["widebeam"], r["transformers"]
        ran = "wall_s" in hf
        lines.append(" | ".join([
            f"| {r['dtype']}", str(r["beam_width"]), str(r["prompt_len"]), f"{wb['wall_s']:.2f}",
            (f"{hf['wall_s']:.2f}" if ran
             else "skipped: " + hf["skipped"].split(" exceeds")[0].replace("its KV for ", "")),
            f"{r['speedup']:.1f}x" if ran else "-",
            ("yes" if r["same_best_sequence"] else "NO") if ran else "-",
            f"{wb['beam_tokens_per_s']:.0f} / " + (f"{hf['beam_tokens_per_s']:.0f}" if ran else "-"),
            f"{wb['peak_rss_bytes'] / GIB:.2f} / " + (f"{hf['peak_rss_bytes'] / GIB:.2f}" if ran else "-"),
            f"{wb['peak_kv_bytes'] / MIB:.0f} / " + (f"{hf['peak_kv_bytes'] / MIB:.0f}" if ran else "-"),
            f"{wb['x_compute_floor']:.2f}",
            (f"{wb['x_compute_and_attention_floor']:.2f} |" if "x_compute_and_attention_floor" in wb
             else "- |"),
        ]))
    return "\n".join(lines)


def peers_to_markdown(points: list[dict]) -> str:
    """widebeam against transformers and CTranslate2 (both compute types), one row per point."""
    lines = [
        ("| widebeam dtype | W | widebeam s | transformers s | CT2 float32 s | CT2 int8 s | vs transformers "
         "| vs CT2 float32 | vs CT2 int8 | same best as transformers | same best as CT2 f32 / int8 |"),
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|:-:|:-:|",
    ]
    for r in points:
        hf, f32, i8 = r["transformers"], r["ctranslate2 float32"], r["ctranslate2 int8"]
        yes = {True: "yes", False: "NO"}
        lines.append(" | ".join([
            f"| {r['dtype']}", str(r["beam_width"]), f"{r['widebeam']['wall_s']:.2f}", f"{hf['wall_s']:.2f}",
            f"{f32['wall_s']:.2f}", f"{i8['wall_s']:.2f}", f"{r['speedup']:.2f}x",
            f"{f32['widebeam_speedup']:.2f}x", f"{i8['widebeam_speedup']:.2f}x", yes[r["same_best_sequence"]],
            f"{yes[f32['same_best_sequence']]} / {yes[i8['same_best_sequence']]} |",
        ]))
    return "\n".join(lines)


if __name__ == "__main__":
    peers = sys.argv[1] == "--peers"
    points = [p for path in sys.argv[1 + peers:] for p in json.loads(Path(path).read_text())["points"]]
    print(peers_to_markdown(points) if peers else rows_to_markdown(points))
