"""What a KV-cache dtype (`kv_cache_dtype`) costs in quality, against a float32 KV cache, on one model.

    python benchmarks/kv_quality.py --model smollm2-135m-instruct --kv-cache-dtypes int8 bfloat16 \
        --tokens 20000 --window 1024 --beam-widths 4 16 64 --beam-prompts 100 --beam-width-best 8 \
        --out kv_quality
    python benchmarks/kv_quality.py --tokens 2048 --beam-prompts 4 --out kv_quality_smoke   # minutes
    python benchmarks/kv_quality.py --parts genrec --genrec-width 256 --out kv_quality_genrec
    python benchmarks/kv_quality.py --model /path/to/your/model --dtype bfloat16 --kv-cache-dtypes int8

The same weights run with the reference KV cache (float32) and with each candidate; only what the
K/V are stored as differs. Four parts (`--parts`, default the first three; `--genrec` adds the fourth):

1. kl: per-token KL divergence and top-1 agreement over a held text. The text is the Python standard
   library's `pydoc_data.topics` (the language reference's topics as English prose: always installed,
   nothing to download; its version is the running Python's, recorded with a sha256), its topics
   joined in sorted order, tokenized with the model's tokenizer, the first `--tokens` tokens, cut into
   windows of `--window` tokens, each window its own sequence from position 0. Per window, two
   `ModelRunner`s on the one model (reference KV, candidate KV) run the window as prefill chunks of
   `--chunk` tokens, so every chunk after the first reads the earlier chunks' K/V back from the
   (quantized) cache, as decoding does; `execute(all_logits=True)` gives every position's logits. Per
   position: KL(p_ref || p_cand) over the full vocabulary in float64, and whether the argmaxes agree.
   Reported: mean and p99 KL, max KL, mean KL of the positions in later chunks only (those that read
   cached K/V of earlier chunks), top-1 agreement, tokens.
2. beams: two engines (`LLM(kv_cache_dtype=...)`, reference and candidate) run the same prompts with
   `BeamSearchParams(beam_width=W, max_new_tokens=--beam-new-tokens, num_return_sequences=W)` at each W
   of `--beam-widths`, over `--beam-prompts-overlap` prompts: the best hypothesis equal (token ids),
   and the rank overlap |returned_ref & returned_cand| / W of the returned sequences. Where the best
   differs, the reference's own score gap between its best and the candidate's best ("out": the
   reference did not return it): a near tie that flipped shows as a small gap.
3. best: the same at W = `--beam-width-best` over `--beam-prompts` prompts: the share whose best
   hypothesis is equal (the issue's bar: >= 95% of 100 prompts at W=8).
   Prompts of parts 2 and 3: distinct `--beam-prompt-tokens`-token slices of the held text, spread
   evenly over all of it, as raw token ids (no chat template). All prompts of a part go in one
   `generate` call per engine (int8 weights: one prompt per call, their activation scales are per batch).
4. genrec: the OneRec-shaped generative-retrieval benchmark (benchmarks/genrec_onerec.py's random-weight
   Qwen3 and Zipf catalogue, its --quick shape; `--genrec-layers`, `--genrec-items`): a shared prefix
   plus a short user part per request, catalogue-constrained beam search at `--genrec-width`; per request
   the overlap of the top-100 items with the float32-KV run, and whether the best item is equal.

`--int8-rotation k|kv|none`: which of an int8 cache's K and V are stored rotated by the Walsh-Hadamard
matrix (model/attention/quantized_kv.py: `ROTATE_K`, `ROTATE_V`; default the engine's, K alone), to
measure the alternatives; recorded in the results.

`--kv-cache-dtypes float32 int8` adds a control: float32 against itself must give KL 0, top-1 agreement
1 and equal beams (same inputs, same batches: bit for bit on a CPU), so what the others show is their KV's.

Writes benchmarks/results/NAME.json and NAME.md (`--out NAME`), and prints rich tables. On 2 CPU cores,
SmolLM2-135M: the smoke command above takes about 2.5 minutes (32 s of it part 1).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from widebeam.defaults import DEFAULT_MODEL
from widebeam.model.runner import ModelRunner, SequenceInput

RESULTS = Path(__file__).parent / "results"
REFERENCE_KV = "float32"
PARTS = ("kl", "beams", "best", "genrec")
INT8_ROTATIONS = {"k": (True, False), "kv": (True, True), "none": (False, False)}  # (K, V) stored rotated
ROTATED_NAMES = {"k": "K", "kv": "K and V", "none": "neither K nor V"}


# -- the held text ------------------------------------------------------------------------------------

def held_text() -> str:
    """The standard library's `pydoc_data.topics`, its topics in sorted order, blank-line separated."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


