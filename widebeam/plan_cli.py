"""`widebeam plan`: the KV capacity plan of a model, a memory size and a request shape (plan.py), sized
from the command line (a catalogue counted from its file or bounded from its shape, pins tokenized
as the engine would) and printed as tables or JSON. Torch-free, as plan.py is."""

from __future__ import annotations

import argparse
import json

from widebeam.argtypes import byte_size as _byte_size
from widebeam.argtypes import int_at_least as _int_at_least
from widebeam.argtypes import width_schedule as _width_schedule
from widebeam.engine_args import (
    PREFIX_CACHE,
    SPECULATIVE,
    add_engine_arguments,
    engine_config,
    error_message,
    prefix_cache_kwargs,
)
from widebeam.kv.spec import kv_dtype
from widebeam.units import format_bytes

PLAN_MAX_NEW_TOKENS = 128
PLAN_CATALOGUE_ITEM_TOKENS = 4  # semantic-ID items are 3 to 8 tokens; 4 is the common choice


def add_plan_parser(sub, help_text: str) -> None:
    p = sub.add_parser("plan", help=help_text)
    add_engine_arguments(p, ["model"], model={
        "help": "built-in name (see --list-models), a Hugging Face model dir, or a config.json"})
    p.add_argument("--memory", type=_byte_size, default=_byte_size("16GiB"),
                   help="device memory for weights + activations + KV, e.g. 141GiB (default 16GiB)")
    add_engine_arguments(p, ["kv_cache_fraction"])
    p.add_argument("--beam-width", type=_int_at_least(1), default=None, help="(default 1)")
    p.add_argument("--beam-width-schedule", type=_width_schedule, default=None, metavar="W1,W2,...",
                   help="per-step widths (e.g. 64,256,1024; the last repeats): the schedule's own bound "
                        "is counted, --beam-width becomes its widest step")
    p.add_argument("--prompt-len", type=_int_at_least(1), default=512)
    p.add_argument("--encoder-len", type=_int_at_least(1), default=None,
                   help="encoder-decoder models: source tokens E, held once in the cross pool (default: "
                        "--prompt-len)")
    p.add_argument("--decoder-prefix-len", type=_int_at_least(0), default=0,
                   help="encoder-decoder models: decoder prefix tokens after the start token (a target "
                        "language code: 1), held in the self pool (default 0)")
    p.add_argument("--max-new-tokens", type=_int_at_least(1), default=None,
                   help=f"generated tokens N (default {PLAN_MAX_NEW_TOKENS}; with a catalogue: its longest "
                        "item + 1)")
    # plan sizes a GPU deployment: bfloat16 by default, where the engine defaults to float32 for CPUs
    add_engine_arguments(p, ["tokens_per_block", "max_num_batched_tokens", "dtype", "kv_cache_dtype"],
                         dtype={"default": "bfloat16"})
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--list-models", action="store_true", help="list the built-in model names and exit")
    add_engine_arguments(p, [*SPECULATIVE, *PREFIX_CACHE])
    c = p.add_argument_group("catalogue (generative retrieval): its bytes come off the memory before the KV "
                             "share")
    c.add_argument("--catalogue", action="append", default=[], metavar="[NAME=]PATH",
                   help="a catalogue file (.jsonl of token ids, .npy, .parquet) the server registers at "
                        "start-up; its trie is counted exactly (repeatable)")
    c.add_argument("--catalogue-items", type=_int_at_least(1), default=None, metavar="N",
                   help="without a file: the catalogue's item count, for an upper-bound estimate of its "
                        "bytes")
    c.add_argument("--catalogue-item-tokens", type=_int_at_least(1), default=None, metavar="L",
                   help=f"without a file: tokens per item (default {PLAN_CATALOGUE_ITEM_TOKENS})")
    c.add_argument("--catalogue-bytes", type=_byte_size, default=None, metavar="B",
                   help="without a file: the catalogue's bytes as measured (Catalogue.nbytes); overrides the "
                        "estimate")
    p.set_defaults(func=_cmd_plan)


