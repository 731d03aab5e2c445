"""`widebeam bench serve`: the flags (vLLM's names where `vllm bench serve` has them) and `main(argv)`.

    widebeam bench serve --base-url http://127.0.0.1:8000 --workload genrec --catalogue items \\
        --width-mix 64:0.5,256:0.5 --num-prompts 200 --request-rate 1 2 4 --goodput e2el:2000 --save-result

Several `--request-rate` values are a sweep (one run each, the same seeded schedule scaled), several
`--base-url` values an A/B (every rate against each server in turn); either writes one JSON holding every
run (`runs`) and a PNG beside it. One run writes vLLM's flat result.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

from widebeam.argtypes import OneLineParser, fraction, int_at_least, positive_float
from widebeam.bench_serve import metrics as m
from widebeam.bench_serve import workloads as w

PROG = "widebeam bench serve"


def _checked(parse):
    """An argparse type from a parser that raises ValueError with a message."""
    def check(text: str):
        try:
            parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return text
    return check


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description="Open-loop load against an OpenAI-compatible server (vLLM's "
                                             "`vllm bench serve` conventions), with beam-search workloads.")
    server = p.add_argument_group("server")
    server.add_argument("--base-url", nargs="+", default=["http://127.0.0.1:8000"],
                        help="the server's base URL; several: the same run against each (an A/B)")
    server.add_argument("--endpoint", default=None,
                        help="the API path (default: /v1/chat/completions for chat, else /v1/completions)")
    server.add_argument("--model", default=None, help="the `model` of every request (default: the first "
                                                      "of the server's /v1/models, or none)")
    env_key = os.environ.get("OPENAI_API_KEY") or os.environ.get("WIDEBEAM_API_KEY")
    server.add_argument("--api-key", default=env_key,
                        help="bearer token (default $OPENAI_API_KEY or $WIDEBEAM_API_KEY)")
    server.add_argument("--request-timeout-s", type=positive_float(), default=600.0,
                        help="a request with no complete answer by then counts as failed (default 600)")
    load = p.add_argument_group("load")
    load.add_argument("--num-prompts", type=int_at_least(1), default=200, help="requests measured per run")
    load.add_argument("--request-rate", type=positive_float(allow_inf=True), nargs="+",
                      default=[float("inf")],
                      help="requests per second (inf: all at once); several values: a sweep")
    load.add_argument("--burstiness", type=positive_float(), default=1.0,
                      help="gamma shape of the gaps between arrivals (1: Poisson; < 1 burstier); mean gap "
                           "stays 1/rate")
    load.add_argument("--max-concurrency", type=int_at_least(1), default=None,
                      help="at most this many requests in flight (the rest wait in the client)")
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--num-warmups", type=int_at_least(0), default=0,
                      help="requests sent and answered first, left out of the result")
    load.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    work = p.add_argument_group("workload")
    work.add_argument("--workload", choices=w.WORKLOADS, default="chat")
    work.add_argument("--width-mix", type=_checked(w.parse_width_mix), default=None,
                      help="beam widths and weights, e.g. 64:0.5,256:0.5 (genrec default; translation 4:1)")
    work.add_argument("--n", type=int_at_least(1), default=None,
                      help="genrec: beams returned per request (default: every beam searched)")
    work.add_argument("--catalogue", default=None,
                      help="genrec: the catalogue the server registered (widebeam serve --catalogue "
                           "NAME=PATH)")
    work.add_argument("--catalogue-path", default=None,
                      help="that catalogue's .jsonl of item strings, to count returned items not in it "
                           "(invalid_items)")
    work.add_argument("--output-len", type=int_at_least(1), default=None,
                      help="max_tokens (default: chat 64, translation 32, genrec 8 without a catalogue)")
    work.add_argument("--prefix-words", type=int_at_least(0), default=400,
                      help="genrec: words in the prefix every request shares (default 400)")
    work.add_argument("--history-items", type=int_at_least(0), default=10,
                      help="genrec: item ids in each user's history (default 10)")
    work.add_argument("--greedy-fraction", type=lambda t: 0.0 if t.strip() in ("0", "0.0") else fraction(t),
                      default=0.5, help="chat: the share of greedy requests; the rest are sampled (0.5)")
    work.add_argument("--ignore-eos", action="store_true", help="every request generates max_tokens")
    work.add_argument("--dataset-path", default=None, help="jsonl: one request body per line")
    out = p.add_argument_group("result")
    out.add_argument("--goodput", nargs="+", type=_checked(lambda t: m.parse_goodput([t])), default=None,
                     metavar="METRIC:MS", help="bounds a request must all meet to count as good: ttft, "
                                                "tpot, e2el in milliseconds, e.g. ttft:500 e2el:2000")
    out.add_argument("--metric-percentiles", type=_checked(m.parse_percentiles), default="99",
                     help="comma-separated percentiles of every latency (default 99)")
    out.add_argument("--save-result", action="store_true", help="write the result JSON (and a sweep's PNG)")
    out.add_argument("--result-dir", default=".", help="where --save-result writes (default .)")
    out.add_argument("--result-filename", default=None, help="the JSON's name (default from the run)")
    return p


def served_model(base_url: str, api_key: str | None) -> str | None:
    """The first model the server lists, or None (widebeam serve needs no `model`)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        data = httpx.get(f"{base_url.rstrip('/')}/v1/models", headers=headers, timeout=10).json()["data"]
        return data[0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return None


def run_one(args, base_url: str, request_rate: float, catalogue_items: set[str] | None) -> dict:
    from widebeam.bench_serve.runner import RunConfig, run

    model = args.model or served_model(base_url, args.api_key)
    config = w.WorkloadConfig(
        workload=args.workload, num_requests=args.num_warmups + args.num_prompts, seed=args.seed, model=model,
        endpoint=args.endpoint, width_mix=args.width_mix, num_returned_beams=args.n, catalogue=args.catalogue,
        output_len=args.output_len, prefix_num_words=args.prefix_words, history_num_items=args.history_items,
        greedy_fraction=args.greedy_fraction, ignore_eos=args.ignore_eos, dataset_path=args.dataset_path)
    specs = w.build_requests(config)
    outcome = run(specs[args.num_warmups:],
                  RunConfig(base_url=base_url, request_rate=request_rate, burstiness=args.burstiness,
                            max_concurrency=args.max_concurrency, seed=args.seed,
                            timeout_s=args.request_timeout_s, api_key=args.api_key,
                            show_progress=not args.disable_tqdm),
                  warmups=specs[:args.num_warmups])
    percentiles = m.parse_percentiles(args.metric_percentiles)
    goodput = m.parse_goodput(args.goodput) if args.goodput else None
    result = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": "openai", "base_url": base_url,
        "model_id": model, "workload": args.workload, "num_prompts": args.num_prompts,
        "num_warmups": args.num_warmups, "request_rate": request_rate, "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency, "seed": args.seed, "width_mix": args.width_mix,
        "catalogue": args.catalogue, "metric_percentiles": percentiles, "goodput": goodput,
    }
    result.update(m.compute_result(outcome.records, outcome.duration_s, percentiles=percentiles,
                                   goodput_ms=goodput, catalogue_items=catalogue_items))
    return result


