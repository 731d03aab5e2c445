"""widebeam vs Hugging Face transformers beam search, side by side in one run (`widebeam bench`).

Same model, same prompts, dtype and thread count; the two engines alternate at every point after a
warm-up of both. Per point: wall time, beam-tokens/s, peak process memory (RSS high-water mark,
reset before each run), peak KV bytes held, and the compute floor: the time of the model's dense
matmuls alone for the same batch shapes (one prefill of P tokens, then N steps of W rows), measured
on this machine in the same run, with each engine's time as a multiple of it. A second floor adds
attention's own products (the prompt's causal attention, then every beam's queries against P + n keys
per step), which dominate long prompts and no engine can skip.

`--peers transformers ctranslate2` adds CTranslate2 (float32 and int8 rows, the same weights converted
once; `widebeam/bench_ct2.py`) at every point, with widebeam's speed-up over it and whether its best
beam is widebeam's.

Two sweeps: W in {1, 4, 16, 64} at P=512 (both engines), and a wide one, W in {64, 128, 256} x
P in {512, 2048, 4096}, where transformers is skipped, with the reason, when its KV for W x (P + N)
tokens would exceed `--hf-kv-limit`.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import time
from functools import partial
from pathlib import Path

from widebeam import memstats
from widebeam.argtypes import byte_size, int_at_least
from widebeam.defaults import DTYPES
from widebeam.engine_args import SPECULATIVE, add_engine_arguments, engine_kwargs
from widebeam.memstats import rss_bytes
from widebeam.units import format_bytes

# torch and transformers are imported where used: `widebeam plan` builds this parser too, and stays quick.

DEFAULT_OUT = "benchmarks/results/beam_vs_hf.json"
# transformers is the peer at every point, and it has no float16 CPU kernels worth timing
BENCH_DTYPES = tuple(d for d in DTYPES if d != "float16")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser, ["model"], model={
        "help": "alias or Hugging Face directory of a decoder-only model (default SmolLM2-135M)"})
    parser.add_argument("--widths", type=int_at_least(1), nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--prompt-lens", type=int_at_least(1), nargs="+", default=[512])
    parser.add_argument("--max-new-tokens", type=int_at_least(1), default=32)
    parser.add_argument("--wide-widths", type=int_at_least(1), nargs="+", default=[64, 128, 256])
    parser.add_argument("--wide-prompt-lens", type=int_at_least(1), nargs="+", default=[512, 2048, 4096])
    parser.add_argument("--no-wide", action="store_true", help="skip the wide sweep")
    parser.add_argument("--hf-kv-limit", type=byte_size, default=byte_size("4GiB"),
                        help="skip transformers when its W x (P+N) KV would exceed this (default 4GiB; "
                             "transformers also copies it every step, so its peak is about twice that)")
    add_engine_arguments(parser, ["kv_cache_memory", "tokens_per_block", "dtype", "linear_backend", "device",
                                  "kv_cache_dtype"],
                         kv_cache_memory={"default": "2GiB"},
                         dtype={"choices": BENCH_DTYPES,
                                "help": "int8: int8 linear weights (widebeam and transformers alike), "
                                        "float32 activations (default float32)"})
    parser.add_argument("--threads", type=int_at_least(1), default=2)
    parser.add_argument("--settle-s", type=float, default=1.0,
                        help="idle seconds before each timed run, so the previous engine's OpenMP threads, "
                             "which spin for a while after their last parallel region (CTranslate2's for 200 "
                             "ms), are asleep before the next engine starts (default 1)")
    parser.add_argument("--repeats", type=int_at_least(1), default=1,
                        help="runs of every engine at each point, the order reversed every other run; each "
                             "keeps its fastest (one run is at the mercy of the host's load: on a shared CPU "
                             "single runs of one point move by 10-30%%) (default 1)")
    parser.add_argument("--peers", nargs="+", choices=["transformers", "ctranslate2"],
                        default=["transformers"],
                        help="engines beside widebeam (ctranslate2: pip install ctranslate2; float32 and "
                             "int8, the model converted once into the cache; transformers is always run for "
                             "the floors)")
    parser.add_argument("--out", default=DEFAULT_OUT,
                        help=f"JSON path; the plot goes next to it (default {DEFAULT_OUT})")
    # widebeam's side only (transformers runs plain beam search); beam search stays exact with speculation
    add_engine_arguments(parser, SPECULATIVE)
    # every run computes its whole prompt either way (the cache is emptied before it, see run_widebeam);
    # --no-prefix-caching measures the engine without the cache's bookkeeping; its prompts are synthetic,
    # nothing there is worth pinning: no --pin-prefix
    add_engine_arguments(parser, ["enable_prefix_caching"])


def peak_rss_bytes() -> int:
    return rss_bytes("VmHWM") or 0


def reset_peak_rss() -> None:
    gc.collect()
    # heap freed by the previous run goes back to the OS, or this run's peak starts at its leftovers
    memstats.reset_peak_rss(trim_heap=True)


def make_prompt(tokenizer, prompt_len: int, vocab_size: int) -> list[int]:
    """A prompt of exactly `prompt_len` tokens: text when the model has a tokenizer, else a fixed
    pseudo-random id sequence (a model directory without one, as in tests)."""
    if tokenizer is None:
        return [(i * 7919 + 13) % (vocab_size - 3) + 3 for i in range(prompt_len)]
    text = " ".join(f"Record {i}: the {('red', 'green', 'blue')[i % 3]} crate weighs {i % 17} kg."
                    for i in range(prompt_len))
    return tokenizer.encode(text)[:prompt_len]


def synchronize(device) -> None:
    """Wait for the device's queued kernels (CUDA runs them asynchronously): a timer read without it
    measures the launches, not the work."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def linear_products(dtype, device) -> list:
    """The matrix products a floor may time a linear with (x, weight -> x W^T): `F.linear` everywhere, and
    for float32 on the CPU oneDNN's inner product where this build has it (faster than MKL's sgemm on
    some CPUs: an AMD EPYC, issue #43), so a floor is the best kernel's, not only torch's default."""
    import torch

    products = [torch.nn.functional.linear]
    if torch.device(device).type == "cpu" and dtype == torch.float32:
        from widebeam.model.linears.split import onednn_plain_available

        if onednn_plain_available():
            products.append(lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""))
    return products


