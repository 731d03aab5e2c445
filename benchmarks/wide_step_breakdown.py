"""The wide-beam decode step against its floor: where a W = 256 or 1,024 step over a 2,048-token prompt
spends its time, next to what each part must cost at least on this machine (issue #34).

One beam search per width on the default model (float32), prefix cache off. Every decode step (the
prefill step is left out) is split by timing hooks (CPU work is synchronous, so a hook's clock is the
work's):
- linears: every projection and MLP layer but the LM head; lm_head: the LM head;
- attention: every self-attention layer (the K/V write and the read), split into the shared prompt and
  the beams' own tokens by timing the layer's own kernel (`_attend_group`) on the step's real decode
  group twice, whole and with the beams' own keys cut to one;
- K/V write: the layers' writes of the step's K/V into the paged cache (inside the attention layer);
- selection: the step's log-softmax (`StepScores`) and the decoder's replay of its scores (top-k,
  the search's bookkeeping);
- what used to be one "rest", each part timed on the engine's own path: norms (every RMSNorm), RoPE
  (the cos / sin table and its application to q and k), the MLP's activation and gate product (the
  MLP less its linears), the embedding, the model's glue (its forward less every part inside it:
  residual adds, reshapes), the attention metadata (every pool's index tensors), copy-on-write (the
  queued block copies), the runner's inputs (its tensors and the logit rows: `execute` less the
  model, the LM head and the metadata), the scheduler, the round inputs (each beam's
  `SequenceInput`), beam bookkeeping (`reorder`: release, keep, fork), the outputs (`finish_round`
  less the replay and the bookkeeping: stream, delta), and what is left unattributed (the engine
  loop between them).

Floors, measured in the same run: this CPU's GEMM rate (a large float32 matmul) and memory bandwidth (a
large sum), then per part max(FLOPs / rate, bytes / bandwidth): linears and lm_head W x weights x 2 FLOPs
and their weights' bytes; prompt attention 4 x W x H x P x d FLOPs per layer and the prompt's K/V bytes
read once; own attention the same over each beam's n tokens; selection a read of the W x V scores;
the elementwise parts (K/V write, norms, RoPE, MLP activation) one read and one write of their
tensors. Host work, metadata, copies and glue have no floor (0): a step could do without them.

    python benchmarks/wide_step_breakdown.py                       # W = 256 and 1,024, P = 2,048, N = 8
    python benchmarks/wide_step_breakdown.py --widths 256 --prompt-len 1024 --max-new-tokens 4
    python benchmarks/wide_step_breakdown.py --widths 256 1024 --repeats 3   # each run kept, the median

Writes benchmarks/results/wide_step_breakdown.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import torch
from tables import machine_info, markdown_table, print_table

import widebeam.engine as engine_module
import widebeam.request as request_module
from widebeam.bench import linear_products
from widebeam.heap import freeze_startup_heap
from widebeam.llm import LLM
from widebeam.model.attention import backends as attention_backends
from widebeam.model.attention import paged as paged_attention
from widebeam.model.attention.paged import PagedAttention
from widebeam.model.families import decoder
from widebeam.model.families.layers import GatedMLP, RMSNorm, RotaryEmbedding
from widebeam.params import BeamSearchParams
from widebeam.request import Request
from widebeam.speculative.round import SequenceRound

PARTS = ("linears", "lm_head", "attention: prompt", "attention: own tokens", "K/V write", "selection",
         "norms", "RoPE", "MLP activation", "embedding", "model glue (residuals, reshapes)",
         "attention metadata", "copy-on-write", "runner inputs (tensors, logit rows)", "scheduler",
         "round inputs", "beam bookkeeping (KV release / keep / fork)", "outputs (stream, delta)",
         "unattributed")


def gemm_flops_per_s(threads: int) -> float:
    """A large float32 product's rate through the fastest product this build offers (torch's and, where
    built, oneDNN's: `widebeam.bench.linear_products`)."""
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    best = float("inf")
    for product in linear_products(torch.float32, "cpu"):
        for _ in range(5):
            start = time.perf_counter()
            product(a, b)
            best = min(best, time.perf_counter() - start)
    return 2 * 2048**3 / best