def print_summary(result: dict) -> None:
    """The headline numbers, one per line, in the shape vLLM prints them."""
    rate = result["request_rate"]
    print(f"{' Serving Benchmark Result ':=^60}")
    print(f"{'Server:':<40}{result['base_url']}")
    print(f"{'Request rate (req/s):':<40}{rate:g}")
    for label, key in [("Successful requests:", "completed"), ("Rejected requests (4xx):", "rejected"),
                       ("Failed requests:", "failed"), ("Benchmark duration (s):", "duration"),
                       ("Request throughput (req/s):", "request_throughput"),
                       ("Request goodput (req/s):", "request_goodput"),
                       ("Output token throughput (tok/s):", "output_throughput"),
                       ("Beams per second:", "beams_per_s"), ("Items per second:", "items_per_s"),
                       ("Invalid items:", "invalid_items")]:
        value = result[key]
        if key in ("beams_per_s", "items_per_s") and not value:
            continue  # no beam or catalogue requests in this workload
        if value is not None:
            print(f"{label:<40}{value:.2f}" if isinstance(value, float) else f"{label:<40}{value}")
    causes = (("rejected", result["rejected_by_status"]), ("failed", result["failed_by_reason"]))
    for bucket, counts in causes:
        if counts:
            print(f"{bucket + ' by cause:':<40}{counts}")
    if result["rejected_429_without_retry_after"]:
        print(f"{'429s without Retry-After:':<40}{result['rejected_429_without_retry_after']}")
    for metric, title in (("ttft", "Time to first token"), ("tpot", "Time per output token (excl. 1st)"),
                          ("itl", "Inter-token latency"), ("e2el", "End-to-end latency")):
        keys = [k for k in result if k.endswith(f"_{metric}_ms") and result[k] is not None
                and not k.startswith("std_")]
        if keys:
            print(f"{' ' + title + ' ':-^60}")
            for key in keys:
                print(f"{key + ':':<40}{result[key]:.2f}")
    print("=" * 60)


def _jsonable(result: dict) -> dict:
    """vLLM writes an infinite rate as "inf" (JSON has no infinity)."""
    rate = result["request_rate"]
    return {**result, "request_rate": rate if math.isfinite(rate) else "inf"}


def default_filename(args, results: list[dict]) -> str:
    rates = args.request_rate
    rate = f"{rates[0]:g}qps" if len(rates) == 1 else f"sweep{len(rates)}"
    concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
    model = str(results[0]["model_id"] or "model").rstrip("/").split("/")[-1]
    return f"bench-serve-{args.workload}-{rate}{concurrency}-{model}-{results[0]['date']}.json"


def save(args, results: list[dict]) -> Path:
    directory = Path(args.result_dir)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / (args.result_filename or default_filename(args, results))
    if len(results) == 1:
        payload = _jsonable(results[0])
    else:
        payload = {"runs": [_jsonable(r) for r in results]}
        from widebeam.bench_serve.plot import plot_sweep

        png = plot_sweep(results, path.with_suffix(".png"), m.parse_percentiles(args.metric_percentiles))
        if png is not None:
            print(f"plot: {png}")
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"result: {path}")
    return path


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else list(argv))
    try:
        catalogue_items = w.load_catalogue_items(args.catalogue_path) if args.catalogue_path else None
        if args.workload == "jsonl" and not args.dataset_path:
            raise ValueError("--workload jsonl needs --dataset-path")
        results = []
        for base_url in args.base_url:
            for rate in args.request_rate:
                results.append(run_one(args, base_url, rate, catalogue_items))
                print_summary(results[-1])
    except (OSError, ValueError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    if args.save_result:
        save(args, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
