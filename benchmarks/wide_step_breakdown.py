"""The wide-beam decode step against its floor: where a W = 256 or 1,024 step over a 2,048-token prompt
spends its time, next to what each part must cost at least on this machine (issue #34).

One beam search per width on the default model (float32), prefix cache off. Every decode step (the
prefill step is left out) is split by timing hooks (CPU work is synchronous, so a hook's clock is the
work's):
- linears: every projection and MLP layer but the LM head; lm_head: the LM head;
- attention: every self-attention layer (the K/V write and the read), split into the shared prompt and
  the beams' own tokens by timing the layer's own kernel (`_attend_group`) on the step's real decode
  group twice, whole and with the beams' own keys cut to one;
- selection: the decoder's replay of the step's scores (log-softmax, top-k, bookkeeping);
- rest: the step's wall time minus all of the above (norms, RoPE, embeddings, metadata, scheduling).

Floors, measured in the same run: this CPU's GEMM rate (a large float32 matmul) and memory bandwidth (a
large sum), then per part max(FLOPs / rate, bytes / bandwidth): linears and lm_head W x weights x 2 FLOPs
and their weights' bytes; prompt attention 4 x W x H x P x d FLOPs per layer and the prompt's K/V bytes
read once; own attention the same over each beam's n tokens; selection a read of the W x V scores.

    python benchmarks/wide_step_breakdown.py                       # W = 256 and 1,024, P = 2,048, N = 8
    python benchmarks/wide_step_breakdown.py --widths 256 --prompt-len 1024 --max-new-tokens 4

Writes benchmarks/results/wide_step_breakdown.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import torch
from tables import machine_info, markdown_table, print_table

from widebeam.llm import LLM
from widebeam.model import attention_backends
from widebeam.model.paged_attention import PagedAttention
from widebeam.params import BeamSearchParams
from widebeam.speculative import replay

PARTS = ("linears", "lm_head", "attention: prompt", "attention: own tokens", "selection", "rest")


def gemm_flops_per_s(threads: int) -> float:
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        torch.mm(a, b)
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


class StepTimer:
    """Hooks that add each part's seconds per step; `attention` also keeps the last decode group."""

    def __init__(self, model: torch.nn.Module):
        self.seconds: dict[str, float] = defaultdict(float)
        self.handles = []
        self.last_group = None
        lm_head = model.lm_head
        for module in model.modules():
            if module is lm_head:
                self._hook(module, "lm_head")
            elif isinstance(module, PagedAttention):
                self._hook(module, "attention")
            elif not list(module.children()) and any(p.dim() == 2 for p in module.parameters(recurse=False)) \
                    and not isinstance(module, torch.nn.Embedding):
                self._hook(module, "linears")
        original = attention_backends._attend_group

        def keep_group(q, k_cache, v_cache, group, scale, position_bias=None):
            if group.prefix_tokens:
                self.last_group = (q, k_cache, v_cache, group, scale)
            return original(q, k_cache, v_cache, group, scale, position_bias)

        self._restore = [(attention_backends, "_attend_group", original)]
        attention_backends._attend_group = keep_group
        original_replay = replay.replay_round

        def timed_replay(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original_replay(*args, **kwargs)
            finally:
                self.seconds["selection"] += time.perf_counter() - start

        import widebeam.request as request_module

        self._restore.append((request_module, "replay_round", request_module.replay_round))
        request_module.replay_round = timed_replay

    def _hook(self, module: torch.nn.Module, part: str) -> None:
        starts: list[float] = []
        self.handles.append(module.register_forward_pre_hook(lambda *_: starts.append(time.perf_counter())))

        def post(*_):
            self.seconds[part] += time.perf_counter() - starts.pop()

        self.handles.append(module.register_forward_hook(post))

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        for owner, name, value in self._restore:
            setattr(owner, name, value)


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
    own = (new_tokens + 1) / 2  # the average of each beam's own tokens over the steps

    def floor(flops: float, num_bytes: float) -> float:
        return max(flops / rate, num_bytes / bandwidth)

    return {
        "linears": floor(2 * width * linear_params, 4 * linear_params),
        "lm_head": floor(2 * width * head_params, 4 * head_params),
        "attention: prompt": floor(4 * width * heads * prompt_len * d * layers,
                                   2 * 4 * prompt_len * kv_heads * d * layers),
        "attention: own tokens": floor(4 * width * heads * own * d * layers,
                                       2 * 4 * width * own * kv_heads * d * layers),
        "selection": floor(0, 3 * 4 * width * arch.vocab_size),
        "rest": 0.0,
    }


def run_point(llm: LLM, width: int, prompt_len: int, new_tokens: int, rate: float, bandwidth: float) -> dict:
    engine = llm.engine
    prompt = [(7 * i) % 1000 + 100 for i in range(prompt_len)]
    params = BeamSearchParams(beam_width=width, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    engine.add_request("breakdown", {"prompt_token_ids": prompt}, params)
    engine.step()  # the prefill (and the first selection): not a decode step
    timer = StepTimer(engine.model)
    step_s, parts = [], defaultdict(float)
    try:
        while engine.has_unfinished():
            timer.seconds.clear()
            start = time.perf_counter()
            engine.step()
            step_s.append(time.perf_counter() - start)
            prompt_s, own_s = split_attention(timer.last_group, engine.arch.num_layers)
            attention_s = timer.seconds["attention"]
            measured = {"linears": timer.seconds["linears"], "lm_head": timer.seconds["lm_head"],
                        "attention: prompt": attention_s * prompt_s / max(prompt_s + own_s, 1e-12),
                        "attention: own tokens": attention_s * own_s / max(prompt_s + own_s, 1e-12),
                        "selection": timer.seconds["selection"]}
            measured["rest"] = step_s[-1] - sum(measured.values())
            for part, seconds in measured.items():
                parts[part] += seconds
    finally:
        timer.close()
    num_steps = len(step_s)
    floor = floors(llm, width, prompt_len, new_tokens, rate, bandwidth)
    rows = [{"part": part, "ms_per_step": 1e3 * parts[part] / num_steps, "floor_ms": 1e3 * floor[part],
             "x_floor": parts[part] / num_steps / floor[part] if floor[part] else None} for part in PARTS]
    step_ms = 1e3 * sum(step_s) / num_steps
    floor_ms = 1e3 * sum(floor.values())
    return {"beam_width": width, "prompt_len": prompt_len, "new_tokens": new_tokens,
            "decode_steps": num_steps, "step_ms": step_ms, "sum_of_floors_ms": floor_ms,
            "x_sum_of_floors": step_ms / floor_ms, "parts": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-cache-memory", default="3GiB")
    parser.add_argument("--out", default="benchmarks/results/wide_step_breakdown.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(max_beam_width=max(args.widths), kv_cache_memory=args.kv_cache_memory, device="cpu",
              enable_prefix_caching=False, max_num_batched_tokens=args.prompt_len)
    rate, bandwidth = gemm_flops_per_s(args.threads), bandwidth_bytes_per_s()
    points = [run_point(llm, w, args.prompt_len, args.max_new_tokens, rate, bandwidth) for w in args.widths]
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
