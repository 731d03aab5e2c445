"""A request's parameters against the engine's limits, checked before anything is queued: the engine
calls `check_request` for every request, and `widebeam plan` the part a plan has
(`check_width_schedule`). Each check names the parameter it refuses (`InvalidParameterError`)."""

from __future__ import annotations

from collections.abc import Container, Sequence

from widebeam.errors import InvalidParameterError
from widebeam.params import BeamSearchParams, SamplingParams
from widebeam.score_params import ScoreParams


def check_width_schedule(beam_width_schedule: Sequence[int], speculative: bool) -> None:
    """A beam-width schedule needs an engine without speculative decoding: a round may accept several
    tokens, each a step of its own width, which is not supported."""
    if beam_width_schedule and speculative:
        raise InvalidParameterError("beam_width_schedule", "{beam_width_schedule} needs an engine "
                                    "without speculative decoding")


def check_request(request_id: str, params, logits_processors: Sequence = (), *, ids_in_use: Container[str],
                  max_beam_width: int, speculative: bool, tokenizer=None,
                  vocab_size: int = 0) -> SamplingParams | BeamSearchParams | ScoreParams:
    """The request's params as the engine runs them (a `ScoreParams`' continuations as token ids:
    `tokenizer`, `vocab_size`), or raise naming what does not fit: a request id in use, params of
    another type, logits processors on a scoring request, a width over `max_beam_width`, a width
    schedule with speculative decoding."""
    if request_id in ids_in_use:
        raise InvalidParameterError("request_id", "{request_id} {value!r} is already in use",
                                    value=request_id)
    if not isinstance(params, (SamplingParams, BeamSearchParams, ScoreParams)):
        raise InvalidParameterError("params", "expected SamplingParams, BeamSearchParams or "
                                    "ScoreParams, got {value!r}", value=params)
    scoring = isinstance(params, ScoreParams)
    if scoring:
        params = params.tokenized(tokenizer, vocab_size)
    if scoring and logits_processors:
        raise InvalidParameterError("logits_processors", "scoring reads the model's raw log-probs: "
                                    "{logits_processors} cannot apply")
    if scoring and params.beam_width > max_beam_width:
        raise InvalidParameterError(
            "continuations", "{continuations} fork {value} rows at one position, more than the "
            "engine's max_beam_width ({limit}): score them in groups (LLM.score does)",
            value=params.beam_width, limit=max_beam_width)
    if params.beam_width > max_beam_width:
        raise InvalidParameterError(
            "beam_width", "{beam_width} must be in [1, {limit}] (the engine's max_beam_width), got {value}",
            limit=max_beam_width, value=params.beam_width)
    check_width_schedule(getattr(params, "beam_width_schedule", None) or (), speculative)
    return params
