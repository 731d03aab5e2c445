"""Capacity policies compared on the default model, in one process: `guaranteed_no_evict` (admit on the
worst case, W beams x N tokens, never preempt) against `max_utilization` (admit on the next step's
blocks, preempt the newest request when a step runs short, resume it by recomputation).

    python benchmarks/scheduling.py                                # tiny random model, 64 requests (minutes)
    python benchmarks/scheduling.py --model smollm2-135m-instruct --quick --kv-cache-memory 60MiB \
        --out benchmarks/results/scheduling_smollm2_quick.json      # the real model, 8 requests, N <= 64

A mixed workload, drawn once from --seed: --num-requests prompts (with the tiny random model, 8-32
random token ids; with a real model, short questions through its chat template), beam width W from
{1, 2, 4, 8, 16} (W=1: greedy sampling), max_new_tokens N from {32, 64, 128, 256}, all submitted at
once to an engine whose KV pool (--kv-cache-memory) is too small for their worst cases together, so
requests queue. Two workloads over the same requests:
- **eos**: the model stops where it stops (EOS; the tiny model names 16 of its 256 ids EOS, so beams end
  at random lengths); most requests end long before N, which the guaranteed policy reserved anyway;
- **no-eos**: `ignore_eos` (beams) / `ignore_eos` (greedy): every request runs to N, its worst case,
  which is what the guaranteed policy planned for, and max_utilization's preemptions are pure cost.
Both engines (same float32 weights, same pool, T=16, max_num_batched_tokens 512) are built once and
warmed up; the policies run in turn (their order flips between workloads), each reporting: wall time,
requests/s, beam-tokens/s (W x generated tokens per request, summed, over the wall time), mean and p99
latency (submission to finish; all are submitted at t=0), engine steps, preemptions and recomputed tokens
(`stats()["scheduling"]`), the most KV blocks in use at once, and whether every request's beams
(token ids) equal the other policy's; --repeats runs each (order alternating), the median kept.
Figures are what they are on this host; nothing is asserted.

Writes benchmarks/results/scheduling.json (--quick: the temp dir, unless --out).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from tables import machine_info, markdown_table, print_table

from widebeam.defaults import DEFAULT_MODEL
from widebeam.llm import LLM
from widebeam.params import BeamSearchParams, SamplingParams

POLICIES = ("guaranteed_no_evict", "max_utilization")
RESULTS = Path(__file__).parent / "results"
QUESTIONS = [
    "What is the capital of France?", "Name three primary colours.", "How many legs does a spider have?",
    "What is 12 times 12?", "Give a synonym for happy.", "Which planet is closest to the sun?",
    "What do bees make?", "Translate 'thank you' into Spanish.", "Who wrote Romeo and Juliet?",
    "What is the boiling point of water in Celsius?", "Name a fruit that is yellow.",
    "What is the opposite of cold?", "How many days are in a week?", "What colour is grass?",
    "Write a haiku about the sea.", "Explain what a noun is in one sentence.",
    "List four animals that live on a farm.", "What is the largest ocean?",
    "Describe a rainy day in two sentences.", "Why is the sky blue? Answer briefly.",
]
WIDTHS = (1, 2, 4, 8, 16)
NEW_TOKENS = (32, 64, 128, 256)


def save_tiny_model(path: Path, vocab_size: int = 256, num_eos: int = 6) -> None:
    """A tiny random Llama (2 layers, hidden 64) whose generation config names `num_eos` EOS ids, so
    that beams end early at random lengths, as a real model's answers do."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    eos = list(range(2, 2 + num_eos))
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         bos_token_id=1, eos_token_id=eos, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0, 0.2)
    model.generation_config = GenerationConfig(eos_token_id=eos, bos_token_id=1, pad_token_id=0)
    model.save_pretrained(str(path), safe_serialization=True)