def held_text_info(text: str, num_tokens: int) -> dict:
    return {"source": f"pydoc_data.topics of Python {platform.python_version()} (sorted topics)",
            "chars": len(text), "sha256": hashlib.sha256(text.encode()).hexdigest(), "tokens": num_tokens}


def added_bos(tokenizer) -> int | None:
    """The BOS token the tokenizer puts before a text by itself, if it does (then every window starts
    with it, as a prompt would); None for tokenizers that add none (SmolLM2's)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    plain = tokenizer.encode("a", add_special_tokens=False)
    return bos if bos is not None and tokenizer.encode("a")[:1] == [bos] != plain[:1] else None


def beam_prompts(token_ids: list[int], count: int, prompt_tokens: int) -> list[list[int]]:
    """`count` distinct `prompt_tokens`-token slices of `token_ids`, spread evenly over all of it."""
    span = len(token_ids) - prompt_tokens
    if count < 1:
        return []
    if span < 0:
        raise ValueError(f"the text has {len(token_ids)} tokens, fewer than one {prompt_tokens}-token prompt")
    prompts, seen = [], set()
    for i in range(count):
        start = i * span // max(count - 1, 1)
        piece = tuple(token_ids[start:start + prompt_tokens])
        if piece not in seen:
            seen.add(piece)
            prompts.append(list(piece))
    return prompts


# -- part 1: per-token KL and top-1 agreement ---------------------------------------------------------

def runner_kv_dtype(kv_cache_dtype: str | None) -> str | None:
    """The runner's name for a KV dtype: "auto" (the model's) is None there."""
    return None if kv_cache_dtype in (None, "auto") else kv_cache_dtype


def make_runner(model: torch.nn.Module, window_tokens: int, tokens_per_block: int, device: torch.device,
                kv_cache_dtype: str | None, attention_backend: str | None = None) -> ModelRunner:
    """A runner whose every pool holds one window: blocks 0..n-1 of each pool."""
    from widebeam.model.families.arch import CROSS_POOL
    from widebeam.model.loading.build import model_dtype

    if CROSS_POOL in model.layer_pool_names:
        raise ValueError("the KL part runs decoder-only models (cross K/V need an encoder source)")
    num_blocks = -(-window_tokens // tokens_per_block)
    pools = {name: num_blocks for name in set(model.layer_pool_names)}
    kv = runner_kv_dtype(kv_cache_dtype)
    kwargs = {} if kv is None else {"kv_cache_dtype": kv}
    return ModelRunner(model, pools, tokens_per_block, device, model_dtype(model), attention_backend,
                       **kwargs)


def window_chunks(window_ids: list[int], chunk_tokens: int, tokens_per_block: int,
                  pool_names) -> list[SequenceInput]:
    """The window as consecutive prefill chunks of one sequence (slot = position: block b, offset o
    is slot b * t + o, and the block table is blocks 0..n-1)."""
    t = tokens_per_block
    chunks = []
    for start in range(0, len(window_ids), chunk_tokens):
        end = min(start + chunk_tokens, len(window_ids))
        blocks = list(range(-(-end // t)))
        chunks.append(SequenceInput(window_ids[start:end], start, {name: blocks for name in pool_names},
                                    {name: list(range(start, end)) for name in pool_names}))
    return chunks


def kl_and_agreement(reference_logits: torch.Tensor, candidate_logits: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: KL(p_ref || p_cand) over the full vocabulary in float64, and argmax equality."""
    log_ref = reference_logits.double().log_softmax(-1)
    log_cand = candidate_logits.double().log_softmax(-1)
    kl = (log_ref.exp() * (log_ref - log_cand)).sum(-1)
    return kl, reference_logits.argmax(-1) == candidate_logits.argmax(-1)


