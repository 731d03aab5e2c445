"""Translation-style beam search: widebeam vs CTranslate2 vs transformers on NLLB- and T5-shaped models.

Models: random-init weights in the shapes of `facebook/nllb-200-distilled-600M` (M2M100: d_model 1024,
12 + 12 layers, 16 heads, ffn 4096, 256,206-token vocabulary, scaled embeddings, ReLU, pre-norm) and
`t5-small` (d_model 512, d_kv 64, 6 + 6 layers, 8 heads, d_ff 2048, 32,128 tokens, ReLU, tied head),
plus `marian` (opus-mt-en-de's shape) on the same code path. No package ships the weights and no test or
bench reaches a hub, so the work per token is the real model's and the output is noise. Each model is
saved once as safetensors under `<widebeam cache>/bench-seq2seq/` and converted for CTranslate2 with its
own converter (`ctranslate2.converters.TransformersConverter`, `widebeam/bench_ct2.py`), float32 and int8.

The tokenizer: the converter reads the model's vocabulary from its tokenizer, and every engine here is
given token ids, so the tokenizer only has to name the model's ids. Training a SentencePiece model of
256k pieces is not possible on toy text (it stops at the pieces the text holds), so the vocabulary is
built directly: a `tokenizers` WordLevel model with exactly `vocab_size` entries (the family's special
tokens at their real ids: NLLB `<s> <pad> </s> <unk>` = 0-3, T5 `<pad> </s> <unk>` = 0-2, Marian
`</s> <unk>` = 0-1 and `<pad>` last), wrapped in transformers' generic `PreTrainedTokenizerFast` (the
families' own classes build their vocabulary from a SentencePiece file; the converter needs only
`get_vocab` and the special tokens, and pads nothing since the sizes match).

Sources: S (32) fixed pseudo-random sources of 48-64 tokens ending in EOS. Every engine decodes exactly
N (64) tokens per source: `min_new_tokens` = `max_new_tokens` = N in widebeam and transformers,
`min_decoding_length` = `max_decoding_length` = N in CTranslate2's `Translator.translate_batch`.
widebeam gets all sources at once (its scheduler admits what its KV budget holds); transformers and
CTranslate2 get them in batches of `--peer-max-beams // W` sources (at least 1), since a batch of
S x W beams copies the encoder K/V per beam and the logits of S x W x 256k floats per step.

One process, `--threads` (2) threads: widebeam and transformers in it, CTranslate2 in a spawned worker
of its own (its OpenMP runtime slows later torch work in the same process, see bench_ct2.py). After a
warm-up of every side, each width runs the sides one after the other (interleaved, the order rotated
per width), with `--settle-s` idle between runs. Per side: wall time, tokens/s (S x N output tokens per
second; beam tokens/s = W times that), peak RSS (VmHWM reset before the run; widebeam and transformers
share a process, so their peak includes both models' weights: `rss_growth` is the run's own rise), and
widebeam's speed-up over each peer. `same best` counts sources whose best hypothesis equals widebeam's
(random weights give near-ties, so float differences may flip later tokens; the parity tests are exact).

Cost, so as to size a run: a beam token costs about 2 x (decoder + head) parameters in FLOPs. NLLB's
head alone is 262M parameters (0.5 GFLOP a beam token), so the full sweep (32 sources x 64 tokens x
(1 + 4 + 16 + 64) beams) is ~1.5 x 10^5 GFLOP of matmuls per engine and dtype, ~10^6 for the three
engines in two dtypes: about two hours of 2 cores' matmuls alone;
`--quick` runs 4 sources at W = 1, 4, 16, and `--sources`, `--layers` (it cuts everything but the head),
`--widths`, `--dtypes` and `--append` (add points to the JSON) size a run to the time at hand.

    python benchmarks/seq2seq.py --quick --models nllb t5 --layers 2
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tables import machine_info, markdown_table, print_table  # benchmarks/ is on sys.path as a script

from widebeam.bench import peak_rss_bytes, reset_peak_rss
from widebeam.memstats import rss_bytes
from widebeam.units import format_bytes

DEFAULT_JSON = "benchmarks/results/seq2seq.json"
SIDES = ("widebeam", "ctranslate2", "transformers")


@dataclass(frozen=True)
class Family:
    """A model shape: its transformers config, the special tokens at their ids, and which config keys
    hold the depth (cut by `--layers`)."""

    hf_name: str  # the real checkpoint whose shape this is
    config_class: str
    model_class: str
    config: dict
    special_tokens: dict  # id -> token; the other ids are named w<id>
    depth_keys: tuple[str, ...]
    suppress_ids: tuple[int, ...] = ()  # never generated (Marian's pad, its decoder start)
    extra: dict = field(default_factory=dict)  # tokenizer roles: bos/eos/pad/unk -> token

    @property
    def vocab_size(self) -> int:
        return self.config["vocab_size"]

    def token_id(self, role: str) -> int:
        token = self.extra[role]
        return next(i for i, t in self.special_tokens.items() if t == token)


_M2M100_SPECIALS = {0: "<s>", 1: "<pad>", 2: "</s>", 3: "<unk>"}
_T5_SPECIALS = {0: "<pad>", 1: "</s>", 2: "<unk>"}
_MARIAN_SPECIALS = {0: "</s>", 1: "<unk>", 58100: "<pad>"}

FAMILIES = {
    "nllb": Family(
        "facebook/nllb-200-distilled-600M", "M2M100Config", "M2M100ForConditionalGeneration",
        {"vocab_size": 256206, "d_model": 1024, "encoder_layers": 12, "decoder_layers": 12,
         "encoder_attention_heads": 16, "decoder_attention_heads": 16, "encoder_ffn_dim": 4096,
         "decoder_ffn_dim": 4096, "max_position_embeddings": 1024, "scale_embedding": True,
         "activation_function": "relu", "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2,
         "decoder_start_token_id": 2, "dropout": 0.0, "attention_dropout": 0.0, "activation_dropout": 0.0},
        _M2M100_SPECIALS, ("encoder_layers", "decoder_layers"),
        extra={"bos_token": "<s>", "pad_token": "<pad>", "eos_token": "</s>", "unk_token": "<unk>"}),
    "t5": Family(
        "t5-small", "T5Config", "T5ForConditionalGeneration",
        {"vocab_size": 32128, "d_model": 512, "d_kv": 64, "num_layers": 6, "num_decoder_layers": 6,
         "num_heads": 8, "d_ff": 2048, "feed_forward_proj": "relu", "tie_word_embeddings": True,
         "pad_token_id": 0, "eos_token_id": 1, "decoder_start_token_id": 0, "dropout_rate": 0.0},
        _T5_SPECIALS, ("num_layers", "num_decoder_layers"),
        extra={"pad_token": "<pad>", "eos_token": "</s>", "unk_token": "<unk>"}),
    "marian": Family(
        "Helsinki-NLP/opus-mt-en-de", "MarianConfig", "MarianMTModel",
        {"vocab_size": 58101, "decoder_vocab_size": 58101, "d_model": 512, "encoder_layers": 6,
         "decoder_layers": 6, "encoder_attention_heads": 8, "decoder_attention_heads": 8,
         "encoder_ffn_dim": 2048, "decoder_ffn_dim": 2048, "max_position_embeddings": 512,
         "share_encoder_decoder_embeddings": True, "tie_word_embeddings": True,
         "activation_function": "swish", "scale_embedding": True, "pad_token_id": 58100,
         "decoder_start_token_id": 58100, "eos_token_id": 0, "dropout": 0.0, "attention_dropout": 0.0,
         "activation_dropout": 0.0},
        _MARIAN_SPECIALS, ("encoder_layers", "decoder_layers"), suppress_ids=(58100,),
        extra={"pad_token": "<pad>", "eos_token": "</s>", "unk_token": "<unk>"}),
}


def model_config(family: Family, layers: int | None, overrides: dict | None = None) -> dict:
    """The family's config with its depth cut to `layers` (None: the real depth) and `overrides` applied
    (tests shrink every dimension); the special-token ids are kept as they are."""
    config = dict(family.config)
    if layers is not None:
        config.update({key: layers for key in family.depth_keys})
    config.update(overrides or {})
    return config


def save_tokenizer(family: Family, vocab_size: int, path: Path):
    """A WordLevel tokenizer naming exactly `vocab_size` ids (see the module docstring)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # a tiny test model keeps its specials at the family's ids, except Marian's pad, which is the last id
    specials = {(vocab_size - 1 if i >= vocab_size else i): t for i, t in family.special_tokens.items()}
    vocab = {specials.get(i, f"w{i}"): i for i in range(vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=family.extra["unk_token"]))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, **family.extra)
    tokenizer.save_pretrained(str(path))
    return tokenizer


