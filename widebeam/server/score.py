"""`POST /v1/score`: forced-decoding scores (widebeam/scoring.py) over HTTP.

Request: `prompt` (text or token ids, one for every continuation; or a list of them, one per
continuation), `continuations` (texts or token-id lists, mixed as `widebeam batch --score` takes them;
a text is tokenized without special tokens), and optionally `decoder_prefix` (encoder-decoder models)
and `max_input_length`. Caps: at most `MAX_SCORE_CONTINUATIONS` continuations, in at most
`MAX_ENGINE_REQUESTS_PER_CALL` engine requests (one per distinct prompt per `max_beam_width` of its
continuations); each refusal names `prompt` or `continuations` and states the cap. Response: one entry
per continuation, in order, with its token ids, each token's log-prob under the model's raw
log-softmax, and their sum (`logprob`). A prompt's continuations share its computation (it is
prefilled once; they fork from it as beams do).
"""

from __future__ import annotations

from typing import Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field

from widebeam.errors import InvalidParameterError
from widebeam.scoring import distinct_prompts, score_groups, score_outputs
from widebeam.server import protocol as p
from widebeam.server import schemas as s

MAX_SCORE_CONTINUATIONS = 10_000  # one call's continuations (each is a row of the engine's steps)


class ScoreRequest(BaseModel):
    model_config = s._STRICT

    model: str | None = None
    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        ..., description="one prompt for every continuation, or one per continuation")
    # texts and token-id lists, mixed as `widebeam batch --score` takes them (the same ScoreParams)
    continuations: list[str | list[int]] = Field(..., min_length=1, max_length=MAX_SCORE_CONTINUATIONS)
    decoder_prefix: str | list[int] | None = None
    max_input_length: int | None = Field(None, ge=1)


class ScoreEntry(BaseModel):
    index: int
    token_ids: list[int]
    token_logprobs: list[float]
    logprob: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["score"] = "score"
    created: int
    model: str
    data: list[ScoreEntry]
    usage: s.Usage


def _prompts(req: ScoreRequest):
    """One prompt, or one per continuation (a list of texts or of token-id lists)."""
    prompt = req.prompt
    if isinstance(prompt, str):
        return prompt
    if not prompt:
        raise s.invalid("prompt", "prompt is empty: give text or token ids")
    if isinstance(prompt[0], int):
        return {"prompt_token_ids": list(prompt)}
    if len(prompt) != len(req.continuations):
        raise s.invalid("prompt", f"a list of prompts gives one per continuation: {len(req.continuations)} "
                                  f"continuations, got {len(prompt)} prompts")
    return [{"prompt_token_ids": list(x)} if isinstance(x, list) else x for x in prompt]


def _too_many_requests(groups, max_beam_width: int) -> s.ApiError:
    """The real cap, stated: a call makes at most MAX_ENGINE_REQUESTS_PER_CALL engine requests, one per
    distinct prompt per `max_beam_width` of its continuations. Names `prompt` when the distinct prompts
    alone exceed it, else `continuations`."""
    cap = p.MAX_ENGINE_REQUESTS_PER_CALL
    num_prompts = distinct_prompts(groups)
    param = "prompt" if num_prompts > cap else "continuations"
    return s.invalid(param, f"these continuations need {len(groups)} engine requests ({num_prompts} "
                            f"distinct prompts; each takes one per {max_beam_width} of its continuations, "
                            f"the server's max_beam_width); a call makes at most {cap}: at most "
                            f"{cap * max_beam_width} continuations of one prompt, or {cap} distinct prompts. "
                            "Split the call")


def add_score_route(app, engine, loop, model_name: str, model_aliases: tuple[str, ...], collect,
                    error_responses: dict) -> None:
    """Add the route to `app` (api.py's `create_app`); `collect` waits for a group's final outputs."""

    @app.post("/v1/score", response_model=ScoreResponse, responses=error_responses)
    async def score(body: ScoreRequest, request: Request):
        if body.model is not None and body.model != model_name and body.model not in model_aliases:
            raise s.ApiError(404, f"model {body.model!r} is not served here; this server serves "
                                  f"{model_name!r}", param="model", code="model_not_found")
        try:
            groups = score_groups(_prompts(body), body.continuations, engine.max_beam_width,
                                  body.decoder_prefix or (), body.max_input_length)
        except InvalidParameterError as exc:
            raise p.engine_error(exc) from None
        if len(groups) > p.MAX_ENGINE_REQUESTS_PER_CALL:
            raise _too_many_requests(groups, engine.max_beam_width)
        call_id = s.new_id("score")
        request_ids = [f"{call_id}-{k}" for k in range(len(groups))]
        try:
            group = await loop.submit(request_ids, [(g.prompt, g.params) for g in groups], stream=False)
        except ValueError as exc:
            raise p.engine_error(exc) from None
        outputs = await collect(loop, group, request)
        if outputs is None:  # the client went away; its requests are aborted
            return Response(status_code=499)
        scores = score_outputs(groups, outputs)
        prompt_tokens = sum(len(out.prompt_token_ids) for out in outputs)
        scored_tokens = sum(len(x.token_ids) for x in scores)
        data = [{"index": i, "token_ids": x.token_ids, "token_logprobs": x.token_logprobs,
                 "logprob": x.logprob} for i, x in enumerate(scores)]
        cached = sum(out.num_cached_tokens for out in outputs)
        return JSONResponse({"id": call_id, "object": "score", "created": s.now(), "model": model_name,
                             "data": data, "usage": s.usage(prompt_tokens, scored_tokens, cached)})
