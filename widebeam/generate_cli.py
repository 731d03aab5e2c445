"""`widebeam generate`: one prompt, greedy, sampled or beam search (with a catalogue, a width schedule, a
target prefix, the search tree), printed as text, a ranked table or JSON."""

from __future__ import annotations

import argparse
import json

from widebeam.argtypes import int_at_least as _int_at_least
from widebeam.argtypes import width_schedule as _width_schedule
from widebeam.engine_args import (
    PREFIX_CACHE,
    SCHEDULING,
    SPECULATIVE,
    add_engine_arguments,
    catalogue_error_message,
    engine_kwargs,
)

GENERATE_MAX_NEW_TOKENS = 32
GENERATE_CATALOGUE_BEAM_WIDTH = 8
CLI_CATALOGUE = "cli"  # the name `generate --catalogue` registers its file under
# generate's engine options besides --model and the grouped ones; its beam width sets max_beam_width
GENERATE_ENGINE_OPTIONS = ("dtype", "linear_backend", "device", "kv_cache_memory", "tokens_per_block",
                           "kv_cache_dtype")


def add_generate_parser(sub, help_text: str) -> None:
    g = sub.add_parser("generate", help=help_text)
    g.add_argument("prompt", help="the prompt text (with --chat: the user message)")
    add_engine_arguments(g, ["model"])
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    g.add_argument("--max-new-tokens", type=_int_at_least(1), default=None,
                   help=f"default {GENERATE_MAX_NEW_TOKENS}; with --catalogue: its longest item + 1")
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--beam-width", type=_int_at_least(1), default=None,
                   help="beam search over this many beams (prints the ranked beams with their scores)")
    g.add_argument("--beam-width-schedule", type=_width_schedule, default=None, metavar="W1,W2,...",
                   help="beam search with these per-step widths (e.g. 4,16,8; the last repeats); results "
                        "come from the last width")
    g.add_argument("--num-return-sequences", type=_int_at_least(1), default=None,
                   help="beams to print (default: all)")
    g.add_argument("--length-penalty", type=float, default=1.0)
    g.add_argument("--early-stopping", choices=("true", "false", "never"), default="false")
    add_engine_arguments(g, GENERATE_ENGINE_OPTIONS, kv_cache_memory={"default": "1GiB"})
    g.add_argument("--catalogue", default=None, metavar="PATH",
                   help="generative retrieval: beam search constrained to this file's items (.jsonl of token "
                        "ids or strings, .npy, .parquet); implies beam search (--beam-width default "
                        f"{GENERATE_CATALOGUE_BEAM_WIDTH}); each beam ends with its item")
    o = g.add_argument_group("decoding options (docs/decoding-options.md)")
    o.add_argument("--no-repeat-ngram-size", type=_int_at_least(0), default=0, metavar="N",
                   help="no n-gram of N tokens twice (transformers' no_repeat_ngram_size; 0: off)")
    o.add_argument("--bad-words-ids", type=_token_ids, action="append", default=[], metavar="ID,ID,...",
                   help="a token sequence never generated (repeatable; transformers' bad_words_ids)")
    o.add_argument("--max-input-length", type=_int_at_least(1), default=None, metavar="N",
                   help="truncate the prompt (an encoder-decoder's source: its first N tokens) instead "
                        "of refusing it")
    o.add_argument("--patience", type=float, default=1.0,
                   help="beam search: stop once beam_width * patience hypotheses finished (CTranslate2's)")
    t = g.add_argument_group("encoder-decoder models (translation)")
    t.add_argument("--target-prefix", default=None, metavar="TEXT",
                   help="the decoder starts from these tokens after its start token (NLLB: a target "
                        "language code such as fra_Latn; a forced partial translation); tokenized without "
                        "special tokens")
    t.add_argument("--target-prefix-ids", type=_token_ids, default=None, metavar="ID,ID,...",
                   help="the same as token ids")
    t.add_argument("--prefix-bias-beta", type=float, default=0.0, metavar="BETA",
                   help="beam search: the target prefix becomes a soft bias in (0, 1) (CTranslate2's)")
    t.add_argument("--return-alternatives", action="store_true",
                   help="beam search: the --beam-width most likely tokens after the target prefix, each "
                        "continued greedily (CTranslate2's autocompletion)")
    t.add_argument("--min-alternative-expansion-prob", type=float, default=0.0, metavar="P",
                   help="with --return-alternatives: drop alternatives less likely than P")
    t.add_argument("--forced-bos-token-id", type=_int_at_least(0), default=None, metavar="ID",
                   help="the first generated token (mBART-50 / NLLB as transformers' forced_bos_token_id)")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.add_argument("--tree", action="store_true",
                   help="beam search: also print the search tree, every candidate each step kept (with "
                        "--json: under \"tree\", the format of docs/ui.md)")
    add_engine_arguments(g, [*SPECULATIVE, *PREFIX_CACHE, *SCHEDULING])
    g.set_defaults(func=_cmd_generate)


def _token_ids(text: str) -> tuple[int, ...]:
    try:
        ids = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {text!r}") from None
    if any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError(f"token ids must be >= 0, got {text!r}")
    return ids