def save_model(family: Family, path: Path, layers: int | None = None, overrides: dict | None = None,
               seed: int = 0) -> None:
    """Random-init weights of the family's shape as safetensors, a generation config stating the
    decoder start, EOS and pad (Marian: its pad never generated), and the tokenizer."""
    import transformers

    config = model_config(family, layers, overrides)
    vocab_size = config["vocab_size"]
    pad_id = config["pad_token_id"]
    hf_config = getattr(transformers, family.config_class)(**config)
    torch.manual_seed(seed)
    model = getattr(transformers, family.model_class)(hf_config).eval()
    suppress = [[pad_id]] if family.suppress_ids else None
    model.generation_config = transformers.GenerationConfig(
        decoder_start_token_id=config["decoder_start_token_id"], eos_token_id=config["eos_token_id"],
        pad_token_id=pad_id, bos_token_id=config.get("bos_token_id"), bad_words_ids=suppress, num_beams=1)
    model.save_pretrained(str(path), safe_serialization=True)
    save_tokenizer(family, vocab_size, path)


def cached_model_dir(name: str, layers: int | None, cache_dir: Path) -> Path:
    """The family's model directory, built on first use; the name carries a hash of the config, so a
    changed shape is a new directory (and a new CTranslate2 conversion)."""
    family = FAMILIES[name]
    config = model_config(family, layers)
    key = json.dumps([family.model_class, config], sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:10]
    path = cache_dir / "bench-seq2seq" / f"{name}-L{layers or 'full'}-{digest}"
    if not (path / "tokenizer.json").exists():
        path.mkdir(parents=True, exist_ok=True)
        save_model(family, path, layers)
    return path


