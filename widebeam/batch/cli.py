"""`widebeam batch INPUT OUTPUT`: the command line of a batch job (see batch/run.py).

`widebeam/cli.py` adds the subcommand with `add_batch_parser(sub)`. Per-row parameters override the
flags, which are the job's defaults.
"""

from __future__ import annotations

import argparse
import json
import sys

from widebeam.argtypes import int_at_least as _int_at_least
from widebeam.argtypes import width_schedule
from widebeam.batch.local import DEFAULT_MAX_IN_FLIGHT
from widebeam.engine_args import (
    PREFIX_CACHE,
    SCHEDULING,
    add_engine_arguments,
    catalogue_spec,
    catalogues_kwargs,
    engine_kwargs,
    error_message,
)

# the engine options of every replica besides --model and the grouped ones (prefix cache, scheduling)
BATCH_ENGINE_OPTIONS = ("dtype", "linear_backend", "device", "kv_cache_memory", "tokens_per_block",
                        "max_beam_width", "max_num_batched_tokens", "kv_cache_dtype")


def add_batch_parser(sub, help_text: str) -> argparse.ArgumentParser:
    """Add `batch` to `sub` with `help_text` as its line in `widebeam --help`."""
    p = sub.add_parser("batch", help=help_text,
                       description="Run every row of INPUT (one request per row: prompt, messages or "
                                   "prompt_token_ids, plus any parameter by name) and write each row's beams "
                                   "to OUTPUT (.jsonl, .csv or .parquet). Rerunning skips rows already "
                                   "written.")
    p.add_argument("input", help="a .jsonl, .csv or .parquet file, one request per row")
    p.add_argument("output", help="where results go (.jsonl, .csv, or .parquet: a directory of parts)")
    add_engine_arguments(p, ["model"])
    d = p.add_argument_group("defaults for rows that do not set them")
    d.add_argument("--beam-width", type=_int_at_least(1), default=None,
                   help="beam search over this many beams")
    d.add_argument("--beam-width-schedule", type=width_schedule, default=None, metavar="W1,W2,...",
                   help="beam search with these per-step widths (the last repeats)")
    d.add_argument("--max-new-tokens", type=_int_at_least(1), default=None)
    d.add_argument("--temperature", type=float, default=None, help="sampling rows only; 0 is greedy")
    d.add_argument("--top-p", type=float, default=None)
    d.add_argument("--top-k", type=int, default=None)
    d.add_argument("--seed", type=int, default=None)
    d.add_argument("--length-penalty", type=float, default=None, help="beam rows only")
    d.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    d.add_argument("--no-repeat-ngram-size", type=_int_at_least(0), default=None, metavar="N",
                   help="no n-gram of N tokens twice (0: off)")
    d.add_argument("--max-input-length", type=_int_at_least(1), default=None, metavar="N",
                   help="truncate prompts to N tokens instead of refusing them")
    d.add_argument("--patience", type=float, default=None, help="beam rows only (CTranslate2's patience)")
    d.add_argument("--score", action="store_true",
                   help="score instead of generate: each row holds a prompt and a `continuation` (or a list "
                        "of `continuations`); its record holds each token's log-prob and their sum")
    d.add_argument("--default-catalogue", default=None, metavar="NAME",
                   help="beam rows that name none: constrain them to this --catalogue")
    e = p.add_argument_group("engine (one per replica)")
    add_engine_arguments(e, BATCH_ENGINE_OPTIONS)
    e.add_argument("--catalogue", type=catalogue_spec, action="append", default=[], metavar="NAME=PATH",
                   help="register a catalogue (generative retrieval) rows name in their `catalogue` field: a "
                        ".jsonl (token-id lists or strings), .npy or .parquet file (repeatable)")
    e.add_argument("--max-in-flight", type=_int_at_least(1), default=DEFAULT_MAX_IN_FLIGHT,
                   help=f"requests each engine holds queued or running (default {DEFAULT_MAX_IN_FLIGHT})")
    r = p.add_argument_group("scale-out on Ray Data (pip install 'widebeam[ray]')")
    r.add_argument("--replicas", type=_int_at_least(1), default=None,
                   help="engine replicas on Ray (one GPU each where there are GPUs)")
    r.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (default: a local Ray instance)")
    r.add_argument("--cpus-per-replica", type=_int_at_least(1), default=1,
                   help="CPU slots per replica without GPUs")
    add_engine_arguments(p, [*PREFIX_CACHE, *SCHEDULING])
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_batch)
    return p


def defaults_from(args: argparse.Namespace) -> dict:
    names = ("beam_width", "beam_width_schedule", "max_new_tokens", "temperature", "top_p", "top_k", "seed",
             "length_penalty", "no_repeat_ngram_size", "max_input_length", "patience")
    defaults = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    if args.default_catalogue is not None:
        defaults["catalogue"] = args.default_catalogue
    if args.score:
        # a scoring job: its rows are pairs; of the defaults only max_input_length applies to them
        defaults = {"score": True, **({"max_input_length": args.max_input_length}
                                      if args.max_input_length is not None else {})}
    if args.stop:
        defaults["stop"] = tuple(args.stop)
    return defaults


def _cmd_batch(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from widebeam.batch.run import run
    from widebeam.errors import WidebeamError

    if args.ray_address and not args.replicas:
        parser.error("argument --ray-address: give --replicas N too")
    try:
        kwargs = engine_kwargs(args)
    except argparse.ArgumentTypeError as exc:
        parser.error(f"argument --pin-prefix: {exc}")
    try:
        kwargs.update(catalogues_kwargs(args))
    except argparse.ArgumentTypeError as exc:
        parser.error(f"argument --catalogue: {exc}")
    try:
        summary = run(args.input, args.output, args.model, defaults=defaults_from(args),
                      replicas=args.replicas or 0,
                      ray_address=args.ray_address, max_in_flight=args.max_in_flight,
                      cpus_per_replica=args.cpus_per_replica, progress=not args.no_progress, **kwargs)
    except (WidebeamError, ValueError, OSError) as exc:
        print(f"widebeam batch: error: {error_message(exc)}", file=sys.stderr)
        return 1
    except ImportError as exc:
        print(f"widebeam batch: error: --replicas needs Ray ({exc.name} is missing): pip install "
              "'widebeam[ray]'",
              file=sys.stderr)
        return 1
    if summary.num_duplicates:
        print(f"widebeam batch: warning: {summary.num_duplicates} rows skipped, their id repeats an earlier "
              f"row's: {', '.join(summary.duplicates)}", file=sys.stderr)
    print(json.dumps({"written": summary.num_written, "errors": summary.num_errors,
                      "skipped": summary.num_skipped, "duplicates": summary.num_duplicates,
                      "first_duplicates": summary.duplicates,
                      "generated_tokens": summary.num_generated_tokens,
                      "seconds": round(summary.elapsed_s, 3), "first_errors": summary.errors}))
    return 0
