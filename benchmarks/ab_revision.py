"""A/B in one process: this working tree's engine against a git revision's, on the same prompt.

    python benchmarks/ab_revision.py --base 360dfa0 --widths 1 16 64 --repeats 7

The machine's speed drifts with the host's load, so two `widebeam bench` runs minutes apart can
differ by more than a change does. Here both engines live in one process and alternate every
repeat (the order flips each time); each keeps its best time after a warm-up. The base revision is
exported with `git archive` and its package renamed (`widebeam` -> `widebeam_base`) so the two
import side by side. Beam search with `min_new_tokens = N`: every beam runs the full length, and
the best beams must be equal. Writes benchmarks/results/ab_revision.json.
"""

from __future__ import annotations

import argparse
import io
import json
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import torch
from interleaved import best_times

ROOT = Path(__file__).resolve().parent.parent


def export_renamed(revision: str, into: Path) -> None:
    """`revision`'s widebeam/ under `into`/widebeam_base, every import of widebeam renamed."""
    archive = subprocess.run(["git", "archive", revision, "widebeam"], cwd=ROOT, check=True,
                             capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    package = into / "widebeam_base"
    (into / "widebeam").rename(package)
    pattern = re.compile(r"\bwidebeam(?=[.\s]|$)", re.MULTILINE)
    for path in package.rglob("*.py"):
        path.write_text(pattern.sub("widebeam_base", path.read_text()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="git revision to compare against")
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/ab_revision.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        export_renamed(args.base, Path(tmp))
        sys.path.insert(0, tmp)
        import widebeam_base  # its lazy `LLM`: the class moved from engine.py to llm.py in #29
        import widebeam_base.params as base_params

        from widebeam.llm import LLM
        from widebeam.params import BeamSearchParams

        engines = {"base": (widebeam_base.LLM(kv_cache_memory="1GiB"), base_params.BeamSearchParams),
                   "new": (LLM(kv_cache_memory="1GiB"), BeamSearchParams)}
        prompt = {"prompt_token_ids": [(i * 7919) % 40000 + 100 for i in range(args.prompt_len)]}
        rows = []
        for width in args.widths:
            runs = {}
            for name, (llm, params_class) in engines.items():
                params = params_class(beam_width=width, max_new_tokens=args.max_new_tokens,
                                      min_new_tokens=args.max_new_tokens)
                runs[name] = lambda llm=llm, params=params: llm.generate(prompt, params, use_tqdm=False)
            best, outputs = best_times(runs, args.repeats)
            beams = {name: out[0].outputs[0].token_ids for name, out in outputs.items()}
            row = {"beam_width": width, "base_s": round(best["base"], 3), "new_s": round(best["new"], 3),
                   "new_over_base": round(best["new"] / best["base"], 3),
                   "same_best_beam": beams["base"] == beams["new"]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"base": args.base, "prompt_len": args.prompt_len,
                                    "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
                                    "threads": args.threads, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
