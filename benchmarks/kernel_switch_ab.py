"""A/B in one process: one of the C++ kernels on against the torch path it replaces, through the engine.

    python benchmarks/kernel_switch_ab.py --switch DENSE_ATTENTION_ENABLED --dtype float32 --widths 1 4 8 16 \
        --prompt-lens 128 1024

One engine; the switch (a `widebeam.model.kernels` flag read at every call: DENSE_ATTENTION_ENABLED for a
float cache's attention, ELEMENTWISE_ENABLED for the norms and rotary; or ONEDNN_MANY_ROWS, the float32
split linears' oneDNN product past 8 rows, set on every layer the start-up probe gave it; FLASH_ROWS, the
tiled read of many query rows, through `kernels.set_flash_rows`; COPY_ROWS_ENABLED, the K/V write and
copy-on-write; QUANTIZE_ROWS_ENABLED, the int8 linears' row quantizer) flips between the arms, which
alternate every repeat (the order flips each time); each keeps its best time after a warm-up. Beam search
with `min_new_tokens = N`, the prefix cache off; the best beams must be equal. Writes
benchmarks/results/<switch>_ab_<dtype>.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from interleaved import best_times

ROOT = Path(__file__).resolve().parent.parent
SWITCHES = ("DENSE_ATTENTION_ENABLED", "ELEMENTWISE_ENABLED", "ONEDNN_MANY_ROWS", "FLASH_ROWS",
            "COPY_ROWS_ENABLED", "QUANTIZE_ROWS_ENABLED")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--switch", choices=SWITCHES, required=True)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[128, 1024])
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from widebeam.llm import LLM
    from widebeam.model import kernels
    from widebeam.params import BeamSearchParams

    if not kernels.available():
        raise SystemExit("the C++ kernels are not built: run `make setup`")
    llm = LLM(kv_cache_memory="1GiB", dtype=args.dtype, enable_prefix_caching=False)
    onednn_layers = [m for m in llm.engine.model.modules() if getattr(m, "onednn_many_rows", False)]
    if args.switch == "ONEDNN_MANY_ROWS" and not onednn_layers:
        raise SystemExit("the start-up probe kept F.linear past 8 rows here: nothing to switch")

    def switch(enabled: bool) -> None:
        if args.switch == "ONEDNN_MANY_ROWS":
            for layer in onednn_layers:
                layer.onednn_many_rows = enabled
        elif args.switch == "FLASH_ROWS":  # both sides: the Python caps and the C++ row count
            kernels.set_flash_rows(enabled)
        else:
            setattr(kernels, args.switch, enabled)

    def run(enabled: bool, prompt: dict, params: BeamSearchParams):
        switch(enabled)
        try:
            return llm.generate(prompt, params, use_tqdm=False)
        finally:
            switch(True)

    rows = []
    for prompt_len in args.prompt_lens:
        prompt = {"prompt_token_ids": [(i * 7919) % 40000 + 100 for i in range(prompt_len)]}
        for width in args.widths:
            params = BeamSearchParams(beam_width=width, max_new_tokens=args.max_new_tokens,
                                      min_new_tokens=args.max_new_tokens)
            runs = {name: (lambda enabled=enabled, prompt=prompt, params=params: run(enabled, prompt, params))
                    for name, enabled in (("torch", False), ("kernel", True))}
            best, outputs = best_times(runs, args.repeats)
            beams = {name: out[0].outputs[0].token_ids for name, out in outputs.items()}
            row = {"prompt_len": prompt_len, "beam_width": width, "torch_s": round(best["torch"], 3),
                   "kernel_s": round(best["kernel"], 3),
                   "kernel_over_torch": round(best["kernel"] / best["torch"], 3),
                   "same_best_beam": beams["torch"] == beams["kernel"]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    out = args.out or ROOT / f"benchmarks/results/{args.switch.lower()}_ab_{args.dtype}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"switch": args.switch, "dtype": args.dtype,
                               "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
                               "threads": args.threads, "rows": rows},
                              indent=2) + "\n")


if __name__ == "__main__":
    main()
