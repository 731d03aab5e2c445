"""widebeam vs Hugging Face transformers beam search, side by side in one run.

Same model (SmolLM2-135M-Instruct real weights), same prompts, dtype and thread count; the two
engines alternate at every point after a warm-up. Per point: wall time, beam-tokens/s, peak process
memory (RSS high-water mark, reset before each run), peak KV bytes held, and the compute floor: the
time of the model's dense matmuls alone for the same batch shapes (one prefill of P tokens, then N
steps of W tokens), measured here in the same run, with each engine's time as a multiple of it.

    python benchmarks/beam_vs_hf.py                       # the default sweeps (long: tens of minutes)
    python benchmarks/beam_vs_hf.py --widths 1 4 --prompt-lens 512 --max-new-tokens 32 --no-wide
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch

from widebeam.engine import LLM
from widebeam.params import BeamSearchParams

RESULTS = Path("benchmarks/results")


def _rss(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> None:
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def make_prompt(tokenizer, prompt_len: int) -> list[int]:
    text = " ".join(f"Record {i}: the {('red', 'green', 'blue')[i % 3]} crate weighs {i % 17} kg." for i in range(prompt_len))
    return tokenizer.encode(text)[:prompt_len]


def compute_floor_s(hf_model, prompt_len: int, width: int, new_tokens: int, dtype: torch.dtype) -> float:
    """Dense matmuls only: every linear layer's weight times the step's activations."""
    weights = [m.weight for m in hf_model.modules() if isinstance(m, torch.nn.Linear)]
    head = hf_model.lm_head.weight
    hidden = head.shape[1]
    # Real-valued inputs made before timing: uninitialised memory can hold denormals, which make
    # CPU matmuls many times slower and the floor meaningless.
    inputs = {rows: {n: torch.randn(rows, n, dtype=dtype) for n in {w.shape[1] for w in weights}}
              for rows in (prompt_len, width, 1)}
    with torch.inference_mode():
        start = time.perf_counter()
        for rows, steps in ((prompt_len, 1), (width, new_tokens)):
            for _ in range(steps):
                for w in weights:
                    if w is not head:
                        torch.nn.functional.linear(inputs[rows][w.shape[1]], w)
                head_rows = 1 if rows == prompt_len else rows  # prefill needs only the last token's logits
                torch.nn.functional.linear(inputs[head_rows][hidden], head)
        return time.perf_counter() - start


def run_widebeam(llm, prompt_ids, width, new_tokens):
    params = BeamSearchParams(beam_width=width, max_new_tokens=new_tokens, ignore_eos=True)
    _reset_peak()
    start = time.perf_counter()
    (out,) = llm.generate([{"prompt_token_ids": prompt_ids}], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    spec = llm.engine.cache["self"].spec
    return {"wall_s": elapsed, "peak_rss_bytes": _rss("VmHWM"),
            "peak_kv_bytes": out.peak_blocks["self"] * spec.bytes_per_block(llm.engine.cache.tokens_per_block),
            "best": out.outputs[0].token_ids}


def run_hf(hf_model, prompt_ids, width, new_tokens, eos_id):
    _reset_peak()
    start = time.perf_counter()
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([prompt_ids]), num_beams=width, do_sample=False, max_new_tokens=new_tokens,
                                min_new_tokens=new_tokens, eos_token_id=eos_id, pad_token_id=eos_id)
    elapsed = time.perf_counter() - start
    cfg = hf_model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    bytes_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * hf_model.dtype.itemsize
    return {"wall_s": elapsed, "peak_rss_bytes": _rss("VmHWM"),
            "peak_kv_bytes": width * (len(prompt_ids) + new_tokens) * bytes_per_token,
            "best": out[0, len(prompt_ids):].tolist()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[512])
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--wide-widths", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--wide-prompt-lens", type=int, nargs="+", default=[512, 2048, 4096])
    parser.add_argument("--no-wide", action="store_true", help="skip the wide sweep")
    parser.add_argument("--hf-kv-limit", default="6GiB", help="skip transformers when W x (P+N) KV exceeds this")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(RESULTS / "beam_vs_hf.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    from widebeam.units import parse_bytes

    hf_limit = parse_bytes(args.hf_kv_limit)
    points = [(w, p) for p in args.prompt_lens for w in args.widths]
    if not args.no_wide:
        points += [(w, p) for p in args.wide_prompt_lens for w in args.wide_widths if (w, p) not in points]
    max_width = max(w for w, _ in points)
    llm = LLM(dtype=args.dtype, kv_cache_memory="3GiB", max_beam_width=max_width)
    dtype = llm.engine.model.lm_head.weight.dtype
    hf = AutoModelForCausalLM.from_pretrained(str(llm.engine.source.path), dtype=dtype).eval()
    eos_id = sorted(llm.engine.eos_token_ids)[0]
    tokenizer = llm.tokenizer

    # warm-up, both engines
    warm = make_prompt(tokenizer, 64)
    run_widebeam(llm, warm, 2, 4)
    run_hf(hf, warm, 2, 4, eos_id)

    rows = []
    for width, prompt_len in points:
        prompt_ids = make_prompt(tokenizer, prompt_len)
        n = args.max_new_tokens
        row = {"beam_width": width, "prompt_len": len(prompt_ids), "max_new_tokens": n, "dtype": args.dtype,
               "threads": args.threads}
        row["compute_floor_s"] = compute_floor_s(hf, len(prompt_ids), width, n, dtype)
        wb = run_widebeam(llm, prompt_ids, width, n)
        row["widebeam"] = {k: v for k, v in wb.items() if k != "best"}
        hf_kv = width * (len(prompt_ids) + n) * llm.engine.cache["self"].spec.bytes_per_token
        if hf_kv > hf_limit:
            row["transformers"] = {"skipped": f"its KV for W x (P+N) = {width * (len(prompt_ids) + n)} tokens "
                                              f"({hf_kv / 2**30:.1f} GiB) exceeds --hf-kv-limit {args.hf_kv_limit}"}
        else:
            ref = run_hf(hf, prompt_ids, width, n, eos_id)
            row["transformers"] = {k: v for k, v in ref.items() if k != "best"}
            row["same_best_sequence"] = wb["best"] == ref["best"]
            row["speedup"] = ref["wall_s"] / wb["wall_s"]
        for side in ("widebeam", "transformers"):
            if "wall_s" in row[side]:
                row[side]["beam_tokens_per_s"] = width * n / row[side]["wall_s"]
                row[side]["x_compute_floor"] = row[side]["wall_s"] / row["compute_floor_s"]
        rows.append(row)
        print(json.dumps(row), flush=True)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"model": "smollm2-135m-instruct", "torch": torch.__version__,
                                              "points": rows}, indent=2) + "\n")
    plot(rows, Path(args.out).with_suffix(".png"))


def plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for prompt_len in sorted({r["prompt_len"] for r in rows}):
        sub = [r for r in rows if r["prompt_len"] == prompt_len]
        ax.plot([r["beam_width"] for r in sub], [r["widebeam"]["wall_s"] for r in sub], "o-",
                label=f"widebeam P={prompt_len}")
        hf = [r for r in sub if "wall_s" in r["transformers"]]
        if hf:
            ax.plot([r["beam_width"] for r in hf], [r["transformers"]["wall_s"] for r in hf], "s--",
                    label=f"transformers P={prompt_len}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("beam width")
    ax.set_ylabel("wall time (s)")
    ax.set_title("beam search, SmolLM2-135M, N=32 new tokens")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