def make_sources(count: int, vocab_size: int, special_ids, eos_id: int, seed: int = 1,
                 min_len: int = 48, max_len: int = 64) -> list[list[int]]:
    """`count` fixed pseudo-random sources of `min_len`..`max_len` tokens (EOS last), no special ids."""
    gen = torch.Generator().manual_seed(seed)
    banned = set(special_ids)
    sources = []
    for i in range(count):
        length = min_len + (i * 7) % (max_len - min_len + 1)
        ids = [t for t in torch.randint(0, vocab_size, (2 * length,), generator=gen).tolist()
               if t not in banned][:length - 1]
        sources.append(ids + [eos_id])
    return sources


def run_widebeam(llm, sources: list[list[int]], width: int, new_tokens: int) -> dict:
    from widebeam.params import BeamSearchParams

    params = BeamSearchParams(beam_width=width, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    reset_peak_rss()
    before = rss_bytes() or 0
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": s} for s in sources], params, use_tqdm=False)
    wall = time.perf_counter() - start
    peak = peak_rss_bytes()
    return {"wall_s": wall, "peak_rss_bytes": peak, "rss_growth_bytes": max(0, peak - before),
            "best": [list(out.outputs[0].token_ids) for out in outs]}


def run_transformers(model, sources: list[list[int]], width: int, new_tokens: int,
                     batch_sources: int) -> dict:
    """transformers' beam search, `batch_sources` sources per `generate` (right-padded, masked)."""
    pad = model.generation_config.pad_token_id
    reset_peak_rss()
    before = rss_bytes() or 0
    best = []
    start = time.perf_counter()
    with torch.inference_mode():
        for first in range(0, len(sources), batch_sources):
            batch = sources[first:first + batch_sources]
            longest = max(map(len, batch))
            ids = torch.tensor([s + [pad] * (longest - len(s)) for s in batch])
            mask = torch.tensor([[1] * len(s) + [0] * (longest - len(s)) for s in batch])
            out = model.generate(input_ids=ids, attention_mask=mask, num_beams=width, do_sample=False,
                                 max_new_tokens=new_tokens, min_new_tokens=new_tokens)
            best += out[:, 1:].tolist()  # without the decoder start token
    wall = time.perf_counter() - start
    peak = peak_rss_bytes()
    return {"wall_s": wall, "peak_rss_bytes": peak, "rss_growth_bytes": max(0, peak - before), "best": best}


class Sides:
    """The three engines over one model directory and dtype; `run(side, ...)` times one of them."""

    def __init__(self, model_dir: Path, dtype: str, threads: int, max_width: int, kv_cache_memory: str,
                 sides=SIDES, ct2_cache: Path | None = None):
        from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

        from widebeam.llm import LLM

        self.sides = tuple(sides)
        self.llm = None
        if "widebeam" in self.sides:  # no prefix cache: every source encoded in every run, as the peers do
            self.llm = LLM(str(model_dir), dtype=dtype, device="cpu", kv_cache_memory=kv_cache_memory,
                           max_beam_width=max_width, enable_prefix_caching=False)
        self.hf = None
        if "transformers" in self.sides:
            self.hf = AutoModelForSeq2SeqLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
            if dtype == "int8":  # the same int8 linears as widebeam's: the same kernels, a fair peer
                from widebeam.model.linears.int8 import quantize_int8

                self.hf = quantize_int8(self.hf, torch.device("cpu"))
                for name, module in self.hf.named_modules():
                    if name.endswith(".wo"):
                        # transformers' T5 feed-forward reads `wo.weight.dtype` to cast its input, and
                        # skips the cast for int8: an empty int8 tensor says so (Int8Linear has no weight)
                        module.weight = torch.empty(0, dtype=torch.int8)
        self.ct2 = None
        if "ctranslate2" in self.sides:
            from widebeam.bench_ct2 import CT2TranslatorPeer
            from widebeam.model.loading.sources import default_cache_dir

            tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
            self.ct2 = CT2TranslatorPeer(model_dir, dtype, threads, ct2_cache or default_cache_dir(),
                                         tokenizer)

    def run(self, side: str, sources, width: int, new_tokens: int, peer_max_beams: int) -> dict:
        batch_sources = max(1, peer_max_beams // width)
        if side == "widebeam":
            return run_widebeam(self.llm, sources, width, new_tokens)
        if side == "transformers":
            return run_transformers(self.hf, sources, width, new_tokens, batch_sources)
        return self.ct2.run(sources, width, new_tokens, batch_sources)

    def close(self) -> None:
        if self.ct2 is not None:
            self.ct2.close()


def bench_point(sides: Sides, sources, width: int, new_tokens: int, order, peer_max_beams: int = 256,
                settle_s: float = 0.0, repeats: int = 1) -> dict:
    """One width: each side in `order`, `repeats` rounds; per side its fastest run (the machine's noise
    only ever adds time), every run's wall time kept, and widebeam's speed-ups."""
    row, best = {"beam_width": width, "sources": len(sources), "new_tokens": new_tokens}, {}
    for _ in range(repeats):
        for side in order:
            time.sleep(settle_s)
            result = sides.run(side, sources, width, new_tokens, peer_max_beams)
            best[side] = result.pop("best")
            result["all_lengths_n"] = all(len(b) == new_tokens for b in best[side])
            runs = row.get(side, {}).get("wall_s_runs", []) + [result["wall_s"]]
            if side not in row or result["wall_s"] < row[side]["wall_s"]:
                row[side] = result
            row[side]["wall_s_runs"] = runs
    for side in order:
        row[side]["tokens_per_s"] = len(sources) * new_tokens / row[side]["wall_s"]
        row[side]["beam_tokens_per_s"] = width * row[side]["tokens_per_s"]
    for side in order:
        if side != "widebeam" and "widebeam" in row:
            row[side]["widebeam_speedup"] = row[side]["wall_s"] / row["widebeam"]["wall_s"]
            row[side]["same_best_sources"] = sum(a == b for a, b in zip(best[side], best["widebeam"]))
    row["best"] = best  # dropped before the JSON; the smoke test reads it
    return row


# issue #31's targets: (dtype, W, peer, least widebeam speed-up)
TARGETS = (("float32", 4, "ctranslate2", 1.0), ("float32", 16, "ctranslate2", 3.0),
           ("int8", 4, "ctranslate2", 1.0), ("float32", 64, "transformers", 10.0))


def target_lines(rows: list[dict]) -> list[str]:
    """Each of issue #31's targets measured, with both engines' time per decode step (the run's wall time
    over N: all sources' beams advance one token, the encoder's share included)."""
    lines = []
    for model in dict.fromkeys(r["model"] for r in rows):
        for dtype, width, peer, least in TARGETS:
            row = next((r for r in rows if (r["model"], r["dtype"], r["beam_width"]) == (model, dtype, width)
                        and peer in r and "widebeam" in r), None)
            if row is None:
                continue
            got = row[peer]["widebeam_speedup"]
            steps_ms = {side: 1000 * row[side]["wall_s"] / row["new_tokens"] for side in ("widebeam", peer)}
            lines.append(f"- {model} {dtype} W={width}, {row['sources']} sources: {got:.2f}x {peer} "
                         f"(target >= {least:g}x): " + ("met" if got >= least else "**missed**")
                         + f"; {steps_ms['widebeam']:.0f} vs {steps_ms[peer]:.0f} ms per step")
    return lines


def table_rows(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    headers = ["model", "dtype", "W", "S", "widebeam s", "CT2 s", "HF s", "widebeam tok/s", "CT2 tok/s",
               "HF tok/s", "x CT2", "x HF", "RSS widebeam", "RSS CT2", "RSS HF", "same best CT2 · HF"]
    out = []
    for r in rows:
        def cell(side, key, fmt, r=r):
            return fmt(r[side][key]) if side in r and key in r[side] else "-"

        same = " · ".join(str(r[s]["same_best_sources"]) if s in r and "same_best_sources" in r[s] else "-"
                          for s in SIDES[1:])
        out.append([r["model"] + (f" L{r['layers']}" if r.get("layers") else ""), r["dtype"],
                    str(r["beam_width"]), str(r["sources"]),
                    *(cell(s, "wall_s", lambda v: f"{v:.2f}") for s in SIDES),
                    *(cell(s, "tokens_per_s", lambda v: f"{v:.0f}") for s in SIDES),
                    *(cell(s, "widebeam_speedup", lambda v: f"{v:.2f}x") for s in SIDES[1:]),
                    *(cell(s, "peak_rss_bytes", format_bytes) for s in SIDES),
                    f"{same} of {r['sources']}"])
    return headers, out


def write_results(results: dict, json_path: Path) -> None:
    """`results`: the machine, the commands, the points and the profiles; JSON and its markdown table."""
    rows = results["points"]
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(results, indent=2) + "\n")
    headers, cells = table_rows(rows)
    models = dict.fromkeys(f"{r['model']} ({FAMILIES[r['model']].hf_name})" for r in rows)
    new_tokens = sorted({r["new_tokens"] for r in rows})
    about = (f"Random-init weights in the real shapes: {', '.join(models)}; S sources of 48-64 tokens, "
             f"N = {', '.join(map(str, new_tokens))} new tokens each (min = max), "
             f"{results['threads']} threads, {results['machine']['cpu']}. tok/s: output tokens (S x N) per "
             "second (beam tokens: W times that); x CT2 / x HF: widebeam's speed-up over that peer. RSS: "
             "peak process memory (widebeam and transformers share one process, both models resident; "
             "CTranslate2 runs in its own). same best: sources whose best hypothesis is widebeam's (random "
             "weights have near-ties).\n")
    md = ["# seq2seq beam search: widebeam vs CTranslate2 vs transformers\n",
          "\n".join(f"`{command}`" for command in results["commands"]) + "\n", about,
          markdown_table(headers, cells, "llrr" + "r" * (len(headers) - 4)),
          "\n## Targets (issue #31)\n", "".join(line + "\n" for line in target_lines(rows))]
    for name, top in results.get("profiles", {}).items():
        cells = [[f"`{t['function']}`", str(t["calls"]), f"{t['own_s']:.2f}"] for t in top]
        md += [f"\n## Where widebeam's time goes: {name} (cProfile, own time)\n",
               markdown_table(["function", "calls", "own s"], cells, "lrr")]
    json_path.with_suffix(".md").write_text("\n".join(md))


def profile_widebeam(llm, sources, width: int, new_tokens: int, top: int = 8) -> list[dict]:
    """One more widebeam run (untimed) under cProfile: the functions with the most own time."""
    import cProfile
    import pstats

    from widebeam.params import BeamSearchParams

    params = BeamSearchParams(beam_width=width, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    profiler = cProfile.Profile()
    profiler.runcall(llm.generate, [{"prompt_token_ids": s} for s in sources], params, use_tqdm=False)
    # (file, line, name) -> (primitive calls, calls, own time, cumulative time, callers)
    stats = pstats.Stats(profiler).stats
    ranked = sorted(stats.items(), key=lambda item: item[1][2], reverse=True)[:top]
    return [{"function": f"{Path(file).name}:{line}({name})" if line else name, "calls": calls,
             "own_s": own} for (file, line, name), (_, calls, own, _, _) in ranked]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=sorted(FAMILIES), default=["nllb", "t5"])
    parser.add_argument("--dtypes", nargs="+", choices=["float32", "int8"], default=["float32", "int8"])
    parser.add_argument("--widths", type=int, nargs="+", help="default 1 4 16 64 (--quick: 1 4 16)")
    parser.add_argument("--sources", type=int, help="default 32 (--quick: 4)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--layers", type=int, help="encoder and decoder depth (default: the real model's)")
    parser.add_argument("--quick", action="store_true", help="a smaller run: 4 sources, W = 1 4 16")
    parser.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES))
    parser.add_argument("--repeats", type=int, default=1,
                        help="rounds of the sides per width; each side's fastest is reported (default 1)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-cache-memory", default="4GiB", help="widebeam's KV budget (default 4GiB)")
    parser.add_argument("--peer-max-beams", type=int, default=256,
                        help="transformers and CTranslate2 get max(1, this // W) sources per batch")
    parser.add_argument("--settle-s", type=float, default=0.5,
                        help="idle seconds before each timed run (the last side's OpenMP threads sleep)")
    parser.add_argument("--append", action="store_true",
                        help="add to the JSON's points (a point measured again replaces the old one)")
    parser.add_argument("--profile-widebeam", type=int, metavar="W",
                        help="after each sweep, one widebeam run at W under cProfile (untimed)")
    parser.add_argument("--json", default=DEFAULT_JSON, help=f"results JSON; the table goes beside it as .md "
                                                             f"(default {DEFAULT_JSON})")
    args = parser.parse_args(argv)
    args.widths = args.widths or ([1, 4, 16] if args.quick else [1, 4, 16, 64])
    args.sources = args.sources or (4 if args.quick else 32)
    return args


