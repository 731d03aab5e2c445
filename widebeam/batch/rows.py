"""One input row of a batch job: its id, its prompt, its parameters, or what is wrong with it.

A row holds `prompt` (text), `messages` (a chat, rendered with the model's template) or
`prompt_token_ids`, an optional `id` (else its position in the input, `row-N`, stable across
reruns), and any parameter of `SamplingParams` / `BeamSearchParams` by its field name (a
`beam_width` above 1, or `use_beam_search`, makes it a beam-search row). The job's defaults fill the
rest. A malformed row becomes a `BatchRow` with `error` set: it is written out with that error, it
never stops the job. The error names the row (its position in the input, from 0) and, when one cell is
at fault, its column: `row 3, column beam_width: ...`.

A scoring job (`widebeam batch --score`: the job's defaults hold `score: true`) reads pairs instead: each
row holds its prompt and a `continuation` (text or token ids) or a list of `continuations`, and
optionally `decoder_prefix` and `max_input_length`; its record holds one output per continuation with
each token's log-prob (`token_logprobs`) and their sum (`score`). Rows with the same prompt share its
computed blocks through the prefix cache; the continuations of one row fork from it as beams do.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from widebeam.errors import InvalidParameterError
from widebeam.params import BeamSearchParams, SamplingParams
from widebeam.score_params import ScoreParams

PROMPT_FIELDS = ("prompt", "messages", "prompt_token_ids")
SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}
BEAM_FIELDS = {f.name for f in dataclasses.fields(BeamSearchParams)}
# Fields a CSV cell carries as JSON text (a list or an object), parsed before validation.
INTEGER_FIELDS = {"seed", "max_new_tokens", "top_k", "beam_width", "min_new_tokens", "num_return_sequences",
                  "forced_bos_token_id", "no_repeat_ngram_size", "max_input_length"}
JSON_FIELDS = {"messages", "prompt_token_ids", "stop", "stop_token_ids", "allowed_sequences", "bad_words_ids",
               "continuations", "decoder_prefix"}
WIDTH_FIELDS = ("beam_width", "beam_width_schedule")
SCORE_MODE = "score"  # the defaults' key of a scoring job
SCORE_FIELDS = {"continuation", "continuations", "decoder_prefix", "max_input_length"}


@dataclass
class BatchRow:
    """A parsed row: `prompt` is text, a list of token ids, or a chat (`messages`)."""

    row_id: str
    prompt: Any = None
    params: SamplingParams | BeamSearchParams | None = None
    error: str | None = None
    extra: dict = field(default_factory=dict)


def row_id(raw: Mapping, index: int) -> str:
    value = raw.get("id") if isinstance(raw, Mapping) else None
    return f"row-{index}" if value is None or value == "" else str(value)


def parse_row(raw: Any, index: int, defaults: Mapping[str, Any]) -> BatchRow:
    """Validate one input row against the job's `defaults` (parameter name -> value)."""
    if not isinstance(raw, Mapping):
        return BatchRow(f"row-{index}", error=f"row {index} is not an object: {raw!r}"[:300])
    rid = row_id(raw, index)
    try:
        values = {k: _cell(k, v) for k, v in raw.items() if not _missing(v) and k != "id"}
        given = [name for name in PROMPT_FIELDS if name in values]
        if len(given) != 1:
            raise ValueError(f"give exactly one of {', '.join(PROMPT_FIELDS)} (got "
                             f"{', '.join(given) or 'none'})")
        prompt = values.pop(given[0])
        if given[0] == "messages":
            if not isinstance(prompt, list) or not all(isinstance(m, Mapping) for m in prompt):
                raise InvalidParameterError("messages",
                                            "messages must be a list of {{role, content}} objects")
            prompt = {"messages": prompt}
        elif given[0] == "prompt_token_ids":
            prompt = {"prompt_token_ids": prompt}
        elif not isinstance(prompt, str):
            raise InvalidParameterError("prompt", f"prompt must be text, got {type(prompt).__name__}")
        if defaults.get(SCORE_MODE):
            return BatchRow(rid, prompt, score_params(values, defaults))
        return BatchRow(rid, prompt, make_params(values, defaults))
    except InvalidParameterError as exc:  # one cell is at fault: its column is the parameter's name
        return BatchRow(rid, error=f"row {index}, column {exc.param}: {type(exc).__name__}: {exc}")
    except (ValueError, TypeError) as exc:
        return BatchRow(rid, error=f"row {index}: {type(exc).__name__}: {exc}")