def bandwidth_bytes_per_s() -> float:
    x = torch.randn(64 * 2**20 // 4)  # 64 MiB: past the caches
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best


def _timed(seconds: dict, part: str, function):
    """`function`, adding its wall time to `seconds[part]` (CPU work is synchronous)."""
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            seconds[part] += time.perf_counter() - start
    return timed


class StepTimer:
    """Timing hooks on the engine's own objects (module hooks, wrapped functions and methods,
    restored on `close`) that add each part's seconds per step; the attention wrapper also keeps
    the step's last decode group. Raw sums nest (the model's forward holds the layers'); `parts`
    subtracts them into disjoint parts."""

    def __init__(self, engine):
        self.seconds: dict[str, float] = defaultdict(float)
        self.handles = []
        self.last_group = None
        self._restore: list[tuple[object, str, object]] = []
        model, runner = engine.model, engine.workers[0].runner
        lm_head = model.lm_head
        for module in model.modules():
            if module is lm_head:
                self._hook(module, "lm_head")
            elif isinstance(module, PagedAttention):
                self._hook(module, "attention")
            elif isinstance(module, RMSNorm):
                self._hook(module, "norms")
            elif isinstance(module, RotaryEmbedding):
                self._hook(module, "rope tables")
            elif isinstance(module, GatedMLP):
                self._hook(module, "mlp")
            elif isinstance(module, torch.nn.Embedding):
                self._hook(module, "embedding")
            elif not list(module.children()) and any(p.dim() == 2 for p in module.parameters(recurse=False)):
                self._hook(module, "linears")
        for mlp in (m for m in model.modules() if isinstance(m, GatedMLP)):
            for linear in mlp.modules():
                if linear is not mlp and not list(linear.children()):
                    self._hook(linear, "mlp linears")
        self._hook(model, "model forward")
        original = attention_backends._attend_group

        def keep_group(q, k_cache, v_cache, group, scale, position_bias=None):
            if group.prefix_tokens:
                self.last_group = (q, k_cache, v_cache, group, scale)
            return original(q, k_cache, v_cache, group, scale, position_bias)

        self._patch(attention_backends, "_attend_group", keep_group)
        self._wrap(decoder, "apply_rotary", "rope apply")
        self._wrap(paged_attention, "write_kv", "K/V write")
        self._wrap(engine_module, "StepScores", "step scores")  # the step's log-softmax over every row
        self._wrap(request_module, "replay_round", "replay")
        self._wrap(runner.attention_backend, "build_metadata", "attention metadata")
        self._wrap(runner, "copy_blocks", "copy-on-write")
        self._wrap(runner, "execute", "runner execute")
        self._wrap(engine.scheduler, "schedule", "scheduler")
        self._wrap(Request, "begin_round", "round inputs")
        self._wrap(SequenceRound, "verify_input", "round inputs")
        self._wrap(Request, "_continue", "beam bookkeeping")
        self._wrap(Request, "finish_round", "finish round")

    def _patch(self, owner, name: str, value) -> None:
        self._restore.append((owner, name, owner.__dict__.get(name, _MISSING)))
        setattr(owner, name, value)

    def _wrap(self, owner, name: str, part: str) -> None:
        self._patch(owner, name, _timed(self.seconds, part, getattr(owner, name)))

    def _hook(self, module: torch.nn.Module, part: str) -> None:
        starts: list[float] = []
        self.handles.append(module.register_forward_pre_hook(lambda *_: starts.append(time.perf_counter())))

        def post(*_):
            self.seconds[part] += time.perf_counter() - starts.pop()

        self.handles.append(module.register_forward_hook(post))

    def parts(self, step_s: float, prompt_s: float, own_s: float) -> dict[str, float]:
        """The step's seconds by disjoint part (see PARTS); attention is split between the prompt
        and the beams' own tokens in the ratio the kernel timed alone shows."""
        s = self.seconds
        attention = s["attention"] - s["K/V write"]
        prompt_share = prompt_s / max(prompt_s + own_s, 1e-12)
        mlp_linears = s["mlp linears"]
        in_model = ("linears", "norms", "rope tables", "rope apply", "embedding", "attention", "mlp")
        parts = {
            "linears": s["linears"], "lm_head": s["lm_head"],
            "attention: prompt": attention * prompt_share,
            "attention: own tokens": attention * (1 - prompt_share),
            "K/V write": s["K/V write"], "selection": s["step scores"] + s["replay"], "norms": s["norms"],
            "RoPE": s["rope tables"] + s["rope apply"], "MLP activation": s["mlp"] - mlp_linears,
            "embedding": s["embedding"],
            # the MLP's own linears are inside both "linears" and "mlp"
            "model glue (residuals, reshapes)": s["model forward"] - sum(s[k] for k in in_model)
            + mlp_linears,
            "attention metadata": s["attention metadata"], "copy-on-write": s["copy-on-write"],
            "runner inputs (tensors, logit rows)": s["runner execute"] - s["model forward"] - s["lm_head"]
            - s["attention metadata"],
            "scheduler": s["scheduler"], "round inputs": s["round inputs"],
            "beam bookkeeping (KV release / keep / fork)": s["beam bookkeeping"],
            # the replay runs inside `finish_round`; the step's scores are built before it
            "outputs (stream, delta)": s["finish round"] - s["replay"] - s["beam bookkeeping"],
        }
        parts["unattributed"] = step_s - sum(parts.values())
        return parts

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        for owner, name, value in reversed(self._restore):
            if value is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, value)