def _cmd_generate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from widebeam.errors import WidebeamError
    from widebeam.heap import freeze_startup_heap
    from widebeam.llm import LLM
    from widebeam.params import BeamSearchParams, SamplingParams

    catalogue = args.catalogue
    if catalogue is not None:
        if args.temperature > 0:
            parser.error("argument --catalogue: constrained decoding is beam search: --temperature must be 0")
        if args.beam_width is None:
            args.beam_width = GENERATE_CATALOGUE_BEAM_WIDTH
    schedule = args.beam_width_schedule
    if schedule is not None:
        if args.temperature > 0:
            parser.error("argument --beam-width-schedule: beam search is deterministic: --temperature "
                         "must be 0")
        if args.beam_width is not None and args.beam_width != max(schedule):
            parser.error(f"argument --beam-width: with --beam-width-schedule it is the widest step "
                         f"({max(schedule)}); drop it")
        args.beam_width = max(schedule)
    if args.tree and args.beam_width is None:
        parser.error("argument --tree: the search tree is beam search's: give --beam-width")
    max_new_tokens = args.max_new_tokens
    if max_new_tokens is None and catalogue is None:
        max_new_tokens = GENERATE_MAX_NEW_TOKENS
    if args.target_prefix is not None and args.target_prefix_ids is not None:
        parser.error("argument --target-prefix: give --target-prefix or --target-prefix-ids, not both")
    start = {"decoder_prefix": args.target_prefix or args.target_prefix_ids or (),
             "forced_bos_token_id": args.forced_bos_token_id,
             "no_repeat_ngram_size": args.no_repeat_ngram_size, "bad_words_ids": tuple(args.bad_words_ids),
             "max_input_length": args.max_input_length}
    try:
        if args.beam_width is not None:
            early_stopping = {"true": True, "false": False, "never": "never"}[args.early_stopping]
            params = BeamSearchParams(beam_width=args.beam_width, beam_width_schedule=schedule,
                                      max_new_tokens=max_new_tokens,
                                      length_penalty=args.length_penalty, early_stopping=early_stopping,
                                      num_return_sequences=args.num_return_sequences, stop=tuple(args.stop),
                                      catalogue=CLI_CATALOGUE if catalogue is not None else None,
                                      return_tree=args.tree, patience=args.patience,
                                      prefix_bias_beta=args.prefix_bias_beta,
                                      return_alternatives=args.return_alternatives,
                                      min_alternative_expansion_prob=args.min_alternative_expansion_prob,
                                      **start)
        else:
            for flag, value, off in (("--patience", args.patience, 1.0),
                                     ("--prefix-bias-beta", args.prefix_bias_beta, 0.0),
                                     ("--return-alternatives", args.return_alternatives, False)):
                if value != off:
                    parser.error(f"argument {flag}: applies to beam search: add --beam-width")
            params = SamplingParams(max_new_tokens=max_new_tokens, temperature=args.temperature,
                                    top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop=tuple(args.stop),
                                    **start)
        catalogues = {CLI_CATALOGUE: catalogue} if catalogue is not None else {}
        llm = LLM(args.model, max_beam_width=max(args.beam_width or 1, 1),
                  **({"catalogues": catalogues} if catalogues else {}), **engine_kwargs(args))
        freeze_startup_heap()  # no collector pause inside a step (widebeam/heap.py)
        prompt = llm.engine.apply_chat_template(args.prompt) if args.chat else args.prompt
        (output,) = llm.generate([prompt], params, use_tqdm=False)
    except argparse.ArgumentTypeError as exc:
        parser.error(f"argument --pin-prefix: {exc}")
    except (WidebeamError, ValueError, FileNotFoundError) as exc:
        parser.error(catalogue_error_message(exc))
    if args.json:
        print(json.dumps({
            "prompt": prompt,
            "outputs": [{"index": c.index, "text": c.text, "token_ids": c.token_ids, "score": c.score,
                         "cumulative_logprob": c.cumulative_logprob, "finish_reason": c.finish_reason}
                        for c in output.outputs],
            "kv_peak_blocks": output.peak_blocks,
            "kv_required_blocks": output.required_blocks,
            "num_cached_tokens": output.num_cached_tokens,
            **({"tree": output.tree} if args.tree else {}),
        }, indent=2))
    elif args.beam_width is None:
        print(output.outputs[0].text)
    else:
        _print_beams(output, "schedule " + ",".join(map(str, schedule)) if schedule else args.beam_width)
        if args.tree:
            print_tree(output.tree)
    return 0


def print_tree(tree: dict) -> None:
    """The search tree as text: one line per step, each kept node as `id<parent 'token' logprob`,
    marked `#rank` when returned, `=` when finished, `x` when pruned."""
    by_step: dict[int, list[int]] = {}
    for node, step in enumerate(tree["step"]):
        by_step.setdefault(step, []).append(node)
    print(f"search tree: {tree['num_nodes']} nodes over {tree['num_steps']} steps ({tree['nbytes']} bytes)")
    text = tree.get("token_text", {})
    for step, nodes in sorted(by_step.items()):
        parts = []
        for node in nodes:
            mark = ""
            if tree["rank"][node] is not None:
                mark = f" #{tree['rank'][node] + 1}"
            elif tree["finished"][node]:
                mark = " ="
            elif tree["pruned_at"][node] is not None:
                mark = " x"
            token = text.get(str(tree["token_id"][node]), str(tree["token_id"][node]))
            logprob = tree["cumulative_logprob"][node]
            parts.append(f"{node}<{tree['parent'][node]} {token!r} {logprob:.2f}{mark}")
        print(f"step {step}: " + " | ".join(parts))


def _print_beams(output, beam_width: int | str) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:
        console = Console(width=120)
    peak = ", ".join(f"{pool} {output.peak_blocks[pool]}/{output.required_blocks[pool]}"
                     for pool in output.peak_blocks)
    table = Table(title=f"beam search, width {beam_width} (KV blocks peak/required: {peak})")
    for column in ("rank", "score", "logprob", "finish", "text"):
        table.add_column(column, justify="right" if column in ("rank", "score", "logprob") else "left")
    for c in output.outputs:
        table.add_row(str(c.index + 1), f"{c.score:.4f}", f"{c.cumulative_logprob:.3f}",
                      c.finish_reason or "", c.text.strip().replace("\n", " "))
    console.print(table)