def token_kl(model: torch.nn.Module, token_ids: list[int], candidate_kvs: Sequence[str | None], *,
             reference_kv: str | None = REFERENCE_KV, window_tokens: int = 1024, chunk_tokens: int = 256,
             tokens_per_block: int = 16, device: torch.device | str = "cpu",
             attention_backend: str | None = None, candidate_model: torch.nn.Module | None = None,
             logit_noise_std: float = 0.0, seed: int = 0, bos_token_id: int | None = None) -> list[dict]:
    """KL(reference || candidate) and top-1 agreement at every position of `token_ids`, per candidate.

    The reference runs `model` with `reference_kv`, once for all candidates; each candidate runs
    `candidate_model` (default: the same model) with its KV dtype, plus Gaussian noise of
    `logit_noise_std` on its logits (0: none; a way to see the metric fail). `bos_token_id`: starts
    every window (which then holds one text token fewer), for models whose tokenizer adds one.
    Returns, in the order of `candidate_kvs`, each one's summary and per-position values."""
    device = torch.device(device)
    candidate_model = model if candidate_model is None else candidate_model
    reference = make_runner(model, window_tokens, tokens_per_block, device, reference_kv, attention_backend)
    candidates = [make_runner(candidate_model, window_tokens, tokens_per_block, device, kv, attention_backend)
                  for kv in candidate_kvs]
    pool_names = sorted(set(model.layer_pool_names))
    noise = [torch.Generator().manual_seed(seed) for _ in candidates]
    kls, agrees, later = [[] for _ in candidates], [[] for _ in candidates], []
    head = [] if bos_token_id is None else [bos_token_id]
    step = window_tokens - len(head)
    if step < 1:
        raise ValueError(f"a window of {window_tokens} tokens holds no text after the BOS")
    for start in range(0, len(token_ids), step):
        chunks = window_chunks(head + token_ids[start:start + step], chunk_tokens, tokens_per_block,
                               pool_names)
        for k, chunk in enumerate(chunks):
            ref_logits = reference.execute([chunk], all_logits=True).float().cpu()
            later.append(torch.full((len(chunk.token_ids),), k > 0))
            for i, candidate in enumerate(candidates):
                cand_logits = candidate.execute([chunk], all_logits=True).float().cpu()
                if logit_noise_std:
                    cand_logits = cand_logits + logit_noise_std * torch.randn(cand_logits.shape,
                                                                              generator=noise[i])
                kl, agree = kl_and_agreement(ref_logits, cand_logits)
                kls[i].append(kl)
                agrees[i].append(agree)
    later = torch.cat(later)
    results = []
    for kl, agree in zip(kls, agrees):
        kl, agree = torch.cat(kl), torch.cat(agree)
        results.append({"summary": summarize_kl(kl, agree, later), "kl": kl, "agree": agree})
    return results


def summarize_kl(kl: torch.Tensor, agree: torch.Tensor, later: torch.Tensor) -> dict:
    values = kl.numpy()
    later_values = values[later.numpy()]
    return {"tokens": int(values.size), "mean_kl": float(values.mean()),
            "p99_kl": float(np.percentile(values, 99)), "max_kl": float(values.max()),
            "mean_kl_later_chunks": float(later_values.mean()) if later_values.size else None,
            "later_chunk_tokens": int(later_values.size), "top1_agreement": float(agree.double().mean())}


# -- parts 2 and 3: beam agreement through the public API ---------------------------------------------