def main(argv=None) -> None:
    import shlex
    import sys

    from widebeam.model.loading.sources import default_cache_dir

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    command = "python benchmarks/seq2seq.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    json_path = Path(args.json)
    results = {"commands": [], "points": [], "profiles": {}}
    if args.append and json_path.exists():
        results = json.loads(json_path.read_text())
    results.update({"threads": args.threads, "peer_max_beams": args.peer_max_beams,
                    "machine": machine_info(args.threads)})
    results["commands"].append(command)
    for name in args.models:
        family = FAMILIES[name]
        model_dir = cached_model_dir(name, args.layers, default_cache_dir())
        config = model_config(family, args.layers)
        specials = set(family.special_tokens) | set(family.suppress_ids)
        sources = make_sources(args.sources, config["vocab_size"], specials, config["eos_token_id"])
        for dtype in args.dtypes:
            sides = Sides(model_dir, dtype, args.threads, max(args.widths), args.kv_cache_memory, args.sides)
            warm = sources[:2]
            for side in args.sides:  # loads the CT2 worker (and converts on first use), warms every kernel
                sides.run(side, warm, min(2, max(args.widths)), 4, args.peer_max_beams)
            for k, width in enumerate(args.widths):
                order = args.sides[k % len(args.sides):] + args.sides[:k % len(args.sides)]
                row = bench_point(sides, sources, width, args.new_tokens, order, args.peer_max_beams,
                                  args.settle_s, args.repeats)
                row.pop("best")
                key = (name, dtype, args.layers, width)
                results["points"] = [r for r in results["points"]
                                     if (r["model"], r["dtype"], r["layers"], r["beam_width"]) != key]
                results["points"].append({"model": name, "dtype": dtype, "layers": args.layers, **row})
                print(json.dumps(results["points"][-1]), flush=True)
                write_results(results, json_path)
            if args.profile_widebeam:
                results["profiles"][f"{name} {dtype} W={args.profile_widebeam}"] = profile_widebeam(
                    sides.llm, sources, args.profile_widebeam, args.new_tokens)
                write_results(results, json_path)
            sides.close()
            del sides
            gc.collect()
    headers, cells = table_rows(results["points"])
    print_table("seq2seq beam search (same run)", headers, cells, "llrr" + "r" * (len(headers) - 4))
    print("\n".join(target_lines(results["points"])))


if __name__ == "__main__":
    main()
