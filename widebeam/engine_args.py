"""The engine's command-line options, defined once for every front end (serve, generate, bench, batch, plan).

Each option is one setting of a config dataclass (config.py): its flag is the `LLMEngine` keyword spelled
with dashes, its default is the dataclass field's (a front end may override it, e.g. generate's 1GiB KV
cache), and its type, choices and help live in `OPTIONS` below. `add_engine_arguments(parser, names)`
adds the named options; `engine_kwargs(args)` turns the parsed options back into `LLMEngine` keyword
arguments and `engine_config(args)` into an `EngineConfig`.

Torch-free and free of server code: `widebeam generate --help` imports no more than this.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from widebeam.argtypes import byte_size, fraction, int_at_least
from widebeam.config import (
    SCHEDULING_POLICIES,
    SPECULATIVE_METHODS,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from widebeam.defaults import (
    DEFAULT_MODEL,
    DTYPES,
    FLOAT_DTYPES,
    KV_CACHE_DTYPES,
    LINEAR_BACKENDS,
    MAX_NUM_SPECULATIVE_TOKENS,
)

_FROM_CONFIG = object()  # EngineOption.default: the config dataclass field's default


def _num_speculative_tokens(text: str) -> int:
    bounds = f"[1, {MAX_NUM_SPECULATIVE_TOKENS}]"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer in {bounds}, got {text!r}") from None
    if not 1 <= value <= MAX_NUM_SPECULATIVE_TOKENS:
        raise argparse.ArgumentTypeError(f"must be in {bounds}, got {value}")
    return value


@dataclasses.dataclass(frozen=True)
class EngineOption:
    """One engine setting on the command line. `kwarg`: its `LLMEngine` keyword; `config` and `field`
    (default: `kwarg`): the dataclass field that holds it and gives its default, unless `default` is
    set. `unset_help`: what a default of None means. `to_kwarg`: the engine's value from the parsed
    one, where they differ."""

    kwarg: str
    config: type
    help: str
    field: str | None = None
    type: Callable | None = None
    choices: tuple | None = None
    metavar: str | None = None
    default: object = _FROM_CONFIG
    unset_help: str | None = None
    flag: str | None = None  # None: "--" + kwarg with dashes
    action: str | None = None
    to_kwarg: Callable | None = None
    group: str | None = None

    @property
    def option_string(self) -> str:
        return self.flag or "--" + self.kwarg.replace("_", "-")

    @property
    def dest(self) -> str:
        return self.option_string[2:].replace("-", "_")

    def config_default(self):
        if self.default is not _FROM_CONFIG:
            return self.default
        name = self.field or self.kwarg
        (field,) = (f for f in dataclasses.fields(self.config) if f.name == name)
        return field.default


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
            raise argparse.ArgumentTypeError(f"{path} must hold a non-empty JSON list of token ids "
                                             "(integers >= 0)")
        return token_ids
    if not text:
        raise argparse.ArgumentTypeError(f"{path} is empty")
    return text


SPECULATIVE_GROUP = "speculative decoding"
SCHEDULING_GROUP = "capacity scheduling"
PREFIX_CACHE_GROUP = "prefix caching (on by default: prompt blocks are reused across requests)"

# short names, so the table's lines stay readable
_Model, _Cache, _Sched, _Spec = ModelConfig, CacheConfig, SchedulerConfig, SpeculativeConfig
OPTIONS: dict[str, EngineOption] = {o.kwarg: o for o in (
    EngineOption("model", _Model, f"alias ({DEFAULT_MODEL}, gemma3-270m), a Hugging Face model dir "
                 "(Llama-family, Gemma 3, Marian translation), or a .gguf file"),
    EngineOption("dtype", _Model, "weights and KV dtype (int8: int8 linear weights, float32 activations "
                 "and KV)", choices=DTYPES),
    EngineOption("linear_backend", _Model, "float32 on CPU: split (q/k/v and gate/up stacked; at 1-4 rows "
                 "each weight's output rows run as batched blocks on every thread where a start-up probe "
                 "finds that faster on this CPU, F.linear otherwise; no extra memory); torch (F.linear, the "
                 "reference); auto (weights also packed for oneDNN, "
                 "used at 4-128 rows, the linear weights held twice); onednn (packed only: slower at 1-3 "
                 "rows)", choices=LINEAR_BACKENDS),
    EngineOption("device", _Model, "cpu or cuda", unset_help="cuda when available"),
    EngineOption("kv_cache_memory", _Cache, "bytes for the KV cache, e.g. 2GiB", type=byte_size,
                 unset_help="a fraction of free memory, at most 2GiB on a CPU host"),
    EngineOption("kv_cache_fraction", _Cache, "share of the memory left after the weights and "
                 "activations given to KV", type=fraction),
    EngineOption("tokens_per_block", _Cache, "KV block size T: smaller blocks share more of the beams' "
                 "common tokens", type=int_at_least(1)),
    EngineOption("kv_cache_dtype", _Cache, "what the KV cache stores: auto (the model's dtype; float32 "
                 "for int8 weights), bfloat16 or float16 (half float32's bytes), int8 (a byte a value and a "
                 "float16 scale per 32 values, as llama.cpp's q8_0: 3.8x float32's tokens at head_dim 64)",
                 choices=KV_CACHE_DTYPES),
    EngineOption("max_beam_width", _Sched, "widest beam search", type=int_at_least(1)),
    EngineOption("max_seq_len", _Sched, "prompt + generated tokens", type=int_at_least(2),
                 unset_help="the model's limit, bounded by the KV capacity"),
    EngineOption("max_num_batched_tokens", _Sched, "tokens per step: the prefill chunk size and the most "
                 "rows one step feeds (a wider beam round is split over steps); it sizes the activation "
                 "reserve", type=int_at_least(1)),
    # The speculative options are unset (None) by default: `EngineConfig.from_kwargs` turns speculation
    # on only when a model or a method is given, so the config's defaults cannot stand for "not given".
    EngineOption("speculative_model", _Spec, "draft model (alias, Hugging Face dir or .gguf; same "
                 "tokenizer as --model): it proposes tokens the target verifies in one pass; turns "
                 "speculation on (method draft)", field="model", metavar="MODEL", default=None,
                 group=SPECULATIVE_GROUP),
    EngineOption("num_speculative_tokens", _Spec, "tokens drafted per sequence and round, "
                 f"1..{MAX_NUM_SPECULATIVE_TOKENS}; every per-sequence KV pool reserves D more per sequence",
                 type=_num_speculative_tokens, metavar="D", default=None, group=SPECULATIVE_GROUP,
                 unset_help=f"{SpeculativeConfig.num_speculative_tokens} with speculation"),
    EngineOption("speculative_method", _Spec, "draft: a second model (--speculative-model); ngram: copy "
                 "from the request's own prompt and output, no draft model", field="method",
                 choices=SPECULATIVE_METHODS, default=None, group=SPECULATIVE_GROUP,
                 unset_help="draft when --speculative-model is given"),
    EngineOption("speculative_dtype", _Spec, "the draft model's dtype; e.g. the target's own checkpoint "
                 "in bfloat16 as its draft", field="dtype", choices=FLOAT_DTYPES, default=None,
                 unset_help="the target's", group=SPECULATIVE_GROUP),
    EngineOption("scheduling_policy", _Sched, "guaranteed_no_evict: admit a request when its worst case "
                 "(W beams x N tokens) fits, nothing is ever preempted; max_utilization: admit on the next "
                 "step's blocks and preempt the newest request when a step runs short (it resumes by "
                 "recomputation, its output unchanged)", choices=SCHEDULING_POLICIES, group=SCHEDULING_GROUP),
    EngineOption("max_preemptions", _Sched, "max_utilization: a request preempted K times then runs under "
                 "its worst-case reservation, never preempted again, before any newer request",
                 type=int_at_least(0), metavar="K", group=SCHEDULING_GROUP),
    EngineOption("max_waiting_requests", _Sched, "requests the waiting queue holds; past it a request is "
                 "refused at once (HTTP 429 with Retry-After) instead of queued", type=int_at_least(1),
                 metavar="N", default=None, unset_help="unbounded", group=SCHEDULING_GROUP),
    EngineOption("max_waiting_blocks", _Sched, "KV blocks the waiting requests may reserve in any one pool "
                 "(their worst cases summed); past it a request is refused (HTTP 429)", type=int_at_least(1),
                 metavar="B", default=None, unset_help="unbounded", group=SCHEDULING_GROUP),
    EngineOption("priority_preemption", _Sched, "a queued request that does not fit preempts running "
                 "requests of a lower priority (the request field `priority`, lower first); admission then "
                 "counts each request's re-feed after a preemption", flag="--priority-preemption",
                 action="store_true", default=False, group=SCHEDULING_GROUP),
    EngineOption("priority_yield", _Sched, "while a request of a more urgent priority runs, the others "
                 "take one part in N of the time (their blocks stay held), so a small urgent request does "
                 "not wait on wide searches' steps", type=int_at_least(0), metavar="N", default=0,
                 unset_help="0: off", group=SCHEDULING_GROUP),
    EngineOption("enable_prefix_caching", _Cache, "recompute every prompt", flag="--no-prefix-caching",
                 action="store_true", default=False, to_kwarg=lambda off: not off, group=PREFIX_CACHE_GROUP),
    EngineOption("pinned_prefixes", _Cache, "a prefix computed at start-up and never evicted (a system "
                 "prompt): the file's text (UTF-8), or token ids as a JSON list in a .json file "
                 "(repeatable)", flag="--pin-prefix", action="append", metavar="FILE", default=[],
                 to_kwarg=lambda paths: [read_pinned_prefix(p) for p in paths], group=PREFIX_CACHE_GROUP),
)}

SPECULATIVE = ("speculative_model", "num_speculative_tokens", "speculative_method", "speculative_dtype")
SCHEDULING = ("scheduling_policy", "max_preemptions")
QUEUE_BOUNDS = ("max_waiting_requests", "max_waiting_blocks", "priority_preemption", "priority_yield")
PREFIX_CACHE = ("enable_prefix_caching", "pinned_prefixes")
# The engine's parameter names as the command line spells them, for the errors the start-up settings raise
# (SpeculativeConfig, CacheConfig, pinning); other errors keep the engine's names.
FLAG_NAMES = {name: OPTIONS[name].option_string for name in (*SPECULATIVE, *PREFIX_CACHE)}


def _help(option: EngineOption, default) -> str:
    if default is None:
        return f"{option.help} (default: {option.unset_help})" if option.unset_help else option.help
    if option.action is not None:  # a switch or a list: its default says nothing
        return option.help
    return f"{option.help} (default {default})"


def add_engine_arguments(parser: argparse.ArgumentParser, names: Iterable[str],
                         **overrides: Mapping[str, object]) -> argparse.ArgumentParser:
    """Add the engine options `names` (keys of `OPTIONS`, in that order) to `parser`, grouped options
    under their group's title. `overrides[name]`: a front end's own argparse settings for one option,
    e.g. `kv_cache_memory={"default": "1GiB"}` (a string default is parsed as the flag's value would
    be, and the help shows it as written)."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for name in names:
        option = OPTIONS[name]
        kwargs: dict = {"default": option.config_default(), "action": option.action, "type": option.type,
                        "choices": option.choices, "metavar": option.metavar, **overrides.get(name, {})}
        kwargs = {key: value for key, value in kwargs.items() if value is not None or key == "default"}
        kwargs.setdefault("help", _help(option, kwargs["default"]))
        target = parser
        if option.group is not None:
            if option.group not in groups:
                groups[option.group] = parser.add_argument_group(option.group)
            target = groups[option.group]
        target.add_argument(option.option_string, **kwargs)
    return parser


