"""A OneRec-shaped generative-retrieval benchmark (issue #33): a Qwen3-shaped model with random
weights and 3 x C item-code tokens added to its vocabulary, a synthetic catalogue of 3-code items
with Zipf-popular first codes, prompts of a long shared prefix (prefix cache on) plus a short user
part, at several widths and concurrencies; each point also with the width schedule [W/16, W/4, W]
and with a random 10% item filter.

    python benchmarks/genrec_onerec.py --quick      # 2 layers of width 256, 100k items (minutes, 2 cores)
    python benchmarks/genrec_onerec.py              # 4 layers of Qwen3-1.7B's width, 1M items, W up to 1,024
    python benchmarks/genrec_onerec.py --full       # the full Qwen3-1.7B shape (a GPU)

Per point (W, concurrency, variant): items/s (returned items over the wall time), p50 / p99 request
latency (closed loop: `concurrency` requests in flight, a new one added as one finishes), peak KV
blocks against required (every request's `peak_blocks` <= `required_blocks`, the largest shown),
invalid items (not in the catalogue, or outside the request's filter: must be 0), and for the
schedule the overlap of its top-100 items with the fixed width's on the same prompts. Writes
benchmarks/results/genrec_onerec.json and .md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from widebeam.llm import LLM
from widebeam.params import BeamSearchParams

RESULTS = Path(__file__).parent / "results"
SHAPES = {  # hidden, intermediate, heads, kv heads, head dim, layers, base vocab
    "quick": (256, 768, 4, 2, 64, 2, 4096),
    "default": (2048, 6144, 16, 8, 128, 4, 32768),
    "full": (2048, 6144, 16, 8, 128, 28, 151936),
}
EOS = 2


def build_model(path: Path, shape: str, codes_per_level: int) -> int:
    """A Qwen3 with random weights saved as safetensors; returns the base vocabulary (item codes
    follow it)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hidden, inter, heads, kv_heads, head_dim, layers, base_vocab = SHAPES[shape]
    config = AutoConfig.for_model("qwen3", vocab_size=base_vocab + 3 * codes_per_level, hidden_size=hidden,
                                  intermediate_size=inter, num_attention_heads=heads,
                                  num_key_value_heads=kv_heads, head_dim=head_dim, num_hidden_layers=layers,
                                  max_position_embeddings=8192, eos_token_id=EOS, bos_token_id=1,
                                  tie_word_embeddings=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0, 0.05)
    model.save_pretrained(str(path), safe_serialization=True)
    return base_vocab


def make_catalogue(num_items: int, base_vocab: int, codes: int, rng) -> np.ndarray:
    """[n, 3] distinct items: first code Zipf-popular, the others uniform, each level its own tokens."""
    first = np.minimum(rng.zipf(1.2, size=num_items * 2) - 1, codes - 1)
    rest = rng.integers(0, codes, size=(num_items * 2, 2))
    items = np.unique(np.stack([first, rest[:, 0], rest[:, 1]], axis=1), axis=0)
    # a random num_items of the distinct rows: the first num_items in sorted order would keep only the
    # lowest first codes (19 of them at 1M items), not a Zipf spread over thousands
    keep = np.sort(rng.choice(items.shape[0], size=min(num_items, items.shape[0]), replace=False))
    return items[keep] + base_vocab + np.arange(3) * codes


