"""`widebeam serve`: the OpenAI-compatible server on one engine.

`widebeam/cli.py` adds the subcommand with `add_serve_parser(sub)`; its `func` default calls
`run_serve`. `python -m widebeam.server.serve_cli [options]` runs it alone. Bad input gets one line
naming the argument, and exit code 2, like the rest of the command line. This module imports nothing
from `cli.py` (which imports it): both take the parser and value types from `argtypes.py`, and the
speculative decoding options (`add_speculative_arguments`, `speculative_kwargs`) from here.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from widebeam.argtypes import EXIT_USAGE, OneLineParser
from widebeam.argtypes import byte_size as _byte_size
from widebeam.argtypes import fraction as _fraction
from widebeam.argtypes import int_at_least as _int_at_least
from widebeam.config import SPECULATIVE_METHODS
from widebeam.defaults import (
    DEFAULT_KV_CACHE_FRACTION,
    DEFAULT_LINEAR_BACKEND,
    DEFAULT_MAX_BEAM_WIDTH,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MODEL,
    DEFAULT_TOKENS_PER_BLOCK,
    LINEAR_BACKENDS,
)

DTYPES = ("float32", "bfloat16", "float16", "int8")  # int8: int8 linear weights, float32 activations and KV
DRAFT_DTYPES = DTYPES[:3]
MAX_NUM_SPECULATIVE_TOKENS = 64  # SpeculativeConfig's bound on D
# The engine's parameter names as the command line spells them, for the errors SpeculativeConfig raises.
SPECULATIVE_FLAG_NAMES = {"speculative_model": "--speculative-model",
                          "num_speculative_tokens": "--num-speculative-tokens",
                          "speculative_method": "--speculative-method",
                          "speculative_dtype": "--speculative-dtype"}
# The same for the prefix cache's settings (CacheConfig's errors name `pinned_prefixes`).
PREFIX_CACHE_FLAG_NAMES = {"pinned_prefixes": "--pin-prefix", "enable_prefix_caching": "--no-prefix-caching"}
API_KEY_ENV = "WIDEBEAM_API_KEY"
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
EXIT_INTERRUPTED = 130

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


def _num_speculative_tokens(text: str) -> int:
    bounds = f"[1, {MAX_NUM_SPECULATIVE_TOKENS}]"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer in {bounds}, got {text!r}") from None
    if not 1 <= value <= MAX_NUM_SPECULATIVE_TOKENS:
        raise argparse.ArgumentTypeError(f"must be in {bounds}, got {value}")
    return value


def add_speculative_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`--speculative-model`, `--num-speculative-tokens`, `--speculative-method`, `--speculative-dtype`
    (generate, bench, serve, plan). Unset ones are None; `speculative_kwargs(args)` hands them to `LLM`/`LLMEngine`, whose
    `SpeculativeConfig` rejects bad combinations."""
    g = p.add_argument_group("speculative decoding")
    g.add_argument("--speculative-model", default=None, metavar="MODEL",
                   help="draft model (alias, Hugging Face dir or .gguf; same tokenizer as --model): it proposes "
                        "tokens the target verifies in one pass; turns speculation on (method draft)")
    g.add_argument("--num-speculative-tokens", type=_num_speculative_tokens, default=None, metavar="D",
                   help=f"tokens drafted per sequence and round, 1..{MAX_NUM_SPECULATIVE_TOKENS}; every "
                        "per-sequence KV pool reserves D more per sequence (default 4 with speculation)")
    g.add_argument("--speculative-method", choices=SPECULATIVE_METHODS, default=None,
                   help="draft: a second model (--speculative-model); ngram: copy from the request's own prompt "
                        "and output, no draft model (default: draft when --speculative-model is given)")
    g.add_argument("--speculative-dtype", choices=DRAFT_DTYPES, default=None,
                   help="the draft model's dtype (default: the target's); e.g. the target's own checkpoint "
                        "in bfloat16 as its draft")
    return p


def speculative_kwargs(args: argparse.Namespace) -> dict:
    """The speculative keyword arguments of `LLM`/`LLMEngine` from parsed options (None where not given)."""
    return {"speculative_model": args.speculative_model, "num_speculative_tokens": args.num_speculative_tokens,
            "speculative_method": args.speculative_method,
            "speculative_dtype": getattr(args, "speculative_dtype", None)}


def add_linear_backend_argument(p) -> None:
    """`--linear-backend` (generate, serve, batch, bench): how float32 linears run on a CPU."""
    p.add_argument("--linear-backend", choices=LINEAR_BACKENDS, default=DEFAULT_LINEAR_BACKEND,
                   help="float32 on CPU: split (default: at 1-4 rows each weight's output rows run as batched "
                        "blocks on every thread, F.linear otherwise; 1.4x faster W=1 and 4 beams, no extra memory); "
                        "torch (F.linear, the reference); auto (weights also packed for oneDNN, used at 4-128 "
                        "rows, the linear weights held twice); onednn (packed only: slower at 1-3 rows)")