def engine_kwargs(args: argparse.Namespace, names: Iterable[str] | None = None) -> dict:
    """`LLMEngine` keyword arguments from the engine options parsed into `args` (those of `names`, by
    default all; options the front end does not take are left out, and so is `model`, which front ends
    pass on its own). Pinned prefixes appear only when given. Raises `argparse.ArgumentTypeError` for an
    unreadable `--pin-prefix` file."""
    kwargs: dict = {}
    for name in OPTIONS if names is None else names:
        option = OPTIONS[name]
        if name == "model" or not hasattr(args, option.dest):
            continue
        value = getattr(args, option.dest)
        if name == "pinned_prefixes" and not value:
            continue
        kwargs[name] = option.to_kwarg(value) if option.to_kwarg is not None else value
    return kwargs


def prefix_cache_kwargs(args: argparse.Namespace) -> dict:
    """`enable_prefix_caching` and `pinned_prefixes` (when given) from parsed options; a front end
    without these options (none parsed) gets the engine's default, caching on."""
    return {"enable_prefix_caching": True, **engine_kwargs(args, PREFIX_CACHE)}


def engine_config(args: argparse.Namespace, names: Iterable[str] | None = None) -> EngineConfig:
    """The `EngineConfig` the engine would build from the parsed options (those of `names`, by default
    all; `--model` included), checked by the engine's own rules (`InvalidParameterError`)."""
    return EngineConfig.from_kwargs(getattr(args, "model", DEFAULT_MODEL), **engine_kwargs(args, names))


