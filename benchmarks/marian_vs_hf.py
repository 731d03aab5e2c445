"""Translation-style beam search: widebeam vs transformers on an opus-mt-en-de-shaped Marian model.

No PyPI package ships Marian weights, so the model has opus-mt-en-de's shape (6 + 6 layers, d_model
512, 58,101-token vocabulary, ~74M parameters) and random weights, saved locally as safetensors:
the work per token is the real model's, the translations are noise. Same source, dtype and
thread count for both engines, alternating after a warm-up; `min_new_tokens` = N on both sides.

Per point: wall time, and the KV each engine holds at its peak. transformers keeps, per beam, the
decoder's self-attention K/V and its own copy of the encoder output's cross-attention K/V:
W x (N + E) tokens per layer. widebeam holds the source's cross K/V once (`ceil(E / T)` blocks,
whatever W) and shares the decoder blocks the beams have in common.

    python benchmarks/marian_vs_hf.py --widths 4 16 64 --source-len 128 --max-new-tokens 32
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from widebeam.bench import peak_rss_bytes, reset_peak_rss
from widebeam.llm import LLM
from widebeam.model.families.arch import BUILTIN_CONFIGS
from widebeam.params import BeamSearchParams

PAD = BUILTIN_CONFIGS["opus-mt-en-de"]["pad_token_id"]
EOS = BUILTIN_CONFIGS["opus-mt-en-de"]["eos_token_id"]


def save_random_opus_mt(path: Path) -> None:
    from transformers import GenerationConfig, MarianConfig, MarianMTModel

    config = {k: v for k, v in BUILTIN_CONFIGS["opus-mt-en-de"].items() if k != "model_type"}
    torch.manual_seed(0)
    model = MarianMTModel(MarianConfig(**config)).eval()
    model.generation_config = GenerationConfig(decoder_start_token_id=PAD, eos_token_id=EOS, pad_token_id=PAD,
                                               bad_words_ids=[[PAD]], num_beams=1)
    model.save_pretrained(str(path), safe_serialization=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--source-len", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/marian_vs_hf.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import MarianMTModel

    with tempfile.TemporaryDirectory() as tmp:
        save_random_opus_mt(Path(tmp))
        llm = LLM(tmp, dtype="float32", kv_cache_memory="1GiB", max_beam_width=max(args.widths),
                  enable_prefix_caching=False)  # each source encoded every time, as transformers does
        hf = MarianMTModel.from_pretrained(tmp, dtype=torch.float32).eval()
    cache = llm.engine.cache
    t = cache.tokens_per_block
    bytes_per_token = {name: cache[name].spec.bytes_per_token for name in ("self", "cross")}
    gen = torch.Generator().manual_seed(1)
    source = torch.randint(3, PAD, (args.source_len - 1,), generator=gen).tolist() + [EOS]
    n = args.max_new_tokens
    hf_settings = {"do_sample": False, "eos_token_id": EOS, "pad_token_id": PAD,
                   "decoder_start_token_id": PAD,
                   "bad_words_ids": [[PAD]], "max_new_tokens": n, "min_new_tokens": n}

    def run_widebeam(width):
        reset_peak_rss()
        start = time.perf_counter()
        (out,) = llm.generate([{"prompt_token_ids": source}],
                              BeamSearchParams(beam_width=width, max_new_tokens=n, min_new_tokens=n),
                              use_tqdm=False)
        wall = time.perf_counter() - start
        kv = sum(out.peak_blocks[name] * t * bytes_per_token[name] for name in bytes_per_token)
        return {"wall_s": wall, "peak_rss_bytes": peak_rss_bytes(), "peak_kv_bytes": kv,
                "peak_blocks": dict(out.peak_blocks)}, out.outputs[0].token_ids

    def run_hf(width):
        reset_peak_rss()
        start = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(torch.tensor([source]), num_beams=width, **hf_settings)
        wall = time.perf_counter() - start
        kv = width * (n * bytes_per_token["self"] + len(source) * bytes_per_token["cross"])
        return {"wall_s": wall, "peak_rss_bytes": peak_rss_bytes(), "peak_kv_bytes": kv}, out[0, 1:].tolist()

    run_widebeam(2)
    run_hf(2)
    rows = []
    for width in args.widths:
        wb, wb_best = run_widebeam(width)
        ref, hf_best = run_hf(width)
        row = {"beam_width": width, "source_len": len(source), "max_new_tokens": n, "dtype": "float32",
               "threads": args.threads, "widebeam": wb, "transformers": ref,
               "same_best_sequence": wb_best == hf_best, "speedup": ref["wall_s"] / wb["wall_s"],
               "cross_blocks_expected": -(-len(source) // t)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"model": "opus-mt-en-de shape, random weights",
                                          "torch": torch.__version__, "points": rows}, indent=2) + "\n")
    for r in rows:
        wb, ref = r["widebeam"], r["transformers"]
        print(f"W={r['beam_width']:>3}  widebeam {wb['wall_s']:6.2f} s  transformers {ref['wall_s']:6.2f} s  "
              f"{r['speedup']:5.2f}x  same best: {r['same_best_sequence']}  KV "
              f"{wb['peak_kv_bytes'] / 2**20:6.1f} vs {ref['peak_kv_bytes'] / 2**20:7.1f} MiB  cross blocks "
              f"{wb['peak_blocks']['cross']} (ceil(E/T) = {r['cross_blocks_expected']})")


if __name__ == "__main__":
    main()