def add_prefix_cache_arguments(p: argparse.ArgumentParser, pins: bool = True) -> argparse.ArgumentParser:
    """`--no-prefix-caching` and `--pin-prefix FILE` (serve, generate, batch, plan; bench takes only
    the first: its prompts are synthetic, nothing there is worth pinning)."""
    g = p.add_argument_group("prefix caching (on by default: prompt blocks are reused across requests)")
    g.add_argument("--no-prefix-caching", action="store_true", help="recompute every prompt")
    if pins:
        g.add_argument("--pin-prefix", action="append", default=[], metavar="FILE",
                       help="a prefix computed at start-up and never evicted (a system prompt): the file's text "
                            "(UTF-8), or token ids as a JSON list in a .json file (repeatable)")
    return p


def add_scheduling_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`--scheduling-policy` and `--max-preemptions K` (serve, generate, batch)."""
    from widebeam.config import DEFAULT_MAX_PREEMPTIONS, SCHEDULING_POLICIES

    g = p.add_argument_group("capacity scheduling")
    g.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES, default=SCHEDULING_POLICIES[0],
                   help="guaranteed_no_evict (default): admit a request when its worst case (W beams x N tokens) "
                        "fits, nothing is ever preempted; max_utilization: admit on the next step's blocks and "
                        "preempt the newest request when a step runs short (it resumes by recomputation, its "
                        "output unchanged)")
    g.add_argument("--max-preemptions", type=_int_at_least(0), default=DEFAULT_MAX_PREEMPTIONS, metavar="K",
                   help="max_utilization: a request preempted K times then runs under its worst-case reservation, "
                        f"never preempted again, before any newer request (default {DEFAULT_MAX_PREEMPTIONS})")
    return p


def scheduling_kwargs(args: argparse.Namespace) -> dict:
    """The engine's keyword arguments from `add_scheduling_arguments`' flags."""
    return {"scheduling_policy": args.scheduling_policy, "max_preemptions": args.max_preemptions}


def read_pinned_prefix(path: str) -> str | list[int]:
    """A `--pin-prefix` file: text (UTF-8), or a JSON list of token ids in a .json file. Raises
    `argparse.ArgumentTypeError` naming the file when it cannot be read or holds no prefix."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {exc}") from None
    if path.endswith(".json"):
        try:
            token_ids = json.loads(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{path} is not JSON: {exc}") from None
        # bool is an int to Python and JSON's true would pass as token 1: refuse it like a negative id
        if not (isinstance(token_ids, list) and token_ids and all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in token_ids)):
            raise argparse.ArgumentTypeError(f"{path} must hold a non-empty JSON list of token ids (integers >= 0)")
        return token_ids
    if not text:
        raise argparse.ArgumentTypeError(f"{path} is empty")
    return text


def prefix_cache_kwargs(args: argparse.Namespace) -> dict:
    """`enable_prefix_caching` and `pinned_prefixes` of `LLM`/`LLMEngine` from parsed options; raises
    `argparse.ArgumentTypeError` for an unreadable `--pin-prefix` file."""
    pins = [read_pinned_prefix(path) for path in getattr(args, "pin_prefix", None) or ()]
    kwargs: dict = {"enable_prefix_caching": not getattr(args, "no_prefix_caching", False)}
    if pins:
        kwargs["pinned_prefixes"] = pins
    return kwargs


def error_message(exc: Exception, missing_file_param: str | None = None) -> str:
    """One line for an engine start-up error: the argument it names (`missing_file_param` for a
    FileNotFoundError without one), then the message, start-up parameters called by their flags."""
    name = getattr(exc, "param", None) or (missing_file_param if isinstance(exc, FileNotFoundError) else None)
    # only the start-up settings' own errors are re-rendered (SpeculativeConfig, CacheConfig, pinning):
    # others may carry context in their args (`LLM.generate` prefixes which prompt of the batch failed)
    flags = {**SPECULATIVE_FLAG_NAMES, **PREFIX_CACHE_FLAG_NAMES}
    message = exc.render(flags) if name in flags and hasattr(exc, "render") else str(exc)
    flag = flags.get(name) or ("--" + name.replace("_", "-") if name else None)
    return f"{'argument ' + flag + ': ' if flag else ''}{message}"


def model_aliases(model: str) -> tuple[str, ...]:
    """Names a client may use for the served model besides `--served-model-name`: the `--model` value
    as given and, for a path, its last part ("models/my-llama/" -> "my-llama")."""
    name = Path(model.rstrip("/")).name
    return tuple(dict.fromkeys(a for a in (model, name) if a))


