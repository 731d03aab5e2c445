"""`widebeam serve`: the OpenAI-compatible server on one engine.

`widebeam/cli.py` adds the subcommand with `add_serve_parser(sub, help_text)`; its `func` default calls
`run_serve`. `python -m widebeam.server.serve_cli [options]` runs it alone. Bad input gets one line
naming the argument, and exit code 2, like the rest of the command line. The engine's options come from
`engine_args.py`, as every front end's do; this module adds the server's own.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from widebeam.argtypes import EXIT_USAGE, OneLineParser
from widebeam.argtypes import byte_size as _byte_size
from widebeam.argtypes import int_at_least as _int_at_least
from widebeam.engine_args import (
    PREFIX_CACHE,
    QUEUE_BOUNDS,
    SCHEDULING,
    SPECULATIVE,
    add_engine_arguments,
    catalogue_error_message,
    catalogue_spec,
    catalogue_subset_spec,
    catalogues_kwargs,
)
from widebeam.engine_args import engine_kwargs as engine_kwargs_from
from widebeam.server.ray_serve import ROUTERS

API_KEY_ENV = "WIDEBEAM_API_KEY"
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
EXIT_INTERRUPTED = 130
# the engine options besides --model and the grouped ones (speculative, prefix cache, scheduling)
SERVE_MAX_WAITING_REQUESTS = 256  # the waiting queue's default bound under `serve` (unbounded offline)
SERVE_ENGINE_OPTIONS = ("kv_cache_memory", "kv_cache_fraction", "max_beam_width", "max_seq_len",
                        "tokens_per_block", "dtype", "linear_backend", "device", "max_num_batched_tokens",
                        "kv_cache_dtype")

log = logging.getLogger("widebeam.server")


def _port(text: str) -> int:
    value = _int_at_least(0)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535], got {value}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {text}")
    return value


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps the server on this machine (127.0.0.0/8, ::1, localhost)."""
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """The start-up warning for a server reachable from other machines without an API key, else None."""
    if api_key or is_loopback(host):
        return None
    return (f"--host {host} makes this server reachable from other machines, and it has no API key: anyone "
            f"who can reach the port can use it. Set one with --api-key KEY or ${API_KEY_ENV} (clients send "
            "'Authorization: Bearer KEY'), or bind 127.0.0.1")


def model_aliases(model: str) -> tuple[str, ...]:
    """Names a client may use for the served model besides `--served-model-name`: the `--model` value
    as given and, for a path, its last part ("models/my-llama/" -> "my-llama")."""
    name = Path(model.rstrip("/")).name
    return tuple(dict.fromkeys(a for a in (model, name) if a))


def add_serve_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, loopback only)")
    p.add_argument("--port", type=_port, default=8000, help="port to bind (default 8000)")
    add_engine_arguments(p, ["model"])
    p.add_argument("--served-model-name", default=None,
                   help="the name clients send as `model` and /v1/models lists (default: --model as given)")
    add_engine_arguments(p, SERVE_ENGINE_OPTIONS)
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on every endpoint but /health "
                        f"(default: ${API_KEY_ENV}, which keeps the key out of the process list)")
    p.add_argument("--max-request-bytes", type=_byte_size, default=2**20,
                   help="largest request body; larger ones get 413 (default 1MiB)")
    p.add_argument("--shutdown-timeout", type=_seconds, default=DEFAULT_SHUTDOWN_TIMEOUT_S, metavar="SECONDS",
                   help="on SIGTERM or SIGINT, new requests get 503 and those in flight get this long to "
                        "finish before they are aborted with an error; then the server exits 0 "
                        f"(default {DEFAULT_SHUTDOWN_TIMEOUT_S:g})")
    p.add_argument("--no-ui", action="store_true",
                   help="do not serve the web page at / (the search explorer, capacity and plan panels; "
                        "docs/ui.md)")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info")
    p.add_argument("--catalogue", type=catalogue_spec, action="append", default=[], metavar="NAME=PATH",
                   help="register a catalogue for generative retrieval under NAME (requests send "
                        "\"catalogue\": NAME with use_beam_search): a .jsonl (token-id lists or strings), "
                        ".npy or .parquet file; its bytes come off the KV budget (repeatable)")
    p.add_argument("--catalogue-subset", type=catalogue_subset_spec, action="append", default=[],
                   metavar="NAME:SUBSET=PATH",
                   help="a named subset of catalogue NAME's item indices (.npy, or integers in a text or "
                        "JSON file): requests send \"catalogue_subset\": SUBSET (repeatable)")
    # a server bounds its queue (sched/queue_bound.py): overload is answered with 429, never a silent wait
    add_engine_arguments(p, [*SPECULATIVE, *PREFIX_CACHE, *SCHEDULING, *QUEUE_BOUNDS],
                         max_waiting_requests={"default": SERVE_MAX_WAITING_REQUESTS})
    r = p.add_argument_group("replicas on Ray Serve (pip install 'widebeam[ray]')")
    r.add_argument("--replicas", type=_int_at_least(1), default=None,
                   help="serve N engine replicas behind Ray Serve (one GPU each where there are GPUs)")
    r.add_argument("--min-replicas", type=_int_at_least(0), default=None,
                   help="autoscale from this many replicas")
    r.add_argument("--max-replicas", type=_int_at_least(1), default=None,
                   help="autoscale up to this many replicas")
    r.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (default: a local Ray instance)")
    r.add_argument("--cpus-per-replica", type=_int_at_least(1), default=1,
                   help="CPU slots per replica without GPUs")
    r.add_argument("--router", choices=ROUTERS, default="exact-fit",
                   help="exact-fit: place each request by its exact KV block need against each replica's "
                        "room, refuse at the door what no replica can hold; serve: Ray Serve's default "
                        "router (power of two choices on queue length)")
    return p