def beam_sets(llm, prompts: list[list[int]], width: int, new_tokens: int, one_per_call: bool) -> list[dict]:
    """Every prompt's returned hypotheses at beam width `width`: {token-id tuple: score}, best first."""
    from widebeam.params import BeamSearchParams

    params = BeamSearchParams(beam_width=width, max_new_tokens=new_tokens, num_return_sequences=width)
    batch = [{"prompt_token_ids": p} for p in prompts]
    if one_per_call:
        outputs = [out for item in batch for out in llm.generate([item], params, use_tqdm=False)]
    else:
        outputs = llm.generate(batch, params, use_tqdm=False)
    return [{tuple(c.token_ids): c.cumulative_logprob if c.score is None else c.score for c in out.outputs}
            for out in outputs]


def beam_agreement(reference: list[dict], candidate: list[dict], width: int) -> dict:
    """Best hypothesis equal, and |reference & candidate| / W of the returned sequences, per prompt
    (`beam_sets`' answers). Where the best differs: the reference's own score gap between its best and
    the candidate's best (a near tie flipped shows as a small gap), None where the reference did not
    return the candidate's best at all."""
    same_best, overlaps, gaps = 0, [], []
    for ref, cand in zip(reference, candidate):
        ref_best, cand_best = next(iter(ref), None), next(iter(cand), None)
        if ref_best is not None and ref_best == cand_best:
            same_best += 1
        elif ref_best is not None:
            gaps.append(round(ref[ref_best] - ref[cand_best], 4) if cand_best in ref else None)
        overlaps.append(len(ref.keys() & cand.keys()) / width)
    return {"width": width, "prompts": len(reference), "same_best": same_best,
            "same_best_share": same_best / max(len(reference), 1),
            "mean_overlap": float(np.mean(overlaps)) if overlaps else None,
            "min_overlap": float(min(overlaps)) if overlaps else None, "best_flip_score_gaps": gaps}


# -- part 4: the OneRec-shaped generative retrieval ---------------------------------------------------

def genrec_overlap(kv_dtypes: list[str], *, width: int, requests: int, items: int, layers: int,
                   device: str, kv_cache_memory: str, seed: int = 0) -> list[dict]:
    """Top-100 overlap and best item of each candidate KV dtype against float32 KV on the OneRec-shaped
    benchmark's --quick shape (its model and catalogue builders)."""
    import genrec_onerec as onerec

    from widebeam.llm import LLM
    from widebeam.params import BeamSearchParams

    codes, prefix_tokens, user_tokens = 1024, 576, 24  # genrec_onerec --quick
    rng = np.random.default_rng(seed)
    returned = {}
    with tempfile.TemporaryDirectory() as tmp:
        base_vocab = onerec.build_model(Path(tmp), "quick", codes, layers=layers)
        catalogue = onerec.make_catalogue(items, base_vocab, codes, rng)
        prefix = rng.integers(3, base_vocab, size=prefix_tokens).tolist()
        prompts = [{"prompt_token_ids": prefix + rng.integers(3, base_vocab, size=user_tokens).tolist()}
                   for _ in range(requests)]
        params = BeamSearchParams(beam_width=width, catalogue="onerec")
        for kv in [REFERENCE_KV, *kv_dtypes]:
            llm = LLM(tmp, dtype="float32", device=device, max_beam_width=width, enable_prefix_caching=True,
                      kv_cache_memory=kv_cache_memory, kv_cache_dtype=kv)
            llm.register_catalogue("onerec", catalogue)
            outputs = llm.generate(prompts, params, use_tqdm=False)
            returned[kv] = [[tuple(b.token_ids[:-1]) for b in out.outputs] for out in outputs]
            del llm
    rows = []
    for kv in kv_dtypes:
        overlaps = [len(set(r[:100]) & set(c[:100])) / max(1, min(100, len(r)))
                    for r, c in zip(returned[REFERENCE_KV], returned[kv])]
        same_best = sum(bool(r and c and r[0] == c[0]) for r, c in zip(returned[REFERENCE_KV], returned[kv]))
        rows.append({"kv_cache_dtype": kv, "width": width, "requests": requests, "items": len(catalogue),
                     "layers": layers, "mean_top100_overlap": float(np.mean(overlaps)),
                     "min_top100_overlap": float(min(overlaps)), "same_best_item": same_best})
    return rows