def catalogue_error_message(exc: Exception, missing_file_param: str | None = None) -> str:
    """`error_message`, with a catalogue file's own errors (`CatalogueError`, raised while the engine
    reads the file) put on `--catalogue`."""
    if getattr(exc, "param", None) is None and type(exc).__name__ == "CatalogueError":
        return f"argument --catalogue: {exc}"
    return error_message(exc, missing_file_param)


def catalogue_spec(text: str) -> tuple[str, str]:
    """`--catalogue NAME=PATH`: a name for requests' `catalogue` field and an existing file."""
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH (e.g. items=catalogue.jsonl), got {text!r}")
    if not os.path.isfile(path):
        raise argparse.ArgumentTypeError(f"{path!r} is not a file (NAME=PATH, got {text!r})")
    return name.strip(), path


def catalogues_kwargs(args: argparse.Namespace) -> dict:
    """`catalogues={NAME: PATH}` for `LLMEngine` from the repeated `--catalogue NAME=PATH` (empty when none)."""
    catalogues: dict[str, str] = {}
    for name, path in getattr(args, "catalogue", None) or ():
        if name in catalogues:
            raise argparse.ArgumentTypeError(f"catalogue name {name!r} is given twice")
        catalogues[name] = path
    return {"catalogues": catalogues} if catalogues else {}


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
    return (f"--host {host} makes this server reachable from other machines, and it has no API key: anyone who "
            f"can reach the port can use it. Set one with --api-key KEY or ${API_KEY_ENV} (clients send "
            "'Authorization: Bearer KEY'), or bind 127.0.0.1")


def add_serve_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, loopback only)")
    p.add_argument("--port", type=_port, default=8000, help="port to bind (default 8000)")
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"alias ({DEFAULT_MODEL}, gemma3-270m), a Hugging Face model dir, or a .gguf file")
    p.add_argument("--served-model-name", default=None,
                   help="the name clients send as `model` and /v1/models lists (default: --model as given)")
    p.add_argument("--kv-cache-memory", type=_byte_size, default=None,
                   help="bytes for the KV cache, e.g. 2GiB (default: a fraction of free memory, "
                        "at most 2GiB on a CPU host)")
    p.add_argument("--kv-cache-fraction", type=_fraction, default=DEFAULT_KV_CACHE_FRACTION,
                   help=f"share of the memory left after the warm-up given to KV (default {DEFAULT_KV_CACHE_FRACTION})")
    p.add_argument("--max-beam-width", type=_int_at_least(1), default=DEFAULT_MAX_BEAM_WIDTH,
                   help=f"widest beam search (default {DEFAULT_MAX_BEAM_WIDTH})")
    p.add_argument("--max-seq-len", type=_int_at_least(2), default=None,
                   help="prompt + generated tokens (default: the model's limit, bounded by the KV capacity)")
    p.add_argument("--tokens-per-block", type=_int_at_least(1), default=DEFAULT_TOKENS_PER_BLOCK)
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="weights and KV dtype (default float32)")
    add_linear_backend_argument(p)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--max-num-batched-tokens", type=_int_at_least(1), default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
                   help=f"tokens per step: the prefill chunk size (default {DEFAULT_MAX_NUM_BATCHED_TOKENS})")
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on every endpoint but /health "
                        f"(default: ${API_KEY_ENV}, which keeps the key out of the process list)")
    p.add_argument("--max-request-bytes", type=_byte_size, default=2**20,
                   help="largest request body; larger ones get 413 (default 1MiB)")
    p.add_argument("--shutdown-timeout", type=_seconds, default=DEFAULT_SHUTDOWN_TIMEOUT_S, metavar="SECONDS",
                   help="on SIGTERM or SIGINT, new requests get 503 and those in flight get this long to finish "
                        "before they are aborted with an error; then the server exits 0 "
                        f"(default {DEFAULT_SHUTDOWN_TIMEOUT_S:g})")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info")
    p.add_argument("--catalogue", type=catalogue_spec, action="append", default=[], metavar="NAME=PATH",
                   help="register a catalogue for generative retrieval under NAME (requests send "
                        "\"catalogue\": NAME with use_beam_search): a .jsonl (token-id lists or strings), .npy "
                        "or .parquet file; its bytes come off the KV budget (repeatable)")
    add_speculative_arguments(p)
    add_prefix_cache_arguments(p)
    add_scheduling_arguments(p)
    r = p.add_argument_group("replicas on Ray Serve (pip install 'widebeam[ray]')")
    r.add_argument("--replicas", type=_int_at_least(1), default=None,
                   help="serve N engine replicas behind Ray Serve (one GPU each where there are GPUs)")
    r.add_argument("--min-replicas", type=_int_at_least(0), default=None, help="autoscale from this many replicas")
    r.add_argument("--max-replicas", type=_int_at_least(1), default=None, help="autoscale up to this many replicas")
    r.add_argument("--ray-address", default=None, help="join this Ray cluster (default: a local Ray instance)")
    r.add_argument("--cpus-per-replica", type=_int_at_least(1), default=1, help="CPU slots per replica without GPUs")
    return p