_MISSING = object()


def split_attention(group_args, num_layers: int) -> tuple[float, float]:
    """(prompt, own tokens) seconds per step: the layer kernel on the step's real group, whole and with
    each beam's own keys cut to one, times the number of layers."""
    q, k_cache, v_cache, group, scale = group_args
    own_cut = replace(group, suffix_slots=group.suffix_slots[:, :1].contiguous(),
                      suffix_mask=group.suffix_mask[:, :1].contiguous(),
                      suffix_hidden=group.suffix_hidden[:, :, :1].contiguous())

    def best(g) -> float:
        times = []
        for _ in range(3):
            start = time.perf_counter()
            attention_backends._attend_group(q, k_cache, v_cache, g, scale)
            times.append(time.perf_counter() - start)
        return min(times)

    whole, prompt_only = best(group), best(own_cut)
    return prompt_only * num_layers, max(whole - prompt_only, 0.0) * num_layers


def floors(llm: LLM, width: int, prompt_len: int, new_tokens: int, rate: float, bandwidth: float) -> dict:
    model, arch = llm.engine.model, llm.engine.arch
    head_params = model.lm_head.weight.numel()
    linear_params = sum(p.numel() for name, p in model.named_parameters()
                        if p.dim() == 2 and "embed" not in name and p is not model.lm_head.weight)
    layers, heads, kv_heads, d = arch.num_layers, arch.num_heads, arch.num_kv_heads, arch.head_dim
    # bytes one token's K (or V) takes per layer in the pool: the KV dtype's, an int8 pool's scales included
    spec = llm.engine.cache["self"].spec
    kv_token_bytes = spec.bytes_per_token / (2 * spec.num_layers)
    own = (new_tokens + 1) / 2  # the average of each beam's own tokens over the steps

    def floor(flops: float, num_bytes: float) -> float:
        return max(flops / rate, num_bytes / bandwidth)

    h, rows = arch.hidden_size, width  # one query row per beam
    parts = dict.fromkeys(PARTS, 0.0)  # host work, metadata, copies, glue: no floor (0)
    parts.update({
        "linears": floor(2 * width * linear_params, 4 * linear_params),
        "lm_head": floor(2 * width * head_params, 4 * head_params),
        "attention: prompt": floor(4 * width * heads * prompt_len * d * layers,
                                   2 * kv_token_bytes * prompt_len * layers),
        "attention: own tokens": floor(4 * width * heads * own * d * layers,
                                       2 * kv_token_bytes * width * own * layers),
        "selection": floor(0, 3 * 4 * width * arch.vocab_size),
        # the elementwise parts: each tensor read once and written once at the bandwidth
        "K/V write": floor(0, 2 * 2 * 4 * rows * kv_heads * d * layers),
        "norms": floor(0, 2 * 4 * rows * h * (2 * layers + 1)),
        "RoPE": floor(0, 2 * 4 * rows * (heads + kv_heads) * d * layers),
        "MLP activation": floor(0, 3 * 4 * rows * arch.intermediate_size * layers),
    })
    return parts


