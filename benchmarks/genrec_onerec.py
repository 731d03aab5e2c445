"""A OneRec-shaped generative-retrieval benchmark (issue #33): a Qwen3-shaped model with random
weights and 3 x C item-code tokens added to its vocabulary, a synthetic catalogue of 3-code items
with Zipf-popular first codes, prompts of a long shared prefix (prefix cache on) plus a short user
part, at several widths and concurrencies; each point also with the width schedule [W/16, W/4, W]
and with a random 10% item filter.

    python benchmarks/genrec_onerec.py --quick      # 2 layers of width 256, 100k items (minutes, 2 cores)
    python benchmarks/genrec_onerec.py              # 4 layers of Qwen3-1.7B's width, 1M items, W up to 1,024
    python benchmarks/genrec_onerec.py --full       # the full Qwen3-1.7B shape (a GPU)

One point per command (the issue's must-show points; each default shape, 1M items):

    # schedule [64, 256, 1024] against a fixed 1,024: wall time ratio and top-100 overlap
    python benchmarks/genrec_onerec.py --widths 1024 --concurrencies 1 --variants fixed schedule \
        --schedule 64,256,1024 --requests 4 --out onerec_schedule
    # a 10% store filter against the unfiltered constrained run (+ 0 outside the filter over 100 requests)
    python benchmarks/genrec_onerec.py --widths 256 --concurrencies 1 --variants fixed filter10% \
        --out onerec_filter
    # the tail at W=512, 8 in flight: p99 / p50
    python benchmarks/genrec_onerec.py --widths 512 --concurrencies 8 --variants fixed --requests 24 \
        --out onerec_tail

--layers and --items shrink any of them (e.g. --layers 1 --items 100000 to check a command works).

Per point (W, concurrency, variant): items/s (returned items over the variant's wall time), p50 / p99
request latency (closed loop: `concurrency` requests in flight, a new one added as one finishes),
peak KV blocks against required (every request's `peak_blocks` <= `required_blocks`, the largest
shown), invalid items (not in the catalogue, or outside the request's filter: must be 0), the wall
time against the fixed width's on the same prompts, and for the schedule the overlap of its top-100
items with the fixed width's. The variants run interleaved (the prompts in chunks, each chunk run by
every variant, the order reversed every other chunk) so load drift favours none. Where a point
has fewer requests than --filter-check (100), "0 outside the filter" is also checked over that many
requests in a separate cheap pass: the real engine, catalogue, subset and width on a 1-layer model
(said so in the output). Writes benchmarks/results/NAME.json and .md (--out NAME).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
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
    "tiny": (64, 128, 2, 1, 32, 1, None),  # the filter check's model (the base vocabulary given)
}
EOS = 2


def build_model(path: Path, shape: str, codes_per_level: int, layers: int | None = None,
                base_vocab: int | None = None) -> int:
    """A Qwen3 with random weights saved as safetensors (`layers` and `base_vocab` override the
    shape's); returns the base vocabulary (item codes follow it)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hidden, inter, heads, kv_heads, head_dim, shape_layers, shape_vocab = SHAPES[shape]
    layers, base_vocab = layers or shape_layers, base_vocab or shape_vocab
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
    # the tail past the last code wraps round (a clip would pile ~15% of the items on the last code)
    first = (rng.zipf(1.2, size=num_items * 2) - 1) % codes
    rest = rng.integers(0, codes, size=(num_items * 2, 2))
    items = np.unique(np.stack([first, rest[:, 0], rest[:, 1]], axis=1), axis=0)
    # a random num_items of the distinct rows: the first num_items in sorted order would keep only the
    # lowest first codes (19 of them at 1M items), not a Zipf spread over thousands
    keep = np.sort(rng.choice(items.shape[0], size=min(num_items, items.shape[0]), replace=False))
    return items[keep] + base_vocab + np.arange(3) * codes


def run_loop(llm, prompts: dict, make_params, concurrency: int, catalogue_items: set, allowed: set | None,
             tag: str) -> dict:
    """Closed loop over `prompts` ({index: tokens}): `concurrency` requests in flight, a new one added
    as one finishes. Returns the raw measurements (summed over chunks by `merge`)."""
    engine = llm.engine
    pending = list(prompts.items())
    started, latencies, returned = {}, [], {}
    peak, required, invalid = 0, 0, 0
    begin = time.perf_counter()
    while pending or engine.has_unfinished():
        while pending and len(started) - len(latencies) < concurrency:
            i, prompt = pending.pop(0)
            engine.add_request(f"{tag}-{i}", {"prompt_token_ids": prompt}, make_params())
            started[f"{tag}-{i}"] = (i, time.perf_counter())
        for delta in engine.step():
            if not delta.finished:
                continue
            out = delta.output
            i, start = started[delta.request_id]
            latencies.append(time.perf_counter() - start)
            items = [tuple(b.token_ids[:-1]) for b in out.outputs]
            returned[i] = items
            invalid += sum(item not in catalogue_items or (allowed is not None and item not in allowed)
                           for item in items)
            for name, held in out.peak_blocks.items():
                assert held <= out.required_blocks[name], (name, held, out.required_blocks[name])
                peak, required = max(peak, held), max(required, out.required_blocks[name])
    return {"wall_s": time.perf_counter() - begin, "latencies": latencies, "returned": returned,
            "peak": peak, "required": required, "invalid": invalid}


def merge(total: dict | None, part: dict) -> dict:
    if total is None:
        return part
    return {"wall_s": total["wall_s"] + part["wall_s"], "latencies": total["latencies"] + part["latencies"],
            "returned": {**total["returned"], **part["returned"]}, "peak": max(total["peak"], part["peak"]),
            "required": max(total["required"], part["required"]),
            "invalid": total["invalid"] + part["invalid"]}


def summary(raw: dict) -> dict:
    latencies = sorted(raw["latencies"])
    num_items = sum(len(v) for v in raw["returned"].values())
    p50 = statistics.median(latencies)
    p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
    return {"requests": len(latencies), "items_per_request": round(num_items / len(latencies), 1),
            "wall_s": round(raw["wall_s"], 3),
            "items_per_s": round(num_items / raw["wall_s"], 1), "p50_s": round(p50, 3),
            "p99_s": round(p99, 3),
            "p99_over_p50": round(p99 / p50, 2), "peak_kv_blocks": raw["peak"],
            "required_kv_blocks": raw["required"], "invalid_items": raw["invalid"]}


def run_point(llm, prompts: list, variants: dict, concurrency: int, catalogue_items: set, tag: str,
              chunk_requests: int) -> dict:
    """Every variant over the same prompts, interleaved: the prompts in chunks of `chunk_requests`,
    each chunk run by every variant in turn, the order reversed every other chunk, so load drift over
    the run (other processes, thermal) falls on all variants alike. Returns {variant: raw}."""
    raws = dict.fromkeys(variants)
    names = list(variants)
    for k, lo in enumerate(range(0, len(prompts), chunk_requests)):
        chunk = {i: prompts[i] for i in range(lo, min(lo + chunk_requests, len(prompts)))}
        for name in names if k % 2 == 0 else names[::-1]:
            make_params, allowed = variants[name]
            raws[name] = merge(raws[name], run_loop(llm, chunk, make_params, concurrency, catalogue_items,
                                                    allowed, f"{tag}-{name}-{k}"))
    return raws


def filter_check(args, items: np.ndarray, store: np.ndarray, allowed: set, base_vocab: int, width: int,
                 num_requests: int, rng) -> dict:
    """0 items outside the filter over `num_requests` requests, cheaply: the real engine (same
    catalogue, same store subset, same width, the filtered walk of every step) on a 1-layer model of
    the same vocabulary, whose scores are as arbitrary as the benchmark model's (random weights)."""
    with tempfile.TemporaryDirectory() as tmp:
        build_model(Path(tmp), "tiny", args.codes, base_vocab=base_vocab)
        llm = LLM(tmp, dtype="float32", device=args.device, max_beam_width=width, kv_cache_memory="1GiB")
    llm.register_catalogue("onerec", items, subsets={"store": store})
    prompts = [{"prompt_token_ids": rng.integers(3, base_vocab, size=8).tolist()}
               for _ in range(num_requests)]
    begin = time.perf_counter()
    outputs = llm.generate(prompts, BeamSearchParams(beam_width=width, catalogue="onerec",
                                                     catalogue_subset="store"), use_tqdm=False)
    returned = [tuple(b.token_ids[:-1]) for out in outputs for b in out.outputs]
    return {"filter_check": "a separate cheap pass: the real engine on a 1-layer model (hidden 64) of the "
                            "same vocabulary, the same catalogue and store subset",
            "width": width, "requests": num_requests, "returned_items": len(returned),
            "outside_filter": sum(item not in allowed for item in returned),
            "wall_s": round(time.perf_counter() - begin, 1)}


def int_list(text: str) -> list[int]:
    values = [int(v) for v in text.replace(",", " ").split()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


VARIANTS = ("fixed", "schedule", "filter10%")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--full", action="store_true", help="the full Qwen3-1.7B shape (a GPU)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--widths", nargs="+", type=int_list,
                        help="beam widths, e.g. 512 or 50,128 (default: the "
                        "shape's: 50 128 512 1024; --quick 32 64)")
    parser.add_argument("--concurrencies", nargs="+", type=int_list,
                        help="requests in flight (default 1 8 32; "
                        "quick 1 4)")
    parser.add_argument("--requests", type=int, help="prompts per point (default max(2 * concurrency, 2))")
    parser.add_argument("--items", type=int, help="catalogue items (default 1M; --quick 100k)")
    parser.add_argument("--layers", type=int, help="decoder layers (default: the "
                        "shape's: 4, quick 2, full 28)")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--schedule", type=int_list, help="an explicit width schedule, e.g. 64,256,1024, "
                        "instead of [W/16, W/4, W]")
    parser.add_argument("--chunk-requests", type=int, help="requests per interleaving chunk: each chunk is "
                        "run by every variant, the order reversed every other chunk "
                        "(default: the concurrency)")
    parser.add_argument("--filter-check", type=int, default=100, help="requests over which filter10%% must "
                        "return 0 items outside the filter; where a point has fewer, a separate cheap pass "
                        "(0: none)")
    parser.add_argument("--kv-cache-memory", help="default 24GiB (quick 3GiB)")
    parser.add_argument("--out", help="results file stem in benchmarks/results "
                        "(default genrec_onerec[_quick])")
    args = parser.parse_args()
    args.shape = "quick" if args.quick else "full" if args.full else "default"
    args.codes = 1024 if args.quick else 8192
    args.items = args.items or (100_000 if args.quick else 1_000_000)
    # "--widths 50 128" and "--widths 50,128" alike
    args.widths = [v for values in args.widths for v in values] if args.widths else None
    args.concurrencies = [v for values in args.concurrencies for v in values] if args.concurrencies else None
    args.widths = args.widths or ([32, 64] if args.quick else [50, 128, 512, 1024])
    args.concurrencies = args.concurrencies or ([1, 4] if args.quick else [1, 8, 32])
    args.kv_cache_memory = args.kv_cache_memory or ("3GiB" if args.quick else "24GiB")
    args.out = args.out or ("genrec_onerec_quick" if args.quick else "genrec_onerec")
    for name in ("requests", "items", "layers", "chunk_requests"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main() -> None:
    args = parse_args()
    prefix_tokens, user_tokens = (576, 24) if args.quick else (2432, 49)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        base_vocab = build_model(Path(tmp), args.shape, args.codes, layers=args.layers)
        items = make_catalogue(args.items, base_vocab, args.codes, rng)
        llm = LLM(tmp, dtype="float32", device=args.device,
                  max_beam_width=max(args.widths + (args.schedule or [])), enable_prefix_caching=True,
                  kv_cache_memory=args.kv_cache_memory)
    catalogue_items = {tuple(int(t) for t in row) for row in items}
    store = rng.choice(len(items), size=len(items) // 10, replace=False)
    allowed = {tuple(int(t) for t in items[i]) for i in store}
    llm.register_catalogue("onerec", items, subsets={"store": store})
    prefix = rng.integers(3, base_vocab, size=prefix_tokens).tolist()
    # warm-up, not measured: the first passes, the shared prefix's cache, the filter's node ranges
    warm = [{"prompt_token_ids": prefix + [5] * user_tokens}]
    for params in (BeamSearchParams(beam_width=args.widths[0], catalogue="onerec"),
                   BeamSearchParams(beam_width=args.widths[0], catalogue="onerec", catalogue_subset="store")):
        llm.generate(warm, params, use_tqdm=False)
    rows, checks, checked = [], [], set()
    for width in args.widths:
        schedule = args.schedule or [max(1, width // 16), max(1, width // 4), width]
        variants = {
            "fixed": (lambda w=width: BeamSearchParams(beam_width=w, catalogue="onerec"), None),
            "schedule": (lambda s=schedule: BeamSearchParams(beam_width_schedule=s, catalogue="onerec"),
                         None),
            "filter10%": (lambda w=width: BeamSearchParams(beam_width=w, catalogue="onerec",
                                                          catalogue_subset="store"), allowed),
        }
        variants = {name: variants[name] for name in args.variants}
        for concurrency in args.concurrencies:
            num_requests = args.requests or max(2 * concurrency, 2)
            prompts = [prefix + rng.integers(3, base_vocab, size=user_tokens).tolist()
                       for _ in range(num_requests)]
            chunk = args.chunk_requests or (concurrency if len(variants) > 1 else num_requests)
            raws = run_point(llm, prompts, variants, concurrency, catalogue_items, f"w{width}c{concurrency}",
                             chunk)
            for name, raw in raws.items():
                row = {"width": width, "concurrency": concurrency, "variant": name, **summary(raw)}
                if name == "schedule":
                    row["schedule"] = schedule
                if name != "fixed" and "fixed" in raws:
                    row["wall_vs_fixed"] = round(raw["wall_s"] / raws["fixed"]["wall_s"], 3)
                if name == "schedule" and "fixed" in raws:
                    fixed = raws["fixed"]["returned"]
                    overlaps = [len(set(fixed[i][:100]) & set(got[:100])) / max(1, min(100, len(fixed[i])))
                                for i, got in raw["returned"].items()]
                    row["top100_overlap"] = round(statistics.mean(overlaps), 3)
                rows.append(row)
                print(json.dumps(row), flush=True)
            if "filter10%" in variants and args.filter_check > num_requests and width not in checked:
                checked.add(width)  # the check does not depend on the concurrency
                checks.append({"point_width": width, **filter_check(args, items, store, allowed, base_vocab,
                                                                     width, args.filter_check, rng)})
                print(json.dumps(checks[-1]), flush=True)
    write_results(args, rows, checks, len(items), prefix_tokens, user_tokens)


def write_results(args, rows: list, checks: list, num_items: int, prefix_tokens: int,
                  user_tokens: int) -> None:
    RESULTS.mkdir(exist_ok=True)
    meta = {"shape": args.shape, "layers": args.layers or SHAPES[args.shape][5], "items": num_items,
            "codes_per_level": args.codes, "prefix_tokens": prefix_tokens, "user_tokens": user_tokens,
            "device": args.device, "threads": torch.get_num_threads(), "command": " ".join(sys.argv[1:])}
    results = {"meta": meta, "rows": rows, "filter_checks": checks}
    (RESULTS / f"{args.out}.json").write_text(json.dumps(results, indent=1))
    header = ("| W | conc | variant | requests | items/s | p50 s | p99 s | p99/p50 | peak/required KV blocks "
              "| invalid | wall vs fixed | top-100 overlap |\n" + "|---" * 12 + "|\n")
    lines = [f"| {r['width']} | {r['concurrency']} | {r['variant']}"
             f"{' ' + ','.join(map(str, r['schedule'])) if 'schedule' in r else ''} | {r['requests']} | "
             f"{r['items_per_s']} | {r['p50_s']} | {r['p99_s']} | {r['p99_over_p50']} | "
             f"{r['peak_kv_blocks']}/{r['required_kv_blocks']} | {r['invalid_items']} | "
             f"{r.get('wall_vs_fixed', '')} | {r.get('top100_overlap', '')} |" for r in rows]
    notes = [f"\nFilter check at W={c['width']}: {c['outside_filter']} items outside the filter of "
             f"{c['returned_items']} returned over {c['requests']} requests ({c['filter_check']})."
             for c in checks]
    (RESULTS / f"{args.out}.md").write_text(f"OneRec-shaped run ({json.dumps(meta)})\n\n" + header
                                            + "\n".join(lines) + "\n" + "\n".join(notes) + "\n")


if __name__ == "__main__":
    main()