def add_serve_parser(subparsers):
    """Add `serve` to `subparsers` (built with `parser_class=OneLineParser`, as `cli.py` does).

    The subcommand's defaults set `func(args, parser)` to run the server, like the other subcommands.
    """
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (beam search via use_beam_search)",
                              description="OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, "
                                          "/v1/models, /health, /metrics.")
    add_serve_arguments(p)
    p.set_defaults(func=lambda args, parser=None: run_serve(args))
    return p


def _fail(message: str) -> int:
    print(f"widebeam serve: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def run_serve(args: argparse.Namespace) -> int:
    """Build the engine (load, warm-up, KV sizing), then serve until SIGTERM or SIGINT, then drain
    (widebeam/server/shutdown.py) and exit 0."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        import uvicorn

        from widebeam.server.api import create_app
        from widebeam.server.shutdown import CONNECTIONS_CLOSE_TIMEOUT_S, DrainingServer
    except ImportError as exc:
        return _fail(f"the server needs its extras ({exc.name} is missing): pip install 'widebeam[server]'")
    from widebeam.engine import LLMEngine
    from widebeam.errors import WidebeamError

    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    try:
        catalogues = catalogues_kwargs(args)
    except argparse.ArgumentTypeError as exc:
        return _fail(f"argument --catalogue: {exc}")
    try:
        prefix_cache = prefix_cache_kwargs(args)
    except argparse.ArgumentTypeError as exc:
        return _fail(f"argument --pin-prefix: {exc}")
    engine_kwargs = dict(dtype=args.dtype, linear_backend=args.linear_backend, device=args.device, tokens_per_block=args.tokens_per_block,
                         kv_cache_memory=args.kv_cache_memory, kv_cache_fraction=args.kv_cache_fraction,
                         max_seq_len=args.max_seq_len, max_beam_width=args.max_beam_width,
                         max_num_batched_tokens=args.max_num_batched_tokens, **catalogues, **speculative_kwargs(args),
                         **prefix_cache, **scheduling_kwargs(args))
    app_kwargs = {"model_name": args.served_model_name or args.model, "api_key": api_key,
                  "max_request_bytes": args.max_request_bytes, "model_aliases": model_aliases(args.model)}
    warning = exposure_warning(args.host, api_key)
    if args.replicas or args.min_replicas is not None or args.max_replicas is not None or args.ray_address:
        return _serve_on_ray(args, engine_kwargs, app_kwargs, warning)
    try:
        engine = LLMEngine(args.model, **engine_kwargs)
    except (WidebeamError, ValueError, FileNotFoundError) as exc:
        return _fail(catalogue_error_message(exc, missing_file_param="model"))
    except KeyboardInterrupt:  # Ctrl+C while loading: nothing is served yet
        print("widebeam serve: interrupted while loading the model", file=sys.stderr)
        return EXIT_INTERRUPTED
    app = create_app(engine, **app_kwargs)
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


def _serve_on_ray(args: argparse.Namespace, engine_kwargs: dict, app_kwargs: dict, warning: str | None) -> int:
    """`--replicas N` (or autoscaling bounds): the same app on Ray Serve (server/ray_serve.py)."""
    if args.min_replicas is not None and args.max_replicas is not None and args.min_replicas > args.max_replicas:
        return _fail(f"argument --min-replicas: {args.min_replicas} is more than --max-replicas {args.max_replicas}")
    try:
        from widebeam.server import ray_serve
    except ImportError as exc:
        return _fail(f"--replicas needs Ray ({exc.name} is missing): pip install 'widebeam[ray]'")
    if warning:
        log.warning(warning)
    return ray_serve.serve_forever(model=args.model, engine_kwargs=engine_kwargs, app_kwargs=app_kwargs,
                                   host=args.host, port=args.port, replicas=args.replicas or 1,
                                   min_replicas=args.min_replicas, max_replicas=args.max_replicas,
                                   ray_address=args.ray_address, cpus_per_replica=args.cpus_per_replica)


def main(argv: Sequence[str] | None = None) -> int:
    parser = add_serve_arguments(OneLineParser(prog="widebeam serve", description="OpenAI-compatible HTTP server"))
    return run_serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
