"""Model-runner throughput on CPU: load time, prefill and decode tokens/s, and where decode time goes.

Drives the default model (SmolLM2-135M, real weights) through the engine's public pieces, not
`LLM.generate`: blocks come from `llm.engine.cache["self"]` and every forward is one
`llm.engine.runner.execute(...)` call, so the figures are the runner's own (no sampling, no
detokenisation, no scheduling). Per dtype:

- load: `LLM(...)` construction with the converted model already in the cache ("cached"); once,
  for float32 only, a fresh process with an empty WIDEBEAM_CACHE (GGUF conversion included,
  "first load") and, for a like-for-like comparison, a fresh process with the warm cache;
- prefill: B sequences of `--prompt-len` tokens in one forward (logits of the last token each);
- decode: the same B sequences, one token each per forward, for `--decode-steps` forwards, the
  context starting at the prompt length; each step feeds the argmax of the previous logits;
- a profile (torch.profiler ops and cProfile functions, by self time) of a few decode steps.

Every configuration is warmed up once at its batch size before it is timed (a prefill warm-up over
--warmup-max-tokens uses shorter prompts). Only `execute` is timed; the host-side slot bookkeeping
(`append_slots`, building `SequenceInput`s) is reported apart. The figures assume an otherwise idle
host: each measurement waits for one, records the CPU other processes took meanwhile, and is
repeated when that was more than --max-other-share (two OpenMP threads on two shared cores slow
down many-fold when a third process runs).

    .venv/bin/python benchmarks/runner_throughput.py  # full run: ~7 min estimated on an idle 2-core host
    .venv/bin/python benchmarks/runner_throughput.py --batch-sizes 1 8 --skip-first-load  # quick
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import platform
import pstats
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

os.environ.setdefault("WIDEBEAM_CACHE", "/tmp/wbcache")

import torch
from contention import (  # benchmarks/ is on sys.path when run as a script
    CpuMeter,
    contended,
    idle_threshold,
    measured,
    wait_for_idle,
)
from rich.console import Console
from throughput_report import cpu_flags, cpu_model, print_report, source_fingerprint, speedups

from widebeam.kv.tables import Holding
from widebeam.llm import LLM
from widebeam.model.runner import SequenceInput

REPO_ROOT = Path(__file__).resolve().parent.parent
POOL = "self"
FIRST_TOKEN_ID = 3  # skip unk/bos/eos in the random prompts

# Runs in a fresh interpreter: import time and construction time apart, as JSON on the last line.
_LOAD_IN_SUBPROCESS = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
torch.set_num_threads(int(sys.argv[1]))
from widebeam.llm import LLM
t1 = time.perf_counter()
llm = LLM(dtype=sys.argv[2], device="cpu", kv_cache_memory=sys.argv[3], tokens_per_block=int(sys.argv[4]))
t2 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "construct_s": t2 - t1, "model_dir": str(llm.engine.source.path)}))
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"],
                   choices=["float32", "bfloat16", "float16"])
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 64])
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--large-batch-prompt-len", type=int, default=None,
                   help="prompt length for batches above 8 (default: --prompt-len); use it if B x prompt-len "
                        "is too slow or too big; the JSON records the length actually used")
    p.add_argument("--warmup-max-tokens", type=int, default=8192,
                   help="a prefill warm-up of more tokens than this runs at the same batch size with "
                        "prompts cut to fit (the timed forward keeps its full shape); the JSON records the "
                        "warm-up shape")
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3,
                   help="timed prefill repeats when a warm-up forward takes under --repeat-budget-s "
                        "/ repeats")
    p.add_argument("--repeat-budget-s", type=float, default=6.0)
    p.add_argument("--profile-steps", type=int, default=3, help="decode steps under each profiler")
    p.add_argument("--profile-batch-sizes", nargs="+", type=int, default=None,
                   help="batch sizes whose decode is profiled (default: the largest of --batch-sizes)")
    p.add_argument("--top", type=int, default=8, help="rows of each profile top list")
    p.add_argument("--kv-cache-memory", default="2GiB")
    p.add_argument("--tokens-per-block", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--idle-wait-s", type=float, default=60.0,
                   help="before each configuration, wait up to this long for other processes to go quiet")
    p.add_argument("--idle-threshold", type=float, default=0.15,
                   help="'quiet': other processes use under this share of all CPUs over one second")
    p.add_argument("--max-other-share", type=float, default=0.10,
                   help="a measurement during which other processes took more than this share of all CPUs "
                        "is repeated (2 OpenMP threads on 2 shared cores slow down many-fold)")
    p.add_argument("--retries", type=int, default=2,
                   help="repeats of a contended prefill or decode measurement")
    p.add_argument("--load-retries", type=int, default=1,
                   help="repeats of a contended load (each takes 15-60 s; the first load at most once)")
    p.add_argument("--skip-first-load", action="store_true",
                   help="skip the fresh-cache (GGUF conversion) load")
    p.add_argument("--out", default="benchmarks/results/runner_throughput.json")
    return p.parse_args(argv)


# -- load times -------------------------------------------------------------------------------------
def load_in_subprocess(args: argparse.Namespace, cache_dir: str) -> dict:
    env = dict(os.environ, WIDEBEAM_CACHE=cache_dir)
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", _LOAD_IN_SUBPROCESS, str(args.threads), "float32", args.kv_cache_memory,
         str(args.tokens_per_block)],
        env=env, cwd=REPO_ROOT, capture_output=True, text=True, check=False,
    )
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"load subprocess failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["process_wall_s"] = wall
    return result


def first_and_fresh_process_loads(args: argparse.Namespace, console: Console) -> dict:
    """float32 only: a fresh process with an empty cache (converts the GGUF), then one with the warm cache."""
    def fresh() -> dict:
        tmp = tempfile.mkdtemp(prefix="wb-first-load-")
        try:
            return load_in_subprocess(args, tmp)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    # The conversion is slow (about a minute): at most one retry.
    load_args = argparse.Namespace(**{**vars(args), "retries": args.load_retries})
    first, cpu = measured(argparse.Namespace(**{**vars(args), "retries": min(args.load_retries, 1)}), console,
                          "first load", fresh)
    first["cpu"] = cpu
    warm, cpu = measured(load_args, console, "fresh-process cached load",
                         lambda: load_in_subprocess(args, os.environ["WIDEBEAM_CACHE"]))
    warm["cpu"] = cpu
    return {"dtype": "float32", "fresh_cache": first, "warm_cache_fresh_process": warm}


# -- driving the runner -----------------------------------------------------------------------------
class Bench:
    def __init__(self, llm: LLM, seed: int):
        self.engine = llm.engine
        self.manager = llm.engine.cache[POOL]
        self.runner = llm.engine.runner
        self.vocab_size = llm.engine.arch.vocab_size
        self.rng = random.Random(seed)

    def free_blocks(self) -> int:
        return self.engine.cache.num_free_blocks()[POOL]

    def _check_no_copies(self) -> None:
        # Nothing here forks a table, so no copy-on-write may ever be queued.
        assert not self.manager.take_copies(), "unexpected copy-on-write in a benchmark without forks"

    def prefill(self, batch: int, prompt_len: int) -> tuple[list, list[int], float, float]:
        """New tables for `batch` random prompts, prefilled in one forward: (tables, next tokens,
        execute seconds, bookkeeping seconds)."""
        prompts = [[self.rng.randrange(FIRST_TOKEN_ID, self.vocab_size) for _ in range(prompt_len)]
                   for _ in range(batch)]
        t0 = time.perf_counter()
        tables = [self.manager.new_table(Holding()) for _ in range(batch)]
        inputs = [SequenceInput(p, 0, {POOL: t.block_ids}, {POOL: self.manager.append_slots(t, len(p))})
                  for p, t in zip(prompts, tables)]
        self._check_no_copies()
        t1 = time.perf_counter()
        logits = self.runner.execute(inputs)
        t2 = time.perf_counter()
        return tables, logits.argmax(dim=-1).tolist(), t2 - t1, t1 - t0

    def decode_step(self, tables: list, tokens: list[int]) -> tuple[list[int], float, float]:
        """One decode token for every table: (next tokens, execute seconds, bookkeeping seconds)."""
        t0 = time.perf_counter()
        inputs = []
        for table, token in zip(tables, tokens):
            context = table.num_tokens
            slots = self.manager.append_slots(table, 1)
            inputs.append(SequenceInput([token], context, {POOL: table.block_ids}, {POOL: slots}))
        self._check_no_copies()
        t1 = time.perf_counter()
        logits = self.runner.execute(inputs)
        t2 = time.perf_counter()
        return logits.argmax(dim=-1).tolist(), t2 - t1, t1 - t0

    def release(self, tables: list) -> None:
        for table in tables:
            self.manager.release(table)


def blocks_for(batch: int, tokens: int, tokens_per_block: int) -> int:
    return batch * -(-tokens // tokens_per_block)


def top_torch_ops(prof, top: int) -> tuple[list[dict], float]:
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events) or 1.0
    rows = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return [
        {"op": e.key, "self_cpu_ms": e.self_cpu_time_total / 1e3,
         "self_pct": 100 * e.self_cpu_time_total / total,
         "cpu_total_ms": e.cpu_time_total / 1e3, "calls": e.count}
        for e in rows
    ], total / 1e3


def top_python_functions(profiler: cProfile.Profile, top: int) -> tuple[list[dict], float]:
    stats = pstats.Stats(profiler, stream=io.StringIO())
    entries = []
    for (filename, line, name), (_cc, ncalls, tottime, cumtime, _callers) in stats.stats.items():
        if filename == "~":  # a builtin
            where = name
        else:
            short = (os.path.relpath(filename, REPO_ROOT) if filename.startswith(str(REPO_ROOT))
                     else Path(filename).name)
            where = f"{short}:{line}({name})"
        entries.append({"function": where, "self_ms": tottime * 1e3, "cum_ms": cumtime * 1e3,
                        "calls": ncalls})
    total = sum(e["self_ms"] for e in entries) or 1.0
    entries.sort(key=lambda e: e["self_ms"], reverse=True)
    for e in entries:
        e["self_pct"] = 100 * e["self_ms"] / total
    return entries[:top], total


def profile_decode(bench: Bench, tables: list, tokens: list[int], steps: int,
                   top: int) -> tuple[dict, list[int]]:
    from torch.profiler import ProfilerActivity, profile

    context_start = tables[0].num_tokens
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            tokens, _, _ = bench.decode_step(tables, tokens)
        torch_wall = time.perf_counter() - t0
    ops, ops_total_ms = top_torch_ops(prof, top)
    profiler = cProfile.Profile()
    t0 = time.perf_counter()
    profiler.enable()
    for _ in range(steps):
        tokens, _, _ = bench.decode_step(tables, tokens)
    profiler.disable()
    cprofile_wall = time.perf_counter() - t0
    functions, functions_total_ms = top_python_functions(profiler, top)
    return {
        "batch_size": len(tables),
        "steps": steps,
        "context_start": context_start,
        "torch_profiler": {"wall_s": torch_wall, "self_cpu_total_ms": ops_total_ms, "top_ops": ops},
        "cprofile": {"wall_s": cprofile_wall, "self_total_ms": functions_total_ms,
                     "top_functions": functions},
    }, tokens


def run_dtype(dtype: str, args: argparse.Namespace, console: Console) -> dict:
    def construct() -> tuple[LLM, float]:
        t0 = time.perf_counter()
        llm = LLM(dtype=dtype, device="cpu", kv_cache_memory=args.kv_cache_memory,
                  tokens_per_block=args.tokens_per_block)
        return llm, time.perf_counter() - t0

    load_args = argparse.Namespace(**{**vars(args), "retries": args.load_retries})
    (llm, cached_load_s), load_cpu = measured(load_args, console, f"{dtype} cached load", construct)
    console.log(f"[bold]{dtype}[/]: cached load {cached_load_s:.2f} s")
    bench = Bench(llm, args.seed)
    total_blocks = bench.free_blocks()
    out: dict = {
        "cached_load_s": cached_load_s,
        "cached_load_cpu": load_cpu,
        "runner_dtype": str(bench.runner.dtype),
        "kv_total_blocks": total_blocks,
        "kv_total_tokens": total_blocks * args.tokens_per_block,
        "prefill": {},
        "decode": {},
        "profile": {},
    }
    profile_batches = args.profile_batch_sizes or [max(args.batch_sizes)]
    # Tokens a sequence may gain after its prompt: the timed decode (and its retries), the profiles.
    decode_tokens = args.decode_steps * (args.retries + 1) + args.profile_steps * 2
    for batch in args.batch_sizes:
        prompt_len = args.prompt_len
        notes = []
        if batch > 8 and args.large_batch_prompt_len:
            prompt_len = args.large_batch_prompt_len
            notes.append(f"prompt length {prompt_len} (--large-batch-prompt-len) instead of "
                         f"{args.prompt_len}")
        # Warm-up tables are released before the timed ones are made, so one set must fit at a time.
        while blocks_for(batch, prompt_len + decode_tokens, args.tokens_per_block) > total_blocks:
            prompt_len //= 2
        if prompt_len != args.prompt_len and not notes:
            notes.append(f"prompt length cut to {prompt_len}: {batch} x {args.prompt_len} does not fit the "
                         "KV cache")

        # Warm-up: one prefill and one decode step at this batch size, on tables then released. At the
        # timed shape unless that is big (a 64 x 512 forward takes a minute on 2 threads): then shorter
        # prompts, which run the same kernels (only the row count of the matmuls differs).
        warm_len = max(1, min(prompt_len, args.warmup_max_tokens // batch))
        wait_for_idle(args.idle_wait_s, idle_threshold(args), console)
        tables, tokens, warm_prefill_s, _ = bench.prefill(batch, warm_len)
        _, warm_decode_s, _ = bench.decode_step(tables, tokens)
        bench.release(tables)
        console.log(f"{dtype} B={batch}: warm-up prefill {batch}x{warm_len} {warm_prefill_s:.2f} s, "
                    f"decode step {warm_decode_s * 1e3:.0f} ms")

        # Timed prefill, repeated when cheap. An attempt during which other processes took CPU is
        # set aside and tried again; the last attempt's tables go on to decode.
        warm_full_s = warm_prefill_s * prompt_len / warm_len  # roughly, for the repeat decision
        reps = args.repeats if warm_full_s * args.repeats <= args.repeat_budget_s else 1
        kept, discarded, tables = [], [], None
        for _ in range(reps + args.retries * reps):
            if tables is not None:
                bench.release(tables)  # before the next attempt: one set of tables must fit at a time
            idle = wait_for_idle(args.idle_wait_s, idle_threshold(args), console)
            with CpuMeter() as meter:
                tables, tokens, seconds, book = bench.prefill(batch, prompt_len)
            record = {"seconds": seconds, "bookkeeping_s": book, **meter.as_dict(), "idle_wait": idle}
            if contended(meter, args):
                discarded.append(record)
                console.log(f"[yellow]{dtype} prefill B={batch}: {seconds:.2f} s with other processes on "
                            f"{meter.other_share:.0%} of the CPUs; set aside[/]")
            else:
                kept.append(record)
                if len(kept) == reps:
                    break
        used = kept or discarded
        prefill_times = [r["seconds"] for r in used]
        median = statistics.median(prefill_times)
        out["prefill"][str(batch)] = {
            "batch_size": batch, "prompt_len": prompt_len, "tokens": batch * prompt_len, "repeats": len(used),
            "seconds": prefill_times, "median_s": median, "tokens_per_s": batch * prompt_len / median,
            "bookkeeping_s_median": statistics.median(r["bookkeeping_s"] for r in used), "notes": notes,
            "warmup_s": warm_prefill_s, "warmup_prompt_len": warm_len,
            "contended": not kept, "attempts": used if kept else [], "discarded_attempts": discarded,
            "cpu": {"other_cpu_share": max(r["other_cpu_share"] or 0.0 for r in used),
                    "attempts": len(kept) + len(discarded), "contended": not kept},
        }
        console.log(f"{dtype} B={batch}: prefill {batch}x{prompt_len} {median:.3f} s "
                    f"-> {batch * prompt_len / median:,.0f} tok/s{'' if kept else ' [red](contended)[/]'}")

        # Timed decode from context prompt_len. Each step is checked on its own: steps during which
        # other processes took CPU are set aside (and more steps run, up to (retries + 1) x steps).
        kept, discarded = [], []
        context_start = tables[0].num_tokens
        run_of_disturbed = 0
        wait_for_idle(args.idle_wait_s, idle_threshold(args), console)
        while (len(kept) < args.decode_steps
               and len(kept) + len(discarded) < args.decode_steps * (args.retries + 1)):
            context = tables[0].num_tokens
            with CpuMeter() as meter:
                tokens, seconds, book = bench.decode_step(tables, tokens)
            record = {"ms": 1e3 * seconds, "bookkeeping_ms": 1e3 * book, "context": context,
                      "other_cpu_s": meter.other_cpu_s}
            if contended(meter, args):
                discarded.append(record)
                run_of_disturbed += 1
                if run_of_disturbed >= 3:  # not a blip: wait for the machine to go quiet again
                    wait_for_idle(args.idle_wait_s, idle_threshold(args), console)
                    run_of_disturbed = 0
            else:
                kept.append(record)
                run_of_disturbed = 0
        used = kept if len(kept) >= max(1, args.decode_steps // 2) else kept + discarded
        step_ms = [r["ms"] for r in used]
        total = sum(step_ms) / 1e3
        decode_contended = used is not kept
        if discarded:
            console.log(f"[yellow]{dtype} decode B={batch}: {len(discarded)} step(s) set aside (other "
                        "processes on the "
                        f"CPUs){'; too few quiet steps, all counted' if decode_contended else ''}[/]")
        out["decode"][str(batch)] = {
            "batch_size": batch, "steps": len(used), "context_start": context_start,
            "context_end": tables[0].num_tokens, "total_s": total, "tokens_per_s": batch * len(used) / total,
            "step_ms_median": statistics.median(step_ms), "step_ms_min": min(step_ms),
            "step_ms_max": max(step_ms),
            "bookkeeping_ms_per_step": statistics.mean(r["bookkeeping_ms"] for r in used), "notes": notes,
            "step_ms": step_ms, "step_contexts": [r["context"] for r in used],
            "warmup_step_ms": 1e3 * warm_decode_s, "warmup_context": warm_len,
            "contended": decode_contended, "discarded_steps": discarded,
            "cpu": {"other_cpu_share": (sum(r["other_cpu_s"] or 0.0 for r in used)
                                        / max(total * (os.cpu_count() or 1), 1e-9)),
                    "attempts": len(kept) + len(discarded), "contended": decode_contended},
        }
        console.log(f"{dtype} B={batch}: decode {len(used)} steps {total:.2f} s "
                    f"-> {batch * len(used) / total:,.1f} "
                    f"tok/s{' [red](contended)[/]' if decode_contended else ''}")
        if batch in profile_batches and args.profile_steps > 0:
            wait_for_idle(args.idle_wait_s, idle_threshold(args), console)
            with CpuMeter() as meter:
                profile, tokens = profile_decode(bench, tables, tokens, args.profile_steps,
                                                 args.top)
            out["profile"][str(batch)] = {**profile, "cpu": meter.as_dict()}
        bench.release(tables)
    assert bench.free_blocks() == total_blocks, "blocks leaked"
    return out  # the engine (and its KV tensors) goes with this frame


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console(log_path=False)
    if not console.is_terminal:  # logs and CI: wide enough that the tables keep their columns
        console = Console(log_path=False, width=170)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    report: dict = {
        "meta": {
            "model": "smollm2-135m-instruct (SmolLM2-135M-Instruct Q4_1 GGUF, dequantized)",
            "torch_version": torch.__version__, "python": platform.python_version(),
            "threads": torch.get_num_threads(), "interop_threads": torch.get_num_interop_threads(),
            "cpu": cpu_model(), "cpu_count": os.cpu_count(), "cpu_flags": cpu_flags(),
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "dtypes": args.dtype, "batch_sizes": args.batch_sizes, "prompt_len": args.prompt_len,
            "large_batch_prompt_len": args.large_batch_prompt_len, "decode_steps": args.decode_steps,
            "kv_cache_memory": args.kv_cache_memory, "tokens_per_block": args.tokens_per_block,
            "widebeam_cache": os.environ["WIDEBEAM_CACHE"], "seed": args.seed,
            "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
            **source_fingerprint(),
            "timing": "time.perf_counter around runner.execute only; one warm-up prefill + decode step per "
                      "configuration at its batch size (prompts cut to --warmup-max-tokens/B); prefill "
                      "tok/s = B*prompt_len/median; decode tok/s = B*steps/sum of step times; measurements "
                      "during which other processes took > --max-other-share of the CPUs are repeated (see "
                      "each 'cpu')",
        },
        "results": {},
    }
    if not args.skip_first_load:
        console.log("first load: float32 in a fresh process with an empty cache (GGUF conversion) ...")
        report["load"] = first_and_fresh_process_loads(args, console)
        console.log(f"first load {report['load']['fresh_cache']['construct_s']:.1f} s, fresh process "
                    f"warm cache {report['load']['warm_cache_fresh_process']['construct_s']:.1f} s")
    # Later LLM(...) timings should not pay for one-off imports (the tokenizer pulls in transformers).
    import transformers  # noqa: F401
    from transformers import AutoTokenizer  # noqa: F401

    for dtype in args.dtype:
        report["results"][dtype] = run_dtype(dtype, args, console)
    if "float32" in report["results"] and "bfloat16" in report["results"]:
        report["comparison"] = speedups(report["results"], "float32", "bfloat16")
    report["meta"]["total_wall_s"] = time.perf_counter() - started

    out = Path(args.out)
    if not out.is_absolute():
        out = REPO_ROOT / out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print_report(report, console)
    console.log(f"wrote {out} in {report['meta']['total_wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