def run_point(llm, prompts, make_params, concurrency: int, catalogue_items: set, allowed: set | None):
    """Closed loop over `prompts`; returns the metrics and each prompt's returned items."""
    engine = llm.engine
    pending = list(enumerate(prompts))
    started, latencies, returned = {}, [], {}
    peak, required, invalid = 0, 0, 0
    begin = time.perf_counter()
    while pending or engine.has_unfinished():
        while pending and len(started) - len(latencies) < concurrency:
            i, prompt = pending.pop(0)
            engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, make_params())
            started[f"r{i}"] = time.perf_counter()
        for delta in engine.step():
            if not delta.finished:
                continue
            out = delta.output
            latencies.append(time.perf_counter() - started[delta.request_id])
            items = [tuple(b.token_ids[:-1]) for b in out.outputs]
            returned[delta.request_id] = items
            invalid += sum(item not in catalogue_items or (allowed is not None and item not in allowed)
                           for item in items)
            for name, held in out.peak_blocks.items():
                assert held <= out.required_blocks[name], (name, held, out.required_blocks[name])
                peak, required = max(peak, held), max(required, out.required_blocks[name])
    wall = time.perf_counter() - begin
    latencies.sort()
    num_items = sum(len(v) for v in returned.values())
    return {"wall_s": round(wall, 3), "items_per_s": round(num_items / wall, 1),
            "p50_s": round(statistics.median(latencies), 3),
            "p99_s": round(latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 3),
            "peak_kv_blocks": peak, "required_kv_blocks": required, "invalid_items": invalid}, returned


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--full", action="store_true", help="the full Qwen3-1.7B shape (a GPU)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    shape = "quick" if args.quick else "full" if args.full else "default"
    quick = args.quick
    codes = 1024 if quick else 8192
    num_items = 100_000 if quick else 1_000_000
    prefix_tokens, user_tokens = (576, 24) if quick else (2432, 49)
    widths = [32, 64] if quick else [50, 128, 512, 1024]
    concurrencies = [1, 4] if quick else [1, 8, 32]
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        base_vocab = build_model(Path(tmp), shape, codes)
        items = make_catalogue(num_items, base_vocab, codes, rng)
        llm = LLM(tmp, dtype="float32", device=args.device, max_beam_width=max(widths),
                  enable_prefix_caching=True, kv_cache_memory="3GiB" if quick else "24GiB")
    catalogue_items = {tuple(int(t) for t in row) for row in items}
    store = rng.choice(len(items), size=len(items) // 10, replace=False)
    allowed = {tuple(int(t) for t in items[i]) for i in store}
    llm.register_catalogue("onerec", items, subsets={"store": store})
    prefix = rng.integers(3, base_vocab, size=prefix_tokens).tolist()
    # warm-up, not measured: the first passes, the filter's node ranges (built once per catalogue)
    warm = [{"prompt_token_ids": prefix + [5] * user_tokens}]
    for params in (BeamSearchParams(beam_width=widths[0], catalogue="onerec"),
                   BeamSearchParams(beam_width=widths[0], catalogue="onerec", catalogue_subset="store")):
        llm.generate(warm, params, use_tqdm=False)
    rows = []
    for width in widths:
        for concurrency in concurrencies:
            prompts = [prefix + rng.integers(3, base_vocab, size=user_tokens).tolist()
                       for _ in range(max(2 * concurrency, 2))]
            schedule = [max(1, width // 16), max(1, width // 4), width]
            variants = {
                "fixed": (lambda w=width: BeamSearchParams(beam_width=w, catalogue="onerec"), None),
                "schedule": (lambda s=schedule: BeamSearchParams(beam_width_schedule=s, catalogue="onerec"),
                             None),
                "filter10%": (lambda w=width: BeamSearchParams(beam_width=w, catalogue="onerec",
                                                              catalogue_subset="store"), allowed),
            }
            results = {}
            for name, (make_params, allowed_set) in variants.items():
                metrics, returned = run_point(llm, prompts, make_params, concurrency, catalogue_items,
                                              allowed_set)
                results[name] = returned
                row = {"width": width, "concurrency": concurrency, "variant": name, **metrics}
                if name == "schedule":
                    overlaps = [len(set(results["fixed"][r][:100]) & set(returned[r][:100]))
                                / max(1, min(100, len(results["fixed"][r]))) for r in returned]
                    row["top100_overlap"] = round(statistics.mean(overlaps), 3)
                    row["speedup_vs_fixed"] = round(rows[-1]["wall_s"] / metrics["wall_s"], 2)
                rows.append(row)
                print(json.dumps(row), flush=True)
    RESULTS.mkdir(exist_ok=True)
    meta = {"shape": shape, "items": len(items), "codes_per_level": codes, "prefix_tokens": prefix_tokens,
            "user_tokens": user_tokens, "device": args.device, "threads": torch.get_num_threads()}
    suffix = "_quick" if quick else ""
    (RESULTS / f"genrec_onerec{suffix}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    header = ("| W | conc | variant | items/s | p50 s | p99 s | peak/required KV blocks | invalid | "
              "top-100 overlap | speed-up |\n|---|---|---|---|---|---|---|---|---|---|\n")
    lines = [f"| {r['width']} | {r['concurrency']} | {r['variant']} | {r['items_per_s']} | {r['p50_s']} | "
             f"{r['p99_s']} | {r['peak_kv_blocks']}/{r['required_kv_blocks']} | {r['invalid_items']} | "
             f"{r.get('top100_overlap', '')} | {r.get('speedup_vs_fixed', '')} |" for r in rows]
    (RESULTS / f"genrec_onerec{suffix}.md").write_text(
        f"OneRec-shaped run ({json.dumps(meta)})\n\n" + header + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