def draw_workload(tokenizer, num_requests: int, seed: int) -> list[tuple[object, int, int]]:
    """(prompt, beam width, max_new_tokens) per request: chat prompts through the tokenizer's template, or
    without a tokenizer (the tiny model) 8-32 random token ids."""
    rng = random.Random(seed)
    out = []
    for i in range(num_requests):
        if tokenizer is None:
            prompt = {"prompt_token_ids": [rng.randrange(10, 250) for _ in range(rng.randrange(8, 33))]}
        else:
            question = QUESTIONS[i % len(QUESTIONS)]
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                                   add_generation_prompt=True)
        out.append((prompt, rng.choice(WIDTHS), rng.choice(NEW_TOKENS)))
    return out


def params_for(width: int, new_tokens: int, ignore_eos: bool):
    if width == 1:
        return SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=ignore_eos)
    return BeamSearchParams(beam_width=width, max_new_tokens=new_tokens, ignore_eos=ignore_eos)


def run_batch(llm: LLM, workload, ignore_eos: bool) -> dict:
    """Submit every request at t=0, step to the end; the figures of this batch."""
    engine = llm.engine
    engine.reset_prefix_cache()
    before = dict(engine.stats()["scheduling"])
    start = time.perf_counter()
    ids = []
    for i, (prompt, width, new_tokens) in enumerate(workload):
        request_id = f"r{i}"
        engine.add_request(request_id, prompt, params_for(width, new_tokens, ignore_eos))
        ids.append(request_id)
    latency, generated, outputs = {}, {}, {}
    steps, max_used = 0, 0
    total = {name: p["total_blocks"] for name, p in engine.stats()["pools"].items()}
    while engine.has_unfinished():
        for delta in engine.step():
            if delta.finished:
                assert delta.error is None, delta.error
                latency[delta.request_id] = time.perf_counter() - start
                generated[delta.request_id] = delta.num_generated_tokens
                outputs[delta.request_id] = [c.token_ids for c in delta.output.outputs]
        steps += 1
        pools = engine.stats()["pools"]
        max_used = max(max_used, max(total[n] - p["free_blocks"] for n, p in pools.items()))
    wall = time.perf_counter() - start
    after = engine.stats()["scheduling"]
    lat = sorted(latency.values())
    beam_tokens = sum(width * generated[f"r{i}"] for i, (_, width, _) in enumerate(workload))
    return {
        "wall_s": round(wall, 2), "requests_per_s": round(len(ids) / wall, 3),
        "beam_tokens_per_s": round(beam_tokens / wall, 1), "beam_tokens": beam_tokens,
        "latency_mean_s": round(statistics.fmean(lat), 2),
        "latency_p99_s": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))], 2),
        "steps": steps, "preemptions": after["preemptions"] - before["preemptions"],
        "recomputed_tokens": after["recomputed_tokens"] - before["recomputed_tokens"],
        "max_blocks_in_use": max_used, "total_blocks": max(total.values()),
        "mean_generated_tokens": round(statistics.fmean(generated.values()), 1),
        "_outputs": outputs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny",
                        help="'tiny' (default: a tiny random Llama built here, --num-eos EOS ids of 256) or "
                             f"a model, e.g. {DEFAULT_MODEL} (SmolLM2-135M: ~2 s a step on 2 busy cores; use "
                             "--quick)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--num-eos", type=int, default=16,
                        help="the tiny model's EOS ids, of its 256 (default 16)")
    parser.add_argument("--kv-cache-memory", default=None,
                        help="the pool both engines get (default: 3MiB for the tiny model, 384 blocks of 16 "
                             "tokens, about 1.4 W=16 x N=256 worst cases; 240MiB for another model)")
    parser.add_argument("--max-preemptions", type=int, default=3)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs per policy and workload; the median is kept")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: on a busy 2-core host two threads spin-wait on "
                             "each other)")
    parser.add_argument("--workloads", nargs="+", default=["eos", "no-eos"], choices=["eos", "no-eos"])
    parser.add_argument("--quick", action="store_true", help="8 requests, N <= 64: a smoke run")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.quick:
        global NEW_TOKENS
        NEW_TOKENS = (16, 32, 64)
        args.num_requests = min(args.num_requests, 8)
        args.repeats = 1
    out_path = (Path(args.out) if args.out
                else (Path(tempfile.gettempdir()) if args.quick else RESULTS) / "scheduling.json")
    model = args.model
    if model == "tiny":
        model = tempfile.mkdtemp(prefix="widebeam-tiny-eos-")
        save_tiny_model(Path(model), num_eos=args.num_eos)
    if args.kv_cache_memory is None:
        args.kv_cache_memory = "3MiB" if args.model == "tiny" else "240MiB"
    llms = {policy: LLM(model, dtype="float32", tokens_per_block=16, kv_cache_memory=args.kv_cache_memory,
                        max_beam_width=max(WIDTHS), max_num_batched_tokens=args.max_num_batched_tokens,
                        scheduling_policy=policy, max_preemptions=args.max_preemptions)
            for policy in POLICIES}
    workload = draw_workload(llms[POLICIES[0]].tokenizer, args.num_requests, args.seed)
    for llm in llms.values():  # warm-up
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], BeamSearchParams(beam_width=2, max_new_tokens=4),
                     use_tqdm=False)
    rows = []
    for k, name in enumerate(args.workloads):
        order = POLICIES if k % 2 == 0 else POLICIES[::-1]
        runs = {policy: [] for policy in POLICIES}
        for repeat in range(args.repeats):
            for policy in order if repeat % 2 == 0 else order[::-1]:
                runs[policy].append(run_batch(llms[policy], workload, ignore_eos=name == "no-eos"))
                print(name, policy,
                      json.dumps({key: v for key, v in runs[policy][-1].items() if key != "_outputs"}),
                      file=sys.stderr)
        # the run of median wall time (the scheduling figures are the same in every run)
        results = {policy: sorted(r, key=lambda x: x["wall_s"])[len(r) // 2] for policy, r in runs.items()}
        for policy, r in runs.items():
            results[policy]["wall_s_all"] = [x["wall_s"] for x in r]
        reference = results[POLICIES[0]]["_outputs"]
        for policy in POLICIES:
            row = {"workload": name, "policy": policy, **results[policy]}
            outputs = row.pop("_outputs")
            row["same_beams_as_guaranteed"] = sum(outputs[i] == reference[i] for i in reference)
            rows.append(row)
    headers = ["workload", "policy", "req/s", "beam-tok/s", "mean lat s", "p99 lat s", "steps", "preempt",
               "recomputed", "max blocks", "same beams"]
    table = [[r["workload"], r["policy"], f"{r['requests_per_s']:.3f}", f"{r['beam_tokens_per_s']:.0f}",
              f"{r['latency_mean_s']:.1f}", f"{r['latency_p99_s']:.1f}", str(r["steps"]),
              str(r["preemptions"]),
              str(r["recomputed_tokens"]), f"{r['max_blocks_in_use']}/{r['total_blocks']}",
              f"{r['same_beams_as_guaranteed']}/{args.num_requests}"] for r in rows]
    print_table("capacity policies", headers, table, "llrrrrrrrrr")
    revision = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=False).stdout.strip()
    meta = {"revision": revision, "num_eos_ids": args.num_eos if args.model == "tiny" else None,
            "command": "python " + " ".join(sys.argv), "model": args.model,
            "dtype": "float32", "tokens_per_block": 16, "kv_cache_memory": args.kv_cache_memory,
            "max_num_batched_tokens": args.max_num_batched_tokens, "max_preemptions": args.max_preemptions,
            "repeats": args.repeats, "num_requests": args.num_requests, "seed": args.seed, "widths": WIDTHS,
            "new_tokens": NEW_TOKENS,
            "load_average_at_end": list(__import__("os").getloadavg()), **machine_info(args.threads)}
    workload_rows = [{"beam_width": w, "max_new_tokens": n} for _, w, n in workload]
    meta["mean_prompt_tokens"] = round(statistics.fmean(
        len(p["prompt_token_ids"]) if isinstance(p, dict) else len(llms[POLICIES[0]].tokenizer.encode(p))
        for p, _, _ in workload), 1)
    out_path.write_text(json.dumps({"meta": meta, "requests": workload_rows, "rows": rows,
                                    "markdown": markdown_table(headers, table, "llrrrrrrrrr")},
                                   indent=2) + "\n")
    print(f"wrote {out_path}", file=sys.stderr)


if __name__ == "__main__":
    main()