def time_point(llm: LLM, width: int, prompt_len: int, new_tokens: int) -> tuple[list[float], dict]:
    """One beam search at `width`: (each decode step's seconds, seconds by part summed over them)."""
    engine = llm.engine
    prompt = [(7 * i) % 1000 + 100 for i in range(prompt_len)]
    params = BeamSearchParams(beam_width=width, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    engine.add_request("breakdown", {"prompt_token_ids": prompt}, params)
    engine.step()  # the prefill (and the first selection): not a decode step
    timer = StepTimer(engine)
    step_s, parts = [], defaultdict(float)
    try:
        while engine.has_unfinished():
            timer.seconds.clear()
            start = time.perf_counter()
            engine.step()
            step_s.append(time.perf_counter() - start)
            prompt_s, own_s = split_attention(timer.last_group, engine.arch.num_layers)
            for part, seconds in timer.parts(step_s[-1], prompt_s, own_s).items():
                parts[part] += seconds
    finally:
        timer.close()
    return step_s, parts


def score_point(llm: LLM, width: int, prompt_len: int, new_tokens: int,
                timing: tuple[list[float], dict], rate: float, bandwidth: float) -> dict:
    """A timed point against the floors at `rate` and `bandwidth`."""
    step_s, parts = timing
    num_steps = len(step_s)
    floor = floors(llm, width, prompt_len, new_tokens, rate, bandwidth)
    rows = [{"part": part, "ms_per_step": 1e3 * parts[part] / num_steps, "floor_ms": 1e3 * floor[part],
             "x_floor": parts[part] / num_steps / floor[part] if floor[part] else None} for part in PARTS]
    step_ms = 1e3 * sum(step_s) / num_steps
    floor_ms = 1e3 * sum(floor.values())
    return {"beam_width": width, "prompt_len": prompt_len, "new_tokens": new_tokens,
            "decode_steps": num_steps, "step_ms": step_ms, "sum_of_floors_ms": floor_ms,
            # the slowest decode step against the median one (a collector pause shows here)
            "max_step_over_median": max(step_s) / statistics.median(step_s),
            "x_sum_of_floors": step_ms / floor_ms, "parts": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of each width (interleaved); the table shows each, the JSON keeps each")
    parser.add_argument("--kv-cache-memory", default="3GiB")
    parser.add_argument("--out", default="benchmarks/results/wide_step_breakdown.json")
    parser.add_argument("--kv-cache-dtype", default="auto", help="what the KV cache stores (auto: float32)")
    parser.add_argument("--no-freeze", action="store_true",
                        help="leave start-up's objects in the collector's walk (a library user's process)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(max_beam_width=max(args.widths), kv_cache_memory=args.kv_cache_memory, device="cpu",
              kv_cache_dtype=args.kv_cache_dtype,
              enable_prefix_caching=False, max_num_batched_tokens=args.prompt_len)
    if not args.no_freeze:
        freeze_startup_heap()  # as `serve`, `batch` and `generate` run (widebeam/heap.py)
    # The floors are this CPU's best: the rate and bandwidth measured before the runs and between them, the
    # fastest kept (on a shared host one measurement can land in a slow spell and halve the floors); each
    # point is then scored against them, every repeat kept and the median reported.
    rate, bandwidth = gemm_flops_per_s(args.threads), bandwidth_bytes_per_s()
    timings = []
    for _ in range(args.repeats):
        for w in args.widths:
            timings.append((w, time_point(llm, w, args.prompt_len, args.max_new_tokens)))
            rate = max(rate, gemm_flops_per_s(args.threads))
            bandwidth = max(bandwidth, bandwidth_bytes_per_s())
    points = [score_point(llm, w, args.prompt_len, args.max_new_tokens, timing, rate, bandwidth)
              for w, timing in timings]
    result = {"machine": machine_info(args.threads), "gemm_gflops": rate / 1e9,
              "bandwidth_gb_s": bandwidth / 1e9, "points": points}
    header = ["W", "part", "ms / step", "floor ms", "x floor"]
    rows = []
    for p in points:
        for r in p["parts"]:
            rows.append([str(p["beam_width"]), r["part"], f"{r['ms_per_step']:.1f}", f"{r['floor_ms']:.1f}",
                         f"{r['x_floor']:.2f}" if r["x_floor"] else "-"])
        rows.append([str(p["beam_width"]), "**whole step**", f"{p['step_ms']:.1f}",
                     f"{p['sum_of_floors_ms']:.1f}", f"{p['x_sum_of_floors']:.2f}"])
        rows.append([str(p["beam_width"]), "slowest step / median", f"{p['max_step_over_median']:.2f}",
                     "-", "-"])
    for w in args.widths:
        ratios = [p["x_sum_of_floors"] for p in points if p["beam_width"] == w]
        result.setdefault("median_x_sum_of_floors", {})[str(w)] = statistics.median(ratios)
        print(f"W={w}: whole step x floors by run {', '.join(f'{r:.2f}' for r in ratios)}; "
              f"median {statistics.median(ratios):.2f}")
    print_table("the wide-beam decode step against its floor", header, rows, "rllrr")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(
        f"GEMM {rate / 1e9:.0f} GFLOP/s, bandwidth {bandwidth / 1e9:.1f} GB/s, P = {args.prompt_len}\n\n"
        + markdown_table(header, rows, "rllrr"))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
