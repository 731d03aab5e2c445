"""`widebeam` command line. Bad input gets one line naming the argument, and exit code 2."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from widebeam.argtypes import OneLineParser
from widebeam.engine_args import error_message

# Each subcommand's one-line help, in `widebeam --help` order.
COMMANDS = {
    "plan": "KV capacity plan for a model, a memory size and a request shape",
    "generate": "generate a completion for one prompt",
    "serve": "OpenAI-compatible HTTP server (beam search via use_beam_search)",
    "batch": "run every row of a JSONL/CSV/Parquet file; resumable; --replicas N on Ray",
    "bench": "beam search side by side with transformers: time, memory, KV, compute floor",
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The `widebeam` parser. `command`: give only that subcommand its options (the others keep their
    one-line help), so that `widebeam generate` imports no server, batch or bench code; None: all."""
    parser = OneLineParser(prog="widebeam", description="Beam search at any width, with exact KV accounting.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    adders = {"plan": _add_plan, "generate": _add_generate, "serve": _add_serve, "batch": _add_batch,
              "bench": _add_bench}
    for name, help_text in COMMANDS.items():
        if command is None or name == command:
            adders[name](sub, help_text)
        else:
            sub.add_parser(name, help=help_text)
    return parser


def _add_plan(sub, help_text: str) -> None:
    from widebeam.plan_cli import add_plan_parser

    add_plan_parser(sub, help_text)


def _add_generate(sub, help_text: str) -> None:
    from widebeam.generate_cli import add_generate_parser

    add_generate_parser(sub, help_text)



def _add_serve(sub, help_text: str) -> None:
    from widebeam.server.serve_cli import add_serve_parser

    add_serve_parser(sub, help_text)


def _add_batch(sub, help_text: str) -> None:
    from widebeam.batch.cli import add_batch_parser

    add_batch_parser(sub, help_text)


def _add_bench(sub, help_text: str) -> None:
    from widebeam import bench

    b = sub.add_parser("bench", help=help_text,
                       description=f"{help_text}. `widebeam bench serve --help`: load against a running "
                                   "server (open loop, vLLM's conventions).")
    bench.add_arguments(b)
    b.set_defaults(func=_cmd_bench)


def _cmd_bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from widebeam import bench
    from widebeam.errors import WidebeamError

    try:
        bench.run(args)
    except WidebeamError as exc:
        print(f"widebeam bench: error: {error_message(exc)}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:2] == ["bench", "serve"]:  # the load generator: a client with its own flags, no engine
        from widebeam.bench_serve.cli import main as bench_serve_main

        return bench_serve_main(argv[2:])
    parser = build_parser(argv[0] if argv and argv[0] in COMMANDS else None)
    args = parser.parse_args(argv)
    subparser = parser._subparsers._group_actions[0].choices[args.command]  # type: ignore[union-attr]
    return args.func(args, subparser)


if __name__ == "__main__":
    sys.exit(main())