def make_params(values: Mapping[str, Any], defaults: Mapping[str, Any] | None = None
                ) -> SamplingParams | BeamSearchParams:
    """`BeamSearchParams` when `use_beam_search`, a `beam_width` above 1 or a `beam_width_schedule`
    (the row's, else the defaults'), else `SamplingParams`. The defaults fill the fields of that kind
    the row leaves out (a default `temperature` does not reach a beam row); a row field the kind
    lacks is an error naming it."""
    defaults = dict(defaults or {})
    values = dict(values)
    use_beams = values.pop("use_beam_search", defaults.pop("use_beam_search", None))
    if use_beams is not None and not isinstance(use_beams, bool):
        raise InvalidParameterError("use_beam_search", "use_beam_search must be true or false, got {value!r}",
                                    value=use_beams)
    if any(name in values for name in WIDTH_FIELDS):
        # the row's width, fixed or scheduled, overrides the job's: a default of the other kind beside
        # it would read as given and disagree with it
        defaults = {k: v for k, v in defaults.items() if k not in WIDTH_FIELDS}
    width = values.get("beam_width", defaults.get("beam_width", 1))
    if isinstance(width, float) and width.is_integer():
        width = int(width)
    if width is not None and (isinstance(width, bool) or not isinstance(width, int)):
        raise InvalidParameterError("beam_width", "beam_width must be an integer >= 1, got {value!r}",
                                    value=width)
    schedule = values.get("beam_width_schedule", defaults.get("beam_width_schedule"))
    beams = use_beams if use_beams is not None else ((width or 1) > 1 or schedule is not None)
    known = BEAM_FIELDS if beams else SAMPLING_FIELDS
    values = {**{k: v for k, v in defaults.items() if k in known}, **values}
    unknown = sorted(set(values) - known)
    if not beams:
        values.pop("beam_width", None)
        unknown = [k for k in unknown if k != "beam_width"]
    if unknown:
        kind = "beam search" if beams else "sampling"
        raise ValueError(f"unknown field(s) for {kind}: {', '.join(unknown)}")
    for name in INTEGER_FIELDS & set(values):
        # a table column with gaps holds floats (pandas): 3.0 means 3
        if isinstance(values[name], float) and values[name].is_integer():
            values[name] = int(values[name])
    if isinstance(values.get("beam_width_schedule"), str):  # a table cell: "64,256,1024"
        try:
            values["beam_width_schedule"] = [int(w) for w in values["beam_width_schedule"].split(",")]
        except ValueError:
            raise InvalidParameterError("beam_width_schedule", "beam_width_schedule must be comma-separated "
                                        "integer widths, got {value!r}",
                                        value=values["beam_width_schedule"]) from None
    for name in ("stop", "stop_token_ids"):
        if isinstance(values.get(name), str) and name == "stop":
            values[name] = (values[name],)
        if isinstance(values.get(name), list):
            values[name] = tuple(values[name])
    return BeamSearchParams(**values) if beams else SamplingParams(**values)


def score_params(values: Mapping[str, Any], defaults: Mapping[str, Any]) -> ScoreParams:
    """A scoring row's params: its `continuation` or `continuations`, the job's defaults for the rest."""
    values = {**{k: v for k, v in defaults.items() if k in SCORE_FIELDS}, **values}
    unknown = sorted(set(values) - SCORE_FIELDS)
    if unknown:
        raise ValueError(f"unknown field(s) for scoring: {', '.join(unknown)}")
    given = [name for name in ("continuation", "continuations") if name in values]
    if len(given) != 1:
        raise ValueError("give exactly one of continuation, continuations (got "
                         f"{', '.join(given) or 'none'})")
    continuations = values.pop(given[0])
    if given[0] == "continuation":
        continuations = [continuations]
    if isinstance(values.get("max_input_length"), float) and values["max_input_length"].is_integer():
        values["max_input_length"] = int(values["max_input_length"])
    return ScoreParams(continuations, **values)


def _missing(value: Any) -> bool:
    """An empty cell: None, empty text, or NaN (a gap in a Parquet or pandas column)."""
    return (value is None or (isinstance(value, str) and value == "")
            or (isinstance(value, float) and math.isnan(value)))


def _cell(name: str, value: Any) -> Any:
    """CSV cells arrive as text: a JSON value (a number, a boolean, a list, an object) is parsed,
    other text stays text. Prompts are always text."""
    if hasattr(value, "tolist"):  # numpy arrays and scalars from Parquet
        return value.tolist()
    if name in ("prompt", "continuation") and isinstance(value, str) and not value.lstrip().startswith("["):
        return value  # text, even when it reads as a number
    if name == "prompt" or not isinstance(value, str):
        return value
    text = value.strip()
    try:
        parsed = json.loads(text)
    except ValueError:
        if name in JSON_FIELDS and text[:1] in ("[", "{"):
            raise InvalidParameterError(name, name + " is not valid JSON: {value!r}",
                                        value=text[:80]) from None
        return value
    return parsed if not isinstance(parsed, str) else value