def add_serve_parser(subparsers, help_text: str):
    """Add `serve` to `subparsers` (built with `parser_class=OneLineParser`, as `cli.py` does), with
    `help_text` as its line in `widebeam --help`.

    The subcommand's defaults set `func(args, parser)` to run the server, like the other subcommands.
    """
    p = subparsers.add_parser("serve", help=help_text,
                              description="OpenAI-compatible HTTP server: /v1/completions, "
                                          "/v1/chat/completions, /v1/models, /health, /metrics, and a "
                                          "web page at / (--no-ui: none).")
    add_serve_arguments(p)
    p.set_defaults(func=lambda args, parser=None: run_serve(args))
    return p


def _fail(message: str) -> int:
    print(f"widebeam serve: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def run_serve(args: argparse.Namespace) -> int:
    """Build the engine (load, warm-up, KV sizing), then serve until SIGTERM or SIGINT, then drain
    (widebeam/server/shutdown.py) and exit 0."""
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        import uvicorn

        from widebeam.server.api import create_app
        from widebeam.server.engine_loop import engine_thread
        from widebeam.server.shutdown import CONNECTIONS_CLOSE_TIMEOUT_S, DrainingServer
    except ImportError as exc:
        return _fail(f"the server needs its extras ({exc.name} is missing): pip install 'widebeam[server]'")
    from widebeam.engine import LLMEngine
    from widebeam.errors import WidebeamError
    from widebeam.heap import freeze_startup_heap

    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    try:
        catalogues = catalogues_kwargs(args)
    except argparse.ArgumentTypeError as exc:
        return _fail(f"argument --catalogue: {exc}")
    try:
        engine_kwargs = {**engine_kwargs_from(args), **catalogues}
    except argparse.ArgumentTypeError as exc:
        return _fail(f"argument --pin-prefix: {exc}")
    app_kwargs = {"model_name": args.served_model_name or args.model, "api_key": api_key,
                  "max_request_bytes": args.max_request_bytes, "model_aliases": model_aliases(args.model),
                  "ui": not args.no_ui, "plan_model": args.model}
    warning = exposure_warning(args.host, api_key)
    if args.replicas or args.min_replicas is not None or args.max_replicas is not None or args.ray_address:
        return _serve_on_ray(args, engine_kwargs, app_kwargs, warning)
    thread = engine_thread()  # every torch call of the engine on one thread (see engine_thread)
    try:
        engine = thread.submit(LLMEngine, args.model, **engine_kwargs).result()
    except (WidebeamError, ValueError, FileNotFoundError) as exc:
        return _fail(catalogue_error_message(exc, missing_file_param="model"))
    except KeyboardInterrupt:  # Ctrl+C while loading: nothing is served yet
        print("widebeam serve: interrupted while loading the model", file=sys.stderr)
        return EXIT_INTERRUPTED
    freeze_startup_heap()  # a long-lived process: start-up's objects leave the collector's walk
    app = create_app(engine, engine_thread=thread, **app_kwargs)
    if warning:
        log.warning(warning)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=CONNECTIONS_CLOSE_TIMEOUT_S)
    server = DrainingServer(config, app.state.engine_loop, args.shutdown_timeout)
    try:
        server.run()
    except SystemExit as exc:  # uvicorn exits 1 when it cannot bind
        return exc.code if isinstance(exc.code, int) else 1
    return 0 if server.started else 1


def _serve_on_ray(args: argparse.Namespace, engine_kwargs: dict, app_kwargs: dict,
                  warning: str | None) -> int:
    """`--replicas N` (or autoscaling bounds): the same app on Ray Serve (server/ray_serve.py)."""
    if args.min_replicas is not None and args.max_replicas is not None \
            and args.min_replicas > args.max_replicas:
        return _fail(f"argument --min-replicas: {args.min_replicas} is more than --max-replicas "
                     f"{args.max_replicas}")
    try:
        from widebeam.server import ray_serve
    except ImportError as exc:
        return _fail(f"--replicas needs Ray ({exc.name} is missing): pip install 'widebeam[ray]'")
    if warning:
        log.warning(warning)
    return ray_serve.serve_forever(model=args.model, engine_kwargs=engine_kwargs, app_kwargs=app_kwargs,
                                   host=args.host, port=args.port, replicas=args.replicas or 1,
                                   min_replicas=args.min_replicas, max_replicas=args.max_replicas,
                                   ray_address=args.ray_address, cpus_per_replica=args.cpus_per_replica,
                                   router=args.router,
                                   max_waiting_requests=engine_kwargs.get("max_waiting_requests")
                                   or SERVE_MAX_WAITING_REQUESTS)


def main(argv: Sequence[str] | None = None) -> int:
    parser = add_serve_arguments(OneLineParser(prog="widebeam serve",
                                               description="OpenAI-compatible HTTP server"))
    return run_serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