def _cmd_plan(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from widebeam.errors import ConfigError
    from widebeam.model.families.arch import BUILTIN_CONFIGS
    from widebeam.model.loading.arch import load_arch
    from widebeam.plan import PlanError, PlanInputs, plan

    if args.list_models:
        print("\n".join(BUILTIN_CONFIGS))
        return 0
    try:
        arch = load_arch(args.model)
    except ConfigError as exc:
        parser.error(f"argument --model: {exc}")
    speculative, draft_arch = _plan_speculative(args, parser)
    catalogue = _plan_catalogue(args, parser)
    max_new_tokens = args.max_new_tokens
    if max_new_tokens is None:  # the engine's default with a catalogue: its longest item and EOS
        max_new_tokens = PLAN_MAX_NEW_TOKENS if catalogue is None else catalogue.max_item_tokens + 1
    schedule = args.beam_width_schedule or ()
    if schedule and args.beam_width not in (None, max(schedule)):
        parser.error(f"argument --beam-width: with --beam-width-schedule it is the widest step "
                     f"({max(schedule)}); drop it")
    if len(schedule) > max_new_tokens:
        parser.error(f"argument --beam-width-schedule: {len(schedule)} widths for {max_new_tokens} new "
                     "tokens: one per generated token at most")
    inputs = PlanInputs(
        memory_bytes=args.memory,
        beam_width=max(schedule) if schedule else (args.beam_width or 1),
        beam_width_schedule=schedule,
        prompt_len=args.prompt_len,
        max_new_tokens=max_new_tokens,
        tokens_per_block=args.tokens_per_block,
        kv_cache_fraction=args.kv_cache_fraction,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        max_num_batched_tokens=args.max_num_batched_tokens,
        encoder_len=args.encoder_len,
        decoder_prefix_len=args.decoder_prefix_len,
        speculative=speculative,
        catalogue=catalogue,
        pinned_prefixes=_plan_pins(args, parser),
    )
    try:
        result = plan(arch, inputs, draft_arch)
    except PlanError as exc:
        parser.error(f"argument {exc.argument}: {exc}")
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print_plan(result)
    return 0


def _plan_pins(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[tuple[int, ...], ...]:
    """--pin-prefix files as token ids: .json lists as given, text through the model's tokenizer."""
    if args.pin_prefix and args.no_prefix_caching:
        parser.error("argument --pin-prefix: pinned prefixes need prefix caching; drop --no-prefix-caching")
    try:
        prefixes = prefix_cache_kwargs(args).get("pinned_prefixes", [])
    except argparse.ArgumentTypeError as exc:
        parser.error(f"argument --pin-prefix: {exc}")
    pins, tokenizer = [], None
    for prefix in prefixes:
        if isinstance(prefix, str):
            if tokenizer is None:
                tokenizer = _plan_tokenizer(args.model, parser)
            prefix = tokenizer.encode(prefix, add_special_tokens=True)
        pins.append(tuple(prefix))
    return tuple(pins)


def _plan_tokenizer(model: str, parser: argparse.ArgumentParser):
    """The tokenizer the engine would encode a text pin with: a model directory's own (or the one
    beside a config.json: plan needs no weights), else an alias's (resolved as the engine does)."""
    from pathlib import Path

    from widebeam.model.families.arch import BUILTIN_CONFIGS
    from widebeam.model.loading.build import load_tokenizer
    from widebeam.model.loading.sources import ModelSource, _has_tokenizer, resolve_model

    path = Path(model).expanduser()
    directory = path.parent if path.is_file() and path.suffix == ".json" else path if path.is_dir() else None
    try:
        if directory is not None:
            source = ModelSource(name=model, path=directory, has_tokenizer=_has_tokenizer(directory))
        else:
            source = resolve_model(model)
        tokenizer = load_tokenizer(source)
    # ModelNotFoundError is a FileNotFoundError, ModelFormatError a ValueError
    except (OSError, ValueError) as exc:
        if directory is None and model in BUILTIN_CONFIGS:  # a shape only (llama-3-8b): no files at all
            parser.error(f"argument --pin-prefix: {model} is a built-in shape without a tokenizer; give the "
                         "prefix as token ids in a .json file, or --model a directory with its tokenizer")
        parser.error(f"argument --pin-prefix: cannot load {model}'s tokenizer ({exc}); give token ids in a "
                     ".json file")
    if tokenizer is None:
        parser.error(f"argument --pin-prefix: {model} has no tokenizer files (tokenizer.json, "
                     "tokenizer.model, vocab.json); give token ids in a .json file")
    return tokenizer


def _plan_catalogue(args: argparse.Namespace, parser: argparse.ArgumentParser):
    """The plan's `CataloguePlan` (None without one): counted exactly from --catalogue files (numpy
    only), else the node bound of --catalogue-items x --catalogue-item-tokens, or --catalogue-bytes."""
    from widebeam.catalogue.sizing import CataloguePlan

    by_size = [name for name, value in (("--catalogue-items", args.catalogue_items),
                                        ("--catalogue-item-tokens", args.catalogue_item_tokens),
                                        ("--catalogue-bytes", args.catalogue_bytes)) if value is not None]
    if args.catalogue:
        if by_size:
            parser.error(f"argument --catalogue: a file is counted exactly; drop {', '.join(by_size)}")
        return CataloguePlan.counted([_trie_size(text, parser) for text in args.catalogue])
    if not by_size:
        return None
    if args.catalogue_items is None and args.catalogue_bytes is None:
        parser.error("argument --catalogue-item-tokens: give --catalogue-items (or --catalogue-bytes) too")
    item_tokens = args.catalogue_item_tokens or PLAN_CATALOGUE_ITEM_TOKENS
    return CataloguePlan.bounded(args.catalogue_items, item_tokens, args.catalogue_bytes)


def _trie_size(text: str, parser: argparse.ArgumentParser) -> tuple[int, int, int]:
    """(items, trie nodes, longest item) of a --catalogue file, NAME=PATH as `serve --catalogue`
    takes it or a plain path."""
    import os

    from widebeam.catalogue.sources import load_items, trie_size

    _name, sep, path = text.partition("=")
    if not sep or os.path.exists(text):
        path = text
    try:
        return trie_size(load_items(path))
    except ValueError as exc:  # CatalogueError
        message = str(exc)
        if "needs the model's tokenizer" in message:
            message += " (plan reads token ids only: for a text catalogue give --catalogue-items and " \
                       "--catalogue-item-tokens)"
        parser.error(f"argument --catalogue: {message}")


def _plan_speculative(args: argparse.Namespace, parser: argparse.ArgumentParser):
    """The plan's `SpeculativeConfig` (None without speculation), checked by the engine's own rules,
    and the draft model's arch (None without a draft model)."""
    from widebeam.errors import ConfigError, InvalidParameterError
    from widebeam.model.loading.arch import load_arch

    try:
        speculative = engine_config(args, SPECULATIVE).speculative
    except InvalidParameterError as exc:
        parser.error(error_message(exc))
    if speculative is None or speculative.model is None:
        return speculative, None
    try:
        return speculative, load_arch(speculative.model)
    except ConfigError as exc:
        parser.error(f"argument --speculative-model: {exc}")


def _print_plan(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:  # pipes get 80 columns by default, which wraps the pool table
        console = Console(width=120)
    req = result["request"]
    dtypes = result["dtype"]
    if result["kv_cache_dtype"] != kv_dtype(result["dtype"]):  # a KV dtype of its own (--kv-cache-dtype)
        dtypes += f", KV {result['kv_cache_dtype']}"
    sizing = Table(title=f"KV plan: {result['model']} ({dtypes})", show_header=False)
    sizing.add_column("term")
    sizing.add_column("value", justify="right")
    sizing.add_row("memory", format_bytes(result["memory_bytes"]))
    spec = result.get("speculative")
    for term, key in (("weights", "weight_bytes"), ("activation reserve", "activation_reserve_bytes")):
        if spec and f"draft_{key}" in spec:  # a draft model: its share of the term beside the total
            sizing.add_row(f"- {term} incl. draft", f"{format_bytes(result[key])} "
                                                    f"(draft {format_bytes(spec[f'draft_{key}'])})")
        else:
            sizing.add_row(f"- {term}", format_bytes(result[key]))
    catalogue = result.get("catalogue")
    if catalogue:
        shape = []
        if catalogue["num_items"] is not None:
            shape.append(f"{catalogue['num_items']:,} items x {catalogue['max_item_tokens']} tokens")
        if catalogue["num_nodes"] is not None:
            shape.append(f"{'' if catalogue['exact'] else '<= '}{catalogue['num_nodes']:,} nodes")
        detail = f" ({', '.join(shape)})" if shape else ""
        bound = "<= " if catalogue["upper_bound"] else ""
        sizing.add_row("- catalogue", f"{bound}{format_bytes(catalogue['bytes'])}{detail}")
    sizing.add_row("x kv cache fraction", f"{result['kv_cache_fraction']:g}")
    sizing.add_row("= KV cache", format_bytes(result["kv_cache_bytes"]))
    sizing.add_row("KV bytes per token (all layers)", str(result["bytes_per_token"]))
    sizing.add_row("tokens per block", str(result["tokens_per_block"]))
    sizing.add_row("max_seq_len (model limit)", f"{result['max_seq_len']} ({result['model_max_seq_len']})")
    if spec:
        sizing.add_row("speculative", f"{spec['method']}{' ' + spec['model'] if spec['model'] else ''}, "
                                      f"D={spec['num_speculative_tokens']}")
    pins = result.get("pinned_prefixes")
    if pins:
        blocks = ", ".join(f"{pool} {n}" for pool, n in pins["blocks"].items())
        sizing.add_row("pinned prefixes", f"{pins['count']} ({sum(pins['tokens'])} tokens): {blocks} blocks")
    console.print(sizing)

    source = f"source {req['encoder_len']} -> decoder " if "encoder_len" in req else ""
    speculative = f", +{spec['num_speculative_tokens']} speculative per sequence" if spec else ""
    schedule = req.get("beam_width_schedule")
    width = f"beam schedule {','.join(map(str, schedule))}" if schedule else f"beam {req['beam_width']}"
    pools = Table(title=f"request: {source}prompt {req['prompt_len']}, new {req['max_new_tokens']}, "
                        f"{width}{speculative}")
    columns = ["pool", "kind", "layers", "bytes/token", "required blocks", "capacity blocks", "fits",
               "at once"]
    if pins:  # capacity is then what requests may use: the pool less its pinned blocks
        columns[5] = "capacity blocks (less pinned)"
        columns.insert(6, "pinned blocks")
    if schedule:  # what the widest step at every step would take
        columns.insert(5, f"fixed width {req['beam_width']}")
    for column in columns:
        pools.add_column(column, justify="right" if column not in ("pool", "kind") else "left")
    for p in result["pools"]:
        row = [p["name"], p["kind"], str(p["num_layers"]), str(p["bytes_per_token"]),
               str(p["required_blocks"]),
               str(p["capacity_blocks"]), "yes" if p["fits"] else "NO", str(p["max_concurrent_requests"])]
        if pins:
            row.insert(6, str(p["pinned_blocks"]))
        if schedule:
            row.insert(5, str(p["fixed_width_required_blocks"]))
        pools.add_row(*row)
    console.print(pools)

    naive = result["naive"]
    compare = Table(title="widebeam vs naive per-beam prompt copies")
    for column in ("model", "max_seq_len", "required blocks", "fits", "requests at once"):
        compare.add_column(column, justify="right" if column != "model" else "left")
    widebeam_required = max(p["required_blocks"] for p in result["pools"])
    compare.add_row("widebeam (shared prompt)", str(result["max_seq_len"]), str(widebeam_required),
                    "yes" if result["fits"] else "NO", str(result["max_concurrent_requests"]))
    compare.add_row("naive (prompt x beam)", str(naive["max_seq_len"]), str(naive["required_blocks"]),
                    "yes" if naive["fits"] else "NO", str(naive["max_concurrent_requests"]))
    console.print(compare)