def catalogue_spec(text: str) -> tuple[str, str]:
    """`--catalogue NAME=PATH`: a name for requests' `catalogue` field and an existing file."""
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH (e.g. items=catalogue.jsonl), got {text!r}")
    if not os.path.isfile(path):
        raise argparse.ArgumentTypeError(f"{path!r} is not a file (NAME=PATH, got {text!r})")
    return name.strip(), path


def catalogue_subset_spec(text: str) -> tuple[str, str, str]:
    """`--catalogue-subset NAME:SUBSET=PATH`: a subset of catalogue NAME's item indices, from a file."""
    head, sep, path = text.partition("=")
    name, colon, subset = head.partition(":")
    if not sep or not colon or not name.strip() or not subset.strip() or not path:
        raise argparse.ArgumentTypeError(f"expected NAME:SUBSET=PATH (e.g. items:store_17=store_17.npy), "
                                         f"got {text!r}")
    if not os.path.isfile(path):
        raise argparse.ArgumentTypeError(f"{path!r} is not a file (NAME:SUBSET=PATH, got {text!r})")
    return name.strip(), subset.strip(), path


def catalogues_kwargs(args: argparse.Namespace) -> dict:
    """`catalogues={NAME: PATH}` for `LLMEngine` from the repeated `--catalogue NAME=PATH` (empty when
    none), with the `--catalogue-subset NAME:SUBSET=PATH` subsets of each."""
    from widebeam.catalogue.registry import WithSubsets

    catalogues: dict[str, object] = {}
    for name, path in getattr(args, "catalogue", None) or ():
        if name in catalogues:
            raise argparse.ArgumentTypeError(f"catalogue name {name!r} is given twice")
        catalogues[name] = path
    subsets: dict[str, dict[str, str]] = {}
    for name, subset, path in getattr(args, "catalogue_subset", None) or ():
        if name not in catalogues:
            raise argparse.ArgumentTypeError(f"--catalogue-subset names catalogue {name!r}, which no "
                                             "--catalogue registers")
        subsets.setdefault(name, {})[subset] = path
    for name, named in subsets.items():
        catalogues[name] = WithSubsets(catalogues[name], named)
    return {"catalogues": catalogues} if catalogues else {}


def error_message(exc: Exception, missing_file_param: str | None = None) -> str:
    """One line for an engine start-up error: the argument it names (`missing_file_param` for a
    FileNotFoundError without one), then the message, start-up parameters called by their flags."""
    name = getattr(exc, "param", None) or (missing_file_param if isinstance(exc, FileNotFoundError) else None)
    # only the start-up settings' own errors are re-rendered (SpeculativeConfig, CacheConfig, pinning):
    # others may carry context in their args (`LLM.generate` prefixes which prompt of the batch failed)
    message = exc.render(FLAG_NAMES) if name in FLAG_NAMES and hasattr(exc, "render") else str(exc)
    flag = FLAG_NAMES.get(name) or ("--" + name.replace("_", "-") if name else None)
    return f"{'argument ' + flag + ': ' if flag else ''}{message}"


def catalogue_error_message(exc: Exception, missing_file_param: str | None = None) -> str:
    """`error_message`, with a catalogue file's own errors (`CatalogueError`, raised while the engine
    reads the file) put on `--catalogue`."""
    if getattr(exc, "param", None) is None and type(exc).__name__ == "CatalogueError":
        return f"argument --catalogue: {exc}"
    return error_message(exc, missing_file_param)
