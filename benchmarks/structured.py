"""Structured output's cost (#20): the same chat prompts with and without a JSON schema
(`response_format`), SmolLM2-135M-Instruct, greedy (W=1) and beam search at W=4 and 16, in one
process, interleaved repeats. The grammar's own time is timed inside the run (GrammarConstraint's
`__call__`: one xgrammar matcher per live beam fills its row of the token bitmask, applied to the
scores; and `reorder`: the beams' matchers forked and advanced), per decoder step and as a share of
the run's wall time, so host load on the model does not blur it. Also: wall seconds with and without
the format (outputs differ in length, so only indicative) and the share of returned beams whose text
parses and validates against the schema.

    python benchmarks/structured.py [--widths 1 4 16] [--max-new-tokens 48] [--repeats 2] [--out PATH]

Writes benchmarks/results/structured.json by default.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jsonschema
import torch

from widebeam.llm import LLM
from widebeam.params import BeamSearchParams, SamplingParams
from widebeam.structured.constraint import GrammarConstraint


class GrammarTimer:
    """Accumulates the wall time of GrammarConstraint's per-step methods (a wrapper per method)."""

    def __init__(self):
        self.seconds, self.num_calls = 0.0, 0
        # `process` where this revision has it (it follows the step context's moves itself: the
        # matchers' forks and accepts are timed inside it); `__call__` and `reorder` before
        call = "process" if hasattr(GrammarConstraint, "process") else "__call__"
        for name in (call, *(() if hasattr(GrammarConstraint, "move") else ("reorder",))):
            setattr(GrammarConstraint, name, self._timed(getattr(GrammarConstraint, name), name == call))

    def _timed(self, method, counts_step: bool):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.num_calls += counts_step
        return timed

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "colours"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "colours": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                     "maxItems": 3}}}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
QUESTIONS = ["Describe a person as JSON: name, age and favourite colours.",
             "Invent a character. Answer in JSON with name, age and colours.",
             "Give me a JSON record of a customer: name, age, colours they like."]


def valid(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def run(llm: LLM, prompts: list[str], width: int, max_new_tokens: int, fmt) -> tuple[float, int, list[str]]:
    """Wall seconds, decoder steps (the longest output per prompt, summed) and every returned text."""
    if width == 1:
        params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, response_format=fmt)
    else:
        params = BeamSearchParams(beam_width=width, max_new_tokens=max_new_tokens, response_format=fmt)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    steps = sum(max(len(c.token_ids) for c in o.outputs) for o in outputs)
    return seconds, steps, [c.text for o in outputs for c in o.outputs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "structured.json"))
    args = parser.parse_args()
    llm = LLM("smollm2-135m-instruct", kv_cache_memory="512MiB", max_beam_width=max(args.widths),
              enable_prefix_caching=False)  # every run computes its prompts
    prompts = [llm.engine.apply_chat_template(q) for q in QUESTIONS]
    run(llm, prompts[:1], 1, 4, FORMAT)  # warm-up: the grammar compiler and the model
    timer = GrammarTimer()
    rows = []
    for width in args.widths:
        wall = {"free": [], "json": []}
        grammar_ms, grammar_share = [], []
        texts = {}
        for _ in range(args.repeats):  # interleaved: host load drifts alike for both
            for name, fmt in (("free", None), ("json", FORMAT)):
                timer.seconds, timer.num_calls = 0.0, 0
                seconds, _, texts[name] = run(llm, prompts, width, args.max_new_tokens, fmt)
                wall[name].append(seconds)
                if fmt is not None:
                    grammar_ms.append(timer.seconds / timer.num_calls * 1e3)
                    grammar_share.append(timer.seconds / seconds)
        row = {"width": width, "grammar_ms_per_step": round(statistics.median(grammar_ms), 3),
               "grammar_share_of_wall": round(statistics.median(grammar_share), 4),
               "free_wall_s": round(statistics.median(wall["free"]), 2),
               "json_wall_s": round(statistics.median(wall["json"]), 2),
               "valid_json": f"{sum(map(valid, texts['json']))}/{len(texts['json'])}",
               "valid_free": f"{sum(map(valid, texts['free']))}/{len(texts['free'])}"}
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"model": "smollm2-135m-instruct", "threads": torch.get_num_threads(), "prompts": len(prompts),
              "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