# -- the command --------------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL, help="an alias, a directory or a hub id")
    ap.add_argument("--dtype", default="float32", help="the weights' dtype (both runs)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--kv-cache-dtypes", nargs="+", default=["int8", "bfloat16"],
                    help="candidates, each against float32 KV")
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=["kl", "beams", "best"])
    ap.add_argument("--genrec", action="store_true", help="add part 4 (the OneRec-shaped benchmark)")
    ap.add_argument("--tokens", type=int, default=20000, help="held-text tokens scored (part 1)")
    ap.add_argument("--window", type=int, default=1024, help="tokens per window, each its own sequence")
    ap.add_argument("--chunk", type=int, default=256, help="prefill chunk tokens within a window")
    ap.add_argument("--tokens-per-block", type=int, default=16)
    ap.add_argument("--attention-backend", default=None)
    ap.add_argument("--beam-widths", type=int, nargs="+", default=[4, 16, 64])
    ap.add_argument("--beam-prompts-overlap", type=int, default=5, help="prompts per width (part 2)")
    ap.add_argument("--beam-prompts", type=int, default=100, help="prompts at --beam-width-best (part 3)")
    ap.add_argument("--beam-width-best", type=int, default=8)
    ap.add_argument("--beam-new-tokens", type=int, default=16)
    ap.add_argument("--beam-prompt-tokens", type=int, default=64)
    ap.add_argument("--genrec-width", type=int, default=256)
    ap.add_argument("--genrec-requests", type=int, default=4)
    ap.add_argument("--genrec-items", type=int, default=100_000)
    ap.add_argument("--genrec-layers", type=int, default=2)
    ap.add_argument("--kv-cache-memory", default="1GiB", help="each engine's KV budget (parts 2-4)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--int8-rotation", choices=sorted(INT8_ROTATIONS), default=None,
                    help="which of an int8 cache's K and V are stored rotated (default: the engine's)")
    ap.add_argument("--out", default="kv_quality", help="results file stem")
    ap.add_argument("--results-dir", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    if args.genrec and "genrec" not in args.parts:
        args.parts.append("genrec")
    for name in ("tokens", "window", "chunk", "tokens_per_block", "beam_width_best", "beam_new_tokens",
                 "beam_prompt_tokens", "genrec_width", "genrec_requests", "genrec_items", "genrec_layers",
                 "threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    import widebeam.defaults

    allowed = getattr(widebeam.defaults, "KV_CACHE_DTYPES", None)  # the engine's own list, where it has one
    unknown = [kv for kv in args.kv_cache_dtypes if allowed is not None and kv not in allowed]
    if unknown:
        ap.error(f"--kv-cache-dtypes: {', '.join(unknown)} not among {', '.join(allowed)}")
    if min(args.beam_widths) < 1 or args.beam_prompts < 0 or args.beam_prompts_overlap < 0:
        ap.error("beam widths must be >= 1 and prompt counts >= 0")
    return args


def engine(args, kv_cache_dtype: str, max_beam_width: int):
    from widebeam.llm import LLM

    return LLM(args.model, dtype=args.dtype, device=args.device, kv_cache_memory=args.kv_cache_memory,
               max_beam_width=max_beam_width, kv_cache_dtype=kv_cache_dtype,
               tokens_per_block=args.tokens_per_block, attention_backend=args.attention_backend)


def text_tokenizer(llm, model: str):
    """The tokenizer the held text is read with: the engine's (the one beside the weights)."""
    if llm.tokenizer is None:
        raise SystemExit(f"{model} has no tokenizer beside its weights: the held text needs one")
    return llm.tokenizer


def main(argv=None) -> int:
    from tables import machine_info

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from widebeam.model.attention import quantized_kv

    if args.int8_rotation is not None:  # before any pool is built: a pool's rotation is fixed when it is
        quantized_kv.ROTATE_K, quantized_kv.ROTATE_V = INT8_ROTATIONS[args.int8_rotation]
    rotation = {v: k for k, v in INT8_ROTATIONS.items()}[(quantized_kv.ROTATE_K, quantized_kv.ROTATE_V)]
    beam_parts = [p for p in ("beams", "best") if p in args.parts]
    max_width = max([*args.beam_widths, args.beam_width_best]) if beam_parts else 1
    report = {"command": " ".join(["benchmarks/kv_quality.py", *(sys.argv[1:] if argv is None else argv)]),
              "model": args.model, "dtype": args.dtype, "device": args.device, "reference_kv": REFERENCE_KV,
              "candidates": args.kv_cache_dtypes, "int8_rotation": rotation, "seconds": {}}
    needs_model = "kl" in args.parts or beam_parts
    reference = engine(args, REFERENCE_KV, max_width) if needs_model else None
    if needs_model:
        tokenizer = text_tokenizer(reference, args.model)
        text = held_text()
        token_ids = tokenizer.encode(text, add_special_tokens=False)
        report["held_text"] = held_text_info(text, len(token_ids))
    if "kl" in args.parts:
        begin = time.perf_counter()
        scored = token_ids[:args.tokens]
        report["kl"] = {"window": args.window, "chunk": args.chunk, "rows": []}
        results = token_kl(reference.engine.model, scored, args.kv_cache_dtypes, window_tokens=args.window,
                           chunk_tokens=args.chunk, tokens_per_block=args.tokens_per_block,
                           device=args.device, attention_backend=args.attention_backend,
                           bos_token_id=added_bos(tokenizer))
        for kv, result in zip(args.kv_cache_dtypes, results):
            report["kl"]["rows"].append({"kv_cache_dtype": kv, **result["summary"]})
            print(json.dumps(report["kl"]["rows"][-1]), flush=True)
        report["seconds"]["kl"] = round(time.perf_counter() - begin, 1)
    if beam_parts:
        begin = time.perf_counter()
        one_per_call = args.dtype == "int8"
        overlap_prompts = beam_prompts(token_ids, args.beam_prompts_overlap, args.beam_prompt_tokens)
        best_prompts = beam_prompts(token_ids, args.beam_prompts, args.beam_prompt_tokens)
        runs = ([("beams", w, overlap_prompts) for w in args.beam_widths] if "beams" in beam_parts else [])
        runs += [("best", args.beam_width_best, best_prompts)] if "best" in beam_parts else []
        refs = [beam_sets(reference, prompts, w, args.beam_new_tokens, one_per_call)
                for _, w, prompts in runs]
        del reference  # one model at a time beside the candidate's
        rows = []
        for kv in args.kv_cache_dtypes:
            candidate = engine(args, kv, max_width)
            for (part, width, prompts), ref in zip(runs, refs):
                got = beam_sets(candidate, prompts, width, args.beam_new_tokens, one_per_call)
                rows.append({"part": part, "kv_cache_dtype": kv, **beam_agreement(ref, got, width)})
                print(json.dumps(rows[-1]), flush=True)
            del candidate
        report["beams"] = {"new_tokens": args.beam_new_tokens, "prompt_tokens": args.beam_prompt_tokens,
                           "one_prompt_per_call": one_per_call, "rows": rows}
        report["seconds"]["beams"] = round(time.perf_counter() - begin, 1)
    if "genrec" in args.parts:
        begin = time.perf_counter()
        report["genrec"] = genrec_overlap(args.kv_cache_dtypes, width=args.genrec_width,
                                          requests=args.genrec_requests, items=args.genrec_items,
                                          layers=args.genrec_layers, device=args.device,
                                          kv_cache_memory=args.kv_cache_memory)
        for row in report["genrec"]:
            print(json.dumps(row), flush=True)
        report["seconds"]["genrec"] = round(time.perf_counter() - begin, 1)
    report["machine"] = machine_info(args.threads)
    write_report(report, args.results_dir, args.out)
    return 0


def report_tables(report: dict) -> list[tuple[str, list[str], list[list[str]], str]]:
    """(title, headers, rows, aligns) of each part in `report`."""
    tables = []
    if "kl" in report:
        kl = report["kl"]
        rows = [[r["kv_cache_dtype"], f"{r['mean_kl']:.3g}", f"{r['p99_kl']:.3g}", f"{r['max_kl']:.3g}",
                 "" if r["mean_kl_later_chunks"] is None else f"{r['mean_kl_later_chunks']:.3g}",
                 f"{100 * r['top1_agreement']:.2f}%", f"{r['tokens']:,}"] for r in kl["rows"]]
        title = f"KL(float32 KV || candidate) per token, windows of {kl['window']}, chunks of {kl['chunk']}"
        tables.append((title, ["KV dtype", "mean KL", "p99 KL", "max KL", "mean KL, later chunks",
                               "top-1 agreement", "tokens"], rows, "lrrrrrr"))
    if "beams" in report:
        rows = [[r["kv_cache_dtype"], str(r["width"]), str(r["prompts"]),
                 f"{r['same_best']} ({100 * r['same_best_share']:.0f}%)",
                 f"{r['mean_overlap']:.3f}" if r["mean_overlap"] is not None else "",
                 f"{r['min_overlap']:.3f}" if r["min_overlap"] is not None else "",
                 flip_gaps(r["best_flip_score_gaps"])]
                for r in report["beams"]["rows"]]
        title = (f"Beams against float32 KV ({report['beams']['new_tokens']} new tokens, "
                 f"{report['beams']['prompt_tokens']}-token prompts)")
        tables.append((title, ["KV dtype", "W", "prompts", "best equal", "mean top-W overlap", "min overlap",
                               "flips: ref's score gap"], rows, "lrrrrrl"))
    if "genrec" in report:
        rows = [[r["kv_cache_dtype"], str(r["width"]), str(r["requests"]), f"{r['items']:,}",
                 str(r["layers"]),
                 f"{r['mean_top100_overlap']:.3f}", f"{r['min_top100_overlap']:.3f}",
                 f"{r['same_best_item']} of {r['requests']}"] for r in report["genrec"]]
        tables.append(("OneRec-shaped retrieval against float32 KV (top-100 items)",
                       ["KV dtype", "W", "requests", "items", "layers", "mean top-100 overlap",
                        "min overlap", "best item equal"], rows, "lrrrrrrr"))
    return tables


def flip_gaps(gaps: list, shown: int = 6) -> str:
    """The reference's score gaps of the flipped best beams, smallest first ("out": not in its list)."""
    ordered = sorted(gaps, key=lambda g: float("inf") if g is None else g)
    text = ", ".join("out" if g is None else f"{g:.3g}" for g in ordered[:shown])
    return text + (f" (+{len(gaps) - shown})" if len(gaps) > shown else "")


def write_report(report: dict, results_dir: Path, name: str) -> None:
    from tables import markdown_table, print_table

    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / f"{name}.json").write_text(json.dumps(report, indent=1))
    lines = [(f"KV-cache quality against float32 KV: {report['model']}, {report['dtype']} weights, "
              f"{report['device']} (`{report['command']}`).\n")]
    if "int8" in report["candidates"] and "int8_rotation" in report:
        lines.append(f"int8 stores rotated (Walsh-Hadamard): {ROTATED_NAMES[report['int8_rotation']]}.\n")
    if "held_text" in report:
        held = report["held_text"]
        lines.append(f"Held text: {held['source']}, {held['chars']:,} characters, {held['tokens']:,} tokens, "
                     f"sha256 {held['sha256'][:16]}.\n")
    for title, headers, rows, aligns in report_tables(report):
        print_table(title, headers, rows, aligns)
        lines += [f"**{title}**\n", markdown_table(headers, rows, aligns)]
    (results_dir / f"{name}.md").write_text("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
