"""KV cache dtypes side by side in one process: the same model, prompt and beams with each
`--kv-cache-dtype`, against float32 KV (issue #44: "no width slower than float32 KV by more than 3%").

    python benchmarks/kv_dtype_ab.py --widths 1 4 16 64 --kv-cache-dtypes float32 bfloat16 int8

One engine per KV dtype, all in this process, prefix cache off (every run computes its prompt and reads it
back from the dtype under test); each repeat runs every engine, the order reversed every other repeat, and
each keeps its best time after a warm-up. Beam search with `min_new_tokens = N`: every beam runs the full
length. Reports each dtype's time over float32's and whether its best beam equals float32's (not
required: a quantized cache may part from float32 at a near tie; benchmarks/kv_quality.py measures how
often). Writes benchmarks/results/kv_dtype_ab.json (--out).

`int8:none` and `int8:kv` among the dtypes add int8 engines whose pools store neither K nor V, or both,
rotated (model/attention/quantized_kv.py rotates K alone), so what the rotation costs is measured in the
same process:

    python benchmarks/kv_dtype_ab.py --widths 1 4 16 64 --kv-cache-dtypes float32 int8:none int8

A dtype ending in `/torch` (`int8/torch`) runs with the int8 KV kernels (widebeam/model/kernels) off, every
other one with them on where they are built, so the kernels are A/B'd in the same process:

    python benchmarks/kv_dtype_ab.py --widths 1 4 16 64 --kv-cache-dtypes float32 int8 int8/torch
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from interleaved import best_times

ROOT = Path(__file__).resolve().parent.parent
TORCH_PATH = "/torch"  # a dtype name's suffix: run with the int8 KV kernels off
INT8_ROTATIONS = {"k": (True, False), "kv": (True, True), "none": (False, False)}  # (K, V) stored rotated


def make_engine(name: str, **kwargs):
    """An engine storing KV as `name`: a dtype, or int8:ROTATION (k, kv, none)."""
    from widebeam.llm import LLM
    from widebeam.model.attention import quantized_kv

    dtype, _, rotation = name.removesuffix(TORCH_PATH).partition(":")
    saved = quantized_kv.ROTATE_K, quantized_kv.ROTATE_V
    if rotation:  # a pool's rotation is fixed when it is built
        quantized_kv.ROTATE_K, quantized_kv.ROTATE_V = INT8_ROTATIONS[rotation]
    try:
        return LLM(kv_cache_dtype=dtype, **kwargs)
    finally:
        quantized_kv.ROTATE_K, quantized_kv.ROTATE_V = saved


def with_kernels(name: str, run):
    """`run` with the int8 KV kernels on (unless WIDEBEAM_KERNELS=0), or off for a `/torch` dtype (a
    process-wide switch, set for each run)."""
    from widebeam.model import kernels

    def switched():
        saved = kernels.ENABLED
        kernels.ENABLED = saved and not name.endswith(TORCH_PATH)  # WIDEBEAM_KERNELS=0 wins
        try:
            return run()
        finally:
            kernels.ENABLED = saved
    return switched


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--kv-cache-dtypes", nargs="+", default=["float32", "bfloat16", "int8"])
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-cache-memory", default="1GiB")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/kv_dtype_ab.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from widebeam.heap import freeze_startup_heap
    from widebeam.params import BeamSearchParams

    dtypes = ["float32", *(d for d in args.kv_cache_dtypes if d != "float32")]
    from widebeam.model import kernels
    print(json.dumps({"int8_kv_kernels": kernels.enabled()}), flush=True)
    engines = {d: make_engine(d, kv_cache_memory=args.kv_cache_memory, enable_prefix_caching=False,
                              max_beam_width=max(args.widths)) for d in dtypes}
    freeze_startup_heap()
    prompt = {"prompt_token_ids": [(i * 7919) % 40000 + 100 for i in range(args.prompt_len)]}
    rows = []
    for width in args.widths:
        params = BeamSearchParams(beam_width=width, max_new_tokens=args.max_new_tokens,
                                  min_new_tokens=args.max_new_tokens)
        runs = {name: with_kernels(name, lambda llm=llm, params=params: llm.generate(prompt, params,
                                                                                    use_tqdm=False))
                for name, llm in engines.items()}
        best, outputs = best_times(runs, args.repeats)
        beams = {name: out[0].outputs[0].token_ids for name, out in outputs.items()}
        row = {"beam_width": width, "float32_s": round(best["float32"], 3)}
        for name in dtypes[1:]:
            row[f"{name}_s"] = round(best[name], 3)
            row[f"{name}_over_float32"] = round(best[name] / best["float32"], 3)
            row[f"{name}_same_best_beam"] = beams[name] == beams["float32"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"int8_kv_kernels": kernels.enabled(),
                                    "prompt_len": args.prompt_len, "max_new_tokens": args.max_new_tokens,
                                    "repeats": args.repeats, "threads": args.threads, "rows": rows},
                                   indent=2) + "\n")


if __name__ == "__main__":
    main()
