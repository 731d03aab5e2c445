"""The engine's command-line options, defined once (widebeam/engine_args.py): their defaults are the
config dataclasses', they reach `EngineConfig` unchanged, every front end takes them from one table,
and `widebeam generate` loads no server code."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest

from widebeam.cli import build_parser
from widebeam.config import EngineConfig
from widebeam.defaults import DTYPES, FLOAT_DTYPES
from widebeam.engine_args import OPTIONS, engine_config, engine_kwargs
from widebeam.server.serve_cli import SERVE_MAX_WAITING_REQUESTS

COMMANDS = {"serve": [], "generate": ["a prompt"], "batch": ["in.jsonl", "out.jsonl"], "plan": [],
            "bench": []}


def test_every_option_is_a_keyword_of_the_engine_with_the_same_default():
    signature = inspect.signature(EngineConfig.from_kwargs).parameters
    for name, option in OPTIONS.items():
        assert name in signature, name
        if name in ("enable_prefix_caching", "pinned_prefixes"):  # a switch and a list of files
            continue
        # the speculative options are unset on the command line, and so are they in `from_kwargs`
        assert option.config_default() == signature[name].default, name


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_front_end_takes_its_engine_options_from_the_table(command):
    sub = build_parser()._subparsers._group_actions[0].choices[command]
    flags = {s for action in sub._actions for s in action.option_strings}
    taken = {name for name, option in OPTIONS.items() if option.option_string in flags}
    assert {"model", "dtype", "tokens_per_block"} <= taken, taken
    dtype = next(a for a in sub._actions if "--dtype" in a.option_strings)
    # bench runs transformers beside widebeam: no float16 there; every other front end takes them all
    assert tuple(dtype.choices) == (tuple(d for d in DTYPES if d != "float16") if command == "bench"
                                    else DTYPES)


def test_parsed_options_become_the_engines_config():
    args = build_parser().parse_args(["serve", "--dtype", "bfloat16", "--kv-cache-memory", "3GiB",
                                      "--max-seq-len", "99", "--speculative-method", "ngram",
                                      "--num-speculative-tokens", "6", "--no-prefix-caching"])
    config = engine_config(args)
    assert (config.model.dtype, config.cache.kv_cache_memory, config.scheduler.max_seq_len) == (
        "bfloat16", 3 * 2**30, 99)
    assert (config.speculative.method, config.speculative.num_speculative_tokens) == ("ngram", 6)
    assert config.cache.enable_prefix_caching is False and "pinned_prefixes" not in engine_kwargs(args)
    # nothing given: the config's own defaults, but a server bounds its waiting queue
    assert engine_config(build_parser().parse_args(["serve"])) == EngineConfig.from_kwargs(
        args.model, max_waiting_requests=SERVE_MAX_WAITING_REQUESTS)


def test_a_front_end_default_overrides_the_configs():
    parser = build_parser()
    assert parser.parse_args(["generate", "hi"]).kv_cache_memory == 2**30
    assert parser.parse_args(["bench"]).kv_cache_memory == 2 * 2**30
    assert parser.parse_args(["serve"]).kv_cache_memory is None
    assert parser.parse_args(["serve"]).max_waiting_requests == SERVE_MAX_WAITING_REQUESTS
    assert EngineConfig.from_kwargs().scheduler.max_waiting_requests is None  # offline: unbounded
    assert parser.parse_args(["plan"]).dtype == "bfloat16"
    assert OPTIONS["speculative_dtype"].choices == FLOAT_DTYPES


def test_generate_imports_no_server_batch_or_bench_code():
    code = ("import sys, contextlib, io; from widebeam.cli import main\n"
            "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
            "    main(['generate', '--help'])\n"
            "print(sorted(m for m in sys.modules if m.startswith(('widebeam.server', 'widebeam.batch', "
            "'widebeam.bench', 'torch'))))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stdout