def compute_floor_s(hf_model, prompt_len: int, width: int, new_tokens: int, dtype) -> float:
    """Dense matmuls only: every linear layer's weight times the step's activations, through the fastest
    product this build offers (`linear_products`)."""
    import torch

    weights = [m.weight for m in hf_model.modules() if isinstance(m, torch.nn.Linear)]
    head = hf_model.lm_head.weight
    hidden = head.shape[1]
    # Real-valued inputs made before timing: uninitialised memory can hold denormals, which make
    # CPU matmuls many times slower and the floor meaningless.
    device = head.device
    widths = {w.shape[1] for w in weights}
    inputs = {rows: {n: torch.randn(rows, n, dtype=dtype, device=device) for n in widths}
              for rows in (prompt_len, width, 1)}

    def pass_s(linear) -> float:
        synchronize(device)
        start = time.perf_counter()
        for rows, steps in ((prompt_len, 1), (width, new_tokens)):
            for _ in range(steps):
                for w in weights:
                    if w is not head:
                        linear(inputs[rows][w.shape[1]], w)
                head_rows = 1 if rows == prompt_len else rows  # prefill needs only the last token's logits
                linear(inputs[head_rows][hidden], head)
        synchronize(device)
        return time.perf_counter() - start

    with torch.inference_mode():
        return min(pass_s(linear) for linear in linear_products(dtype, device))


