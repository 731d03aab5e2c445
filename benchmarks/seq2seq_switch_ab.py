"""A/B in one process on a translation model: one kernel switch on against the torch path it replaces.

    python benchmarks/seq2seq_switch_ab.py --model t5 --switch BIASED_GROUPS_ENABLED --dtypes float32 int8 \
        --widths 1 4 16 64

The model is benchmarks/seq2seq.py's (random weights in the real family's shape, built once under the
widebeam cache), its sources too (`--sources`, 48-64 tokens each), every source decoding exactly N tokens.
The switch: BIASED_GROUPS_ENABLED (`model/attention/kernel_reads.py`: T5's position-biased self-attention
through the group op) or one of the `widebeam.model.kernels` flags a translation model reads
(DENSE_ATTENTION_ENABLED, QUANTIZE_ROWS_ENABLED). The arms alternate every repeat (the order flips each
time), each keeps its best time after a warm-up (benchmarks/interleaved.py); the best hypotheses are
compared (float32 must agree; int8's activation rounding may flip a near-tie). Writes
benchmarks/results/seq2seq_<switch>_ab.json unless `--out` says otherwise.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import torch
from interleaved import best_times
from seq2seq import FAMILIES, cached_model_dir, make_sources, model_config, run_widebeam

ROOT = Path(__file__).resolve().parent.parent
SWITCHES = ("BIASED_GROUPS_ENABLED", "DENSE_ATTENTION_ENABLED", "QUANTIZE_ROWS_ENABLED")


def switch_owner(name: str):
    """The module whose flag `name` is."""
    if name == "BIASED_GROUPS_ENABLED":
        from widebeam.model.attention import kernel_reads

        return kernel_reads
    from widebeam.model import kernels

    return kernels


def arm(llm, owner, switch: str, on: bool, sources, width: int, new_tokens: int):
    """One arm: a run with the switch set to `on` (restored to on after), its best hypotheses."""
    def run():
        setattr(owner, switch, on)
        try:
            return run_widebeam(llm, sources, width, new_tokens)["best"]
        finally:
            setattr(owner, switch, True)
    return run


def main() -> None:
    from widebeam.llm import LLM
    from widebeam.model.loading.sources import default_cache_dir

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(FAMILIES), default="t5")
    parser.add_argument("--switch", choices=SWITCHES, default="BIASED_GROUPS_ENABLED")
    parser.add_argument("--dtypes", nargs="+", choices=["float32", "int8"], default=["float32"])
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--sources", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    family = FAMILIES[args.model]
    model_dir = cached_model_dir(args.model, None, default_cache_dir())
    config = model_config(family, None)
    specials = set(family.special_tokens) | set(family.suppress_ids)
    sources = make_sources(args.sources, config["vocab_size"], specials, config["eos_token_id"])
    owner = switch_owner(args.switch)
    points = []
    for dtype in args.dtypes:
        llm = LLM(str(model_dir), dtype=dtype, device="cpu", kv_cache_memory="4GiB",
                  max_beam_width=max(args.widths), enable_prefix_caching=False)
        for width in args.widths:
            arms = {"on": arm(llm, owner, args.switch, True, sources, width, args.new_tokens),
                    "off": arm(llm, owner, args.switch, False, sources, width, args.new_tokens)}
            best, results = best_times(arms, args.repeats)
            point = {"dtype": dtype, "beam_width": width, "on_s": best["on"], "off_s": best["off"],
                     "on_over_off": best["on"] / best["off"], "same_best": results["on"] == results["off"]}
            points.append(point)
            print(f"{args.model} {dtype} W={width}: on {best['on']:.3f} s, off {best['off']:.3f} s, "
                  f"on/off {point['on_over_off']:.3f}, same best {point['same_best']}", flush=True)
        del llm
    out = args.out or ROOT / f"benchmarks/results/seq2seq_{args.switch}_ab.json"
    command = "python benchmarks/seq2seq_switch_ab.py " + shlex.join(sys.argv[1:])
    out.write_text(json.dumps({"command": command, "model": args.model,
        "switch": args.switch, "sources": args.sources, "new_tokens": args.new_tokens,
        "repeats": args.repeats, "points": points}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