def attention_floor_s(hf_model, prompt_len: int, width: int, new_tokens: int, dtype) -> float:
    """Attention's own products, which no engine can skip: the prompt's causal attention once
    (fused SDPA), then per decode step and layer the W x heads queries against the P + n keys (QK^T
    and PV). Timed at the average context P + N/2, the best of 3 steps, times N."""
    import torch

    cfg = hf_model.config
    num_layers, num_heads = cfg.num_hidden_layers, cfg.num_attention_heads
    num_kv_heads = cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
    rows = width * (num_heads // num_kv_heads)  # the grouped heads of every beam share one KV head
    context = prompt_len + new_tokens // 2
    device = hf_model.device
    q = torch.randn(num_kv_heads, rows, head_dim, dtype=dtype, device=device)
    k_t = torch.randn(num_kv_heads, head_dim, context, dtype=dtype, device=device)
    probs = torch.softmax(torch.randn(num_kv_heads, rows, context, device=device), dim=-1).to(dtype)
    v = torch.randn(num_kv_heads, context, head_dim, dtype=dtype, device=device)
    qp = torch.randn(1, num_heads, prompt_len, head_dim, dtype=dtype, device=device)
    kp = torch.randn(1, num_heads, prompt_len, head_dim, dtype=dtype, device=device)
    with torch.inference_mode():
        synchronize(device)
        start = time.perf_counter()
        for _ in range(num_layers):
            torch.nn.functional.scaled_dot_product_attention(qp, kp, kp, is_causal=True)
        synchronize(device)
        prefill = time.perf_counter() - start
        step = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            for _ in range(num_layers):
                torch.bmm(q, k_t)
                torch.bmm(probs, v)
            synchronize(device)
            step = min(step, time.perf_counter() - start)
    return prefill + step * new_tokens


def run_widebeam(llm, prompt_ids: list[int], width: int, new_tokens: int) -> dict:
    from widebeam.params import BeamSearchParams

    # min_new_tokens = N bans EOS until the end, exactly as transformers is run below
    params = BeamSearchParams(beam_width=width, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    # The points' prompts share their starts (make_prompt) and a width repeats the previous point's
    # prompt: a cached prefix would skip the prefill transformers and the floors count, so none is kept.
    llm.engine.reset_prefix_cache()
    reset_peak_rss()
    start = time.perf_counter()
    (out,) = llm.generate([{"prompt_token_ids": prompt_ids}], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    spec = llm.engine.cache["self"].spec
    return {"wall_s": elapsed, "peak_rss_bytes": peak_rss_bytes(),
            "peak_kv_bytes": out.peak_blocks["self"]
                             * spec.bytes_per_block(llm.engine.cache.tokens_per_block),
            "best": out.outputs[0].token_ids, "num_cached_tokens": out.num_cached_tokens}


def hf_kv_bytes(hf_model, num_tokens: int) -> int:
    """What transformers' cache holds for `num_tokens` positions (every beam's own copy counted)."""
    cfg = hf_model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return (num_tokens * 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim
            * hf_model.dtype.itemsize)


def run_hf(hf_model, prompt_ids: list[int], width: int, new_tokens: int, eos_id: int) -> dict:
    import torch

    reset_peak_rss()
    synchronize(hf_model.device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([prompt_ids], device=hf_model.device), num_beams=width,
                                do_sample=False, max_new_tokens=new_tokens,
                                min_new_tokens=new_tokens, eos_token_id=eos_id, pad_token_id=eos_id)
    synchronize(hf_model.device)
    elapsed = time.perf_counter() - start
    return {"wall_s": elapsed, "peak_rss_bytes": peak_rss_bytes(),
            "peak_kv_bytes": hf_kv_bytes(hf_model, width * (len(prompt_ids) + new_tokens)),
            "best": out[0, len(prompt_ids):].tolist()}


def fastest_runs(sides: dict, repeats: int, settle_s: float) -> dict[str, dict]:
    """Each side's fastest result (a dict with "wall_s") over `repeats` runs of every side, the order
    reversed every other repeat so load drift favours none; `settle_s` idle before each run. Each result
    also lists every run's seconds in run order ("runs_s"), so a comparison can be read run by run."""
    best: dict[str, dict] = {}
    runs_s: dict[str, list[float]] = {name: [] for name in sides}
    for repeat in range(repeats):
        for name in (list(sides) if repeat % 2 == 0 else list(reversed(sides))):
            time.sleep(settle_s)
            result = sides[name]()
            runs_s[name].append(result["wall_s"])
            if name not in best or result["wall_s"] < best[name]["wall_s"]:
                best[name] = result
    return {name: {**result, "runs_s": runs_s[name]} for name, result in best.items()}


def run(args: argparse.Namespace) -> list[dict]:
    """Both sweeps; writes the JSON after every point (a long run keeps what it measured) and the plot."""
    import torch
    from transformers import AutoModelForCausalLM

    from widebeam.heap import freeze_startup_heap
    from widebeam.llm import LLM

    torch.set_num_threads(args.threads)
    points = [(w, p) for p in args.prompt_lens for w in args.widths]
    if not args.no_wide:
        points += [(w, p) for p in args.wide_prompt_lens for w in args.wide_widths if (w, p) not in points]
    # the warm-up below runs W=2
    llm = LLM(model=args.model, max_beam_width=max(2, *(w for w, _ in points)), **engine_kwargs(args))
    freeze_startup_heap()  # as `serve` and `batch` run (widebeam/heap.py)
    from widebeam.model.linears.int8 import quantize_int8
    from widebeam.model.loading.build import model_dtype

    dtype = model_dtype(llm.engine.model)
    device = llm.engine.device  # transformers runs where widebeam does (a GPU when there is one)
    hf = floor_model = AutoModelForCausalLM.from_pretrained(str(llm.engine.source.path),
                                                            dtype=dtype).eval().to(device)
    if args.dtype == "int8":  # transformers with the same int8 linears: the same kernels, a fair peer
        hf = quantize_int8(copy.deepcopy(floor_model), device)
    eos_id = min(llm.engine.eos_token_ids)

    vocab_size = llm.engine.model.arch.vocab_size
    ct2 = {}
    if "ctranslate2" in args.peers:
        from widebeam.bench_ct2 import COMPUTE_TYPES, CT2Peer
        from widebeam.model.loading.sources import default_cache_dir

        ct2 = {f"ctranslate2 {t}": CT2Peer(llm.engine.source.path, t, args.threads, default_cache_dir(),
                                           llm.tokenizer) for t in COMPUTE_TYPES}
    warm = make_prompt(llm.tokenizer, 64, vocab_size)
    run_widebeam(llm, warm, 2, 4)
    run_hf(hf, warm, 2, 4, eos_id)
    for peer in ct2.values():
        peer.run(warm, 2, 4, eos_id)

    out_path = Path(args.out)
    # the speculative settings a point ran with (none without speculation)
    spec_config = llm.engine.config.speculative
    speculative = {} if spec_config is None else {"speculative": {
        "method": spec_config.method, "model": spec_config.model,
        "num_speculative_tokens": spec_config.num_speculative_tokens}}
    rows = []
    for width, prompt_len in points:
        prompt_ids = make_prompt(llm.tokenizer, prompt_len, vocab_size)
        n = args.max_new_tokens
        row = {"beam_width": width, "prompt_len": len(prompt_ids), "max_new_tokens": n, "dtype": args.dtype,
               "linear_backend": args.linear_backend,
               "threads": args.threads, "tokens_per_block": args.tokens_per_block, "repeats": args.repeats,
               **speculative,
               "compute_floor_s": compute_floor_s(floor_model, len(prompt_ids), width, n, dtype),
               "attention_floor_s": attention_floor_s(floor_model, len(prompt_ids), width, n, dtype)}
        hf_kv = hf_kv_bytes(hf, width * (len(prompt_ids) + n))
        sides = {"widebeam": partial(run_widebeam, llm, prompt_ids, width, n)}
        if hf_kv <= args.hf_kv_limit:
            sides["transformers"] = partial(run_hf, hf, prompt_ids, width, n, eos_id)
        sides.update({name: partial(peer.run, prompt_ids, width, n, eos_id) for name, peer in ct2.items()})
        best = fastest_runs(sides, args.repeats, args.settle_s)
        wb = best["widebeam"]
        row["widebeam"] = {k: v for k, v in wb.items() if k != "best"}
        if "transformers" not in best:
            row["transformers"] = {"skipped": f"its KV for W x (P+N) = {width * (len(prompt_ids) + n)} "
                                              f"tokens ({format_bytes(hf_kv)}) exceeds --hf-kv-limit "
                                              f"{format_bytes(args.hf_kv_limit)}"}
        else:
            ref = best["transformers"]
            row["transformers"] = {k: v for k, v in ref.items() if k != "best"}
            row["same_best_sequence"] = wb["best"] == ref["best"]
            row["speedup"] = ref["wall_s"] / wb["wall_s"]
        for name in ct2:
            result = best[name]
            row[name] = {"wall_s": result["wall_s"], "same_best_sequence": result["best"] == wb["best"],
                         "widebeam_speedup": result["wall_s"] / wb["wall_s"], "runs_s": result["runs_s"],
                         # run i of each side ran back to back: the comparison run by run
                         "widebeam_speedup_by_run": [peer_s / widebeam_s for peer_s, widebeam_s
                                                     in zip(result["runs_s"], wb["runs_s"])]}
        for side in ("widebeam", "transformers", *ct2):
            if "wall_s" in row[side]:
                row[side]["beam_tokens_per_s"] = width * n / row[side]["wall_s"]
                row[side]["x_compute_floor"] = row[side]["wall_s"] / row["compute_floor_s"]
                row[side]["x_compute_and_attention_floor"] = (
                    row[side]["wall_s"] / (row["compute_floor_s"] + row["attention_floor_s"]))
        rows.append(row)
        print(json.dumps(row), flush=True)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps({"model": args.model, "torch": torch.__version__,
                                        "kv_cache_memory_bytes": args.kv_cache_memory, "points": rows},
                                       indent=2) + "\n")
    for peer in ct2.values():
        peer.close()  # its worker process
    print_table(rows)
    plot(rows, out_path.with_suffix(".png"), args.model, args.max_new_tokens)
    return rows


def print_table(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    peers = [name for name in rows[0] if name.startswith("ctranslate2")] if rows else []
    table = Table(title="beam search: widebeam vs transformers" + (" and CTranslate2" if peers else "")
                  + " (same run)")
    columns = ["W", "P", "widebeam s", "hf s", "speed-up", "same best"]
    for name in peers:  # its time, widebeam's speed-up over it, and whether its best beam is widebeam's
        columns += [f"{name.removeprefix('ctranslate2 ')} CT2 s", "x", "same"]
    columns += ["KV widebeam", "KV hf", "widebeam x floor", "x floor+attn"]
    for column in columns:
        table.add_column(column, justify="right")
    for r in rows:
        wb, hf = r["widebeam"], r["transformers"]
        cells = [str(r["beam_width"]), str(r["prompt_len"]), f"{wb['wall_s']:.2f}",
                 f"{hf['wall_s']:.2f}" if "wall_s" in hf else "skipped",
                 f"{r['speedup']:.2f}x" if "speedup" in r else "-",
                 ("yes" if r["same_best_sequence"] else "NO") if "same_best_sequence" in r else "-"]
        for name in peers:
            peer = r[name]
            cells += [f"{peer['wall_s']:.2f}", f"{peer['widebeam_speedup']:.2f}x",
                      "yes" if peer["same_best_sequence"] else "NO"]
        cells += [format_bytes(wb["peak_kv_bytes"]),
                  format_bytes(hf["peak_kv_bytes"]) if "peak_kv_bytes" in hf else "-",
                  f"{wb['x_compute_floor']:.2f}", f"{wb['x_compute_and_attention_floor']:.2f}"]
        table.add_row(*cells)
    console = Console()
    # a pipe or log file reports 80 columns, which would fold every figure in two
    Console(width=max(console.width, 130)).print(table)


def measured_engines(rows: list[dict]) -> list[str]:
    """The engines a bench row holds results of, widebeam first: every key whose value has a time."""
    names = {name for r in rows for name, value in r.items() if isinstance(value, dict) and "wall_s" in value}
    return sorted(names, key=lambda name: (name != "widebeam", name != "transformers", name))


def plot(rows: list[dict], path: Path, model: str, new_tokens: int) -> list[str]:
    """Wall time against width, one line per engine and prompt length; returns the lines' labels."""
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed: no plot ({path}); pip install matplotlib")
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    markers = {"widebeam": "o-", "transformers": "s--"}
    for prompt_len in sorted({r["prompt_len"] for r in rows}):
        sub = [r for r in rows if r["prompt_len"] == prompt_len]
        for engine in measured_engines(sub):  # every engine with a time: CTranslate2's two kinds too
            timed = [r for r in sub if "wall_s" in r.get(engine, {})]
            ax.plot([r["beam_width"] for r in timed], [r[engine]["wall_s"] for r in timed],
                    markers.get(engine, "^:"), label=f"{engine} P={prompt_len}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("beam width")
    ax.set_ylabel("wall time (s)")
    ax.set_title(f"beam search, {model}, N={new_tokens} new tokens")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [line.get_label() for line in ax.get_lines()]
