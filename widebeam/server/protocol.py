"""The OpenAI-compatible wire format: request and response models, and the translation of a request
into engine parameters. Every mistake in a request becomes an `ApiError` naming the field.

Beam search rides on the OpenAI fields: `use_beam_search: true`, `n` beams returned, `best_of` or
`beam_width` beams searched (default `n`), `length_penalty`, `early_stopping`, `stop`,
`stop_token_ids`, `min_tokens`, `max_tokens`. Each beam choice carries its `beam_score`.

Generative retrieval (catalogue-constrained beams) adds `catalogue` (the name of one the server
registered, `widebeam serve --catalogue NAME=PATH`) or an inline `allowed_sequences` (token-id lists,
at most `MAX_INLINE_ITEMS` items of at most `MAX_INLINE_ITEM_TOKENS` tokens), both only with
`use_beam_search`: every returned choice is then one item (its text), and `max_tokens` defaults to
the longest item plus its end-of-sequence token.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from widebeam.errors import InvalidParameterError, RequestTooLargeError
from widebeam.outputs import CompletionOutput, RequestOutput
from widebeam.params import MAX_LOGPROBS, BeamSearchParams, SamplingParams

# Sampled requests with n > 1 become n engine requests; a bound keeps one call from flooding the queue.
MAX_ENGINE_REQUESTS_PER_CALL = 128
KV_CAPACITY_CODE = "kv_cache_capacity_exceeded"
# Inline catalogues are built per request: a bound on their size (a large one belongs at start-up).
MAX_INLINE_ITEMS = 10_000
MAX_INLINE_ITEM_TOKENS = 64
MAX_TOKEN_ID = 2**31 - 1
CATALOGUE_FIELDS = ("catalogue", "allowed_sequences")


log = logging.getLogger("widebeam.server")

class ApiError(Exception):
    """An error answered as an OpenAI error object: {"error": {message, type, param, code}}."""

    def __init__(self, status_code: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.type = type

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def invalid(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param)


# -- requests --------------------------------------------------------------------------------------
_STRICT = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class _GenerationFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = _STRICT

    model: str | None = Field(None, description="the served model name (see /v1/models); optional")
    temperature: float | None = Field(None, ge=0, description="0 is greedy; default 1 (sampling)")
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, description="0 or -1: off")
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1, description="choice i uses seed + i")
    n: int = Field(1, ge=1, description="choices per prompt; with beam search, the beams returned")
    best_of: int | None = Field(None, ge=1, description="beam search: beams searched; sampling: samples "
                                                        "drawn, the n most likely returned")
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    use_beam_search: bool = False
    beam_width: int | None = Field(None, ge=1, description="beams searched (same as best_of); default n")
    length_penalty: float | None = Field(None, description="beam search only; default 1.0")
    early_stopping: bool | Literal["never"] | None = Field(None,
                                                           description="beam search only; default false")
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    catalogue: str | None = Field(None, description="beam search only: constrain every beam to the items of "
                                                    "this registered catalogue (widebeam serve --catalogue "
                                                    "NAME=PATH); each choice is one item")
    allowed_sequences: list[list[int]] | None = Field(
        None,
        description=f"beam search only: an inline catalogue, token-id lists (at most {MAX_INLINE_ITEMS} "
                    f"items of at most {MAX_INLINE_ITEM_TOKENS} tokens); excludes `catalogue`")
    # Penalties (OpenAI's presence/frequency in [-2, 2]; transformers/vLLM's repetition_penalty > 0).
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    # Structured output: {"type": "text" | "json_object" | "json_schema",
    #                     "json_schema": {name, schema, strict}}
    response_format: dict | None = None
    # vLLM's extension: each prompt token's log-prob and its `prompt_logprobs` most likely alternatives
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # OpenAI fields accepted only at their neutral values.
    logit_bias: dict[str, float] | None = None
    # Bookkeeping a real client sends that changes nothing here: accepted, logged at debug, ignored.
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None
    # Function calling cannot be honoured: `tools` is a 400 naming it whenever given; `tool_choice`
    # unless "none".
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None


class CompletionRequest(_GenerationFields):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        ..., description="text, token ids, or a batch of either")
    max_tokens: int | None = Field(16, ge=1, description="null: up to the engine's max_seq_len")
    echo: bool = Field(False, description="the prompt before each choice's text (and its tokens' log-probs)")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS,
                                 description="each token's log-prob and its `logprobs` most likely "
                                             "alternatives")
    suffix: str | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_GenerationFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="null: up to the engine's max_seq_len")
    max_completion_tokens: int | None = Field(None, ge=1, description="same as max_tokens")
    logprobs: bool | None = Field(None, description="each generated token's log-prob")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS,
                                     description="with logprobs: the most likely alternatives per token")


# -- responses (documented in the OpenAPI schema; the handlers write plain dicts) ------------------
class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None
    logprobs: dict | None = Field(None, description="tokens, token_logprobs, top_logprobs, text_offset")
    beam_score: float | None = Field(None, description="beam search only: the length-penalised score")


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: dict | None = Field(None, description="content: [{token, logprob, bytes, top_logprobs}]")
    beam_score: float | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "widebeam"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# -- request -> engine parameters ------------------------------------------------------------------
@dataclass
class Plan:
    """What one API call asks of the engine: `params[i]` for each engine request of each prompt;
    beam search has one engine request per prompt, sampling `num_samples` (n, or best_of)."""

    params: list[SamplingParams | BeamSearchParams]
    beam: bool
    n: int  # choices returned per prompt
    width_field: str  # the field the beam width came from, for error messages
    num_top_logprobs: int | None = None  # alternatives per token in the response; None: no logprobs
    echo: bool = False  # completions: the prompt (and its log-probs) before each choice
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs in the response

    @property
    def requests_per_prompt(self) -> int:
        return len(self.params)


def _given(req: BaseModel, name: str) -> bool:
    return name in req.model_fields_set and getattr(req, name) is not None


IGNORED_FIELDS = ("user", "store", "metadata", "service_tier", "parallel_tool_calls")


def _check_unsupported(req: _GenerationFields) -> None:
    ignored = [name for name in IGNORED_FIELDS if _given(req, name)]
    if ignored:
        log.debug("ignored request fields that change nothing here: %s", ", ".join(ignored))
    if req.tools is not None:
        raise invalid("tools", "tools (function calling) is not supported by this server")
    if req.tool_choice not in (None, "none"):
        raise invalid("tool_choice", f"tool_choice is not supported by this server (got {req.tool_choice!r})")
    neutral = {"logit_bias": ({},), "suffix": ("",)}
    for name, allowed in neutral.items():
        value = getattr(req, name, None)
        if value is not None and value not in allowed:
            raise invalid(name, f"{name} is not supported by this server (got {value!r})")


def max_tokens_field(req: _GenerationFields) -> tuple[str, int | None]:
    if isinstance(req, ChatCompletionRequest) and _given(req, "max_completion_tokens"):
        if _given(req, "max_tokens") and req.max_tokens != req.max_completion_tokens:
            raise invalid("max_completion_tokens", "max_tokens and max_completion_tokens differ; give one")
        return "max_completion_tokens", req.max_completion_tokens
    return "max_tokens", req.max_tokens


def _penalties(req: _GenerationFields) -> dict:
    """The penalty parameters of both engine param classes; absent fields are off."""
    return {"presence_penalty": req.presence_penalty or 0.0,
            "frequency_penalty": req.frequency_penalty or 0.0,
            "repetition_penalty": 1.0 if req.repetition_penalty is None else req.repetition_penalty}


def _logprobs_fields(req: _GenerationFields) -> tuple[int | None, int | None]:
    """(alternatives per generated token, per prompt token) the engine computes; None: off.
    Completions `logprobs: k`; chat `logprobs: true` with `top_logprobs: k` (0 without it); `echo` with
    `logprobs` asks for the prompt's too; vLLM's `prompt_logprobs: k` on either."""
    prompt = req.prompt_logprobs
    if isinstance(req, ChatCompletionRequest):
        if _given(req, "top_logprobs") and not req.logprobs:
            raise invalid("top_logprobs", "top_logprobs needs logprobs: true")
        return (req.top_logprobs or 0) if req.logprobs else None, prompt
    if req.echo and req.logprobs is not None:
        prompt = max(prompt or 0, req.logprobs)
    return req.logprobs, prompt


def plan_request(req: _GenerationFields) -> Plan:
    """Translate the request into engine parameters, or raise ApiError naming the bad field."""
    _check_unsupported(req)
    num_top, num_prompt_top = _logprobs_fields(req)
    max_tokens_name, max_tokens = max_tokens_field(req)
    stop = tuple([req.stop] if isinstance(req.stop, str) else (req.stop or ()))
    stop_token_ids = tuple(req.stop_token_ids or ())
    if _given(req, "stream_options") and not req.stream:
        raise invalid("stream_options", "stream_options needs stream: true")
    extra = {"logprobs": num_top, "prompt_logprobs": num_prompt_top, "response_format": req.response_format}
    if req.use_beam_search:
        plan = _beam_plan(req, max_tokens, stop, stop_token_ids, max_tokens_name, extra)
    else:
        plan = _sampling_plan(req, max_tokens, stop, stop_token_ids, max_tokens_name, extra)
    plan.num_top_logprobs, plan.echo = num_top, bool(getattr(req, "echo", False))
    plan.prompt_logprobs = req.prompt_logprobs
    return plan


def _sampling_plan(req, max_tokens, stop, stop_token_ids, max_tokens_name: str, extra: dict) -> Plan:
    """n (or best_of) engine requests per prompt; the prompt's log-probs only in the first one."""
    for name in CATALOGUE_FIELDS:
        if _given(req, name):
            raise invalid(name, f"{name} constrains beam search: add use_beam_search: true")
    for name in ("beam_width", "length_penalty", "early_stopping"):
        if _given(req, name):
            raise invalid(name, f"{name} applies only to beam search: add use_beam_search: true")
    num_samples = req.best_of if _given(req, "best_of") else req.n
    if num_samples < req.n:
        raise invalid("best_of", f"best_of ({num_samples}) must be >= n ({req.n})")
    if num_samples > MAX_ENGINE_REQUESTS_PER_CALL:
        name = "best_of" if _given(req, "best_of") else "n"
        raise invalid(name,
                      f"{name} must be <= {MAX_ENGINE_REQUESTS_PER_CALL} for sampling, got {num_samples}")
    if req.stream and num_samples != req.n:
        raise invalid("best_of", "best_of > n cannot be streamed")
    temperature = 1.0 if req.temperature is None else req.temperature  # the engine treats ~0 as greedy
    params = []
    for i in range(num_samples):
        seed = None if req.seed is None else req.seed + i
        params.append(_engine_params(
            SamplingParams, max_new_tokens=max_tokens, temperature=temperature,
            top_k=0 if req.top_k is None else req.top_k, top_p=1.0 if req.top_p is None else req.top_p,
            seed=seed, stop=stop, stop_token_ids=stop_token_ids, ignore_eos=req.ignore_eos,
            min_new_tokens=req.min_tokens, _max_tokens_name=max_tokens_name, **_penalties(req),
            **{**extra, "prompt_logprobs": extra["prompt_logprobs"] if i == 0 else None}))
    return Plan(params, beam=False, n=req.n, width_field="n")


def _beam_plan(req, max_tokens, stop, stop_token_ids, max_tokens_name: str, extra: dict) -> Plan:
    if req.temperature is not None and req.temperature > 0:
        raise invalid("temperature", f"beam search is deterministic: temperature must be 0 or absent, "
                                     f"got {req.temperature}")
    if req.top_p is not None and req.top_p != 1:
        raise invalid("top_p", f"beam search does not sample: top_p must be 1 or absent, got {req.top_p}")
    if req.top_k is not None and req.top_k not in (0, -1):
        raise invalid("top_k", f"beam search does not sample: top_k must be 0, -1 or absent, got {req.top_k}")
    if _given(req, "best_of") and _given(req, "beam_width") and req.best_of != req.beam_width:
        raise invalid("beam_width",
                      f"best_of ({req.best_of}) and beam_width ({req.beam_width}) differ; give one")
    width_field = "beam_width" if _given(req, "beam_width") else "best_of" if _given(req, "best_of") else "n"
    width = getattr(req, width_field)
    if req.n > width:
        raise invalid("n", f"n ({req.n}) must be <= the beams searched ({width_field}={width})")
    allowed_sequences = _inline_catalogue(req.allowed_sequences)
    if ((_given(req, "catalogue") or allowed_sequences is not None)
            and max_tokens_name not in req.model_fields_set):
        # the engine's default with a catalogue: its longest item and the end-of-sequence token
        max_tokens = None
    params = _engine_params(
        BeamSearchParams, beam_width=width, max_new_tokens=max_tokens,
        length_penalty=1.0 if req.length_penalty is None else req.length_penalty,
        early_stopping=False if req.early_stopping is None else req.early_stopping,
        num_return_sequences=req.n, min_new_tokens=req.min_tokens, stop_token_ids=stop_token_ids, stop=stop,
        ignore_eos=req.ignore_eos, catalogue=req.catalogue, allowed_sequences=allowed_sequences,
        _width_field=width_field, _max_tokens_name=max_tokens_name, **_penalties(req), **extra)
    return Plan([params], beam=True, n=req.n, width_field=width_field)


def _inline_catalogue(items: list[list[int]] | None) -> list[list[int]] | None:
    """`allowed_sequences` within the caps; the engine checks the rest (empty items, the vocabulary)."""
    if items is None:
        return None
    if len(items) > MAX_INLINE_ITEMS:
        raise invalid("allowed_sequences", f"allowed_sequences holds {len(items)} items; at most "
                                           f"{MAX_INLINE_ITEMS} are taken inline (register a larger "
                                           "catalogue at start-up: widebeam serve --catalogue NAME=PATH)")
    for i, item in enumerate(items):
        if len(item) > MAX_INLINE_ITEM_TOKENS:
            raise invalid("allowed_sequences",
                          f"allowed_sequences[{i}] has {len(item)} tokens; an item has at "
                          f"most {MAX_INLINE_ITEM_TOKENS}")
        for token in item:
            if not 0 <= token <= MAX_TOKEN_ID:
                raise invalid("allowed_sequences",
                              f"allowed_sequences[{i}] holds {token}: token ids are >= 0 "
                              "and within the model's vocabulary")
    return items


def api_names(*, width_field: str = "n", prompt_field: str = "prompt",
              max_tokens_name: str = "max_tokens") -> dict[str, str]:
    """Engine parameter names -> the request's: `beam_width` is whichever of n, best_of and beam_width
    set it, `max_new_tokens` whichever of max_tokens and max_completion_tokens was given."""
    return {"max_new_tokens": max_tokens_name, "min_new_tokens": "min_tokens", "num_return_sequences": "n",
            "beam_width": width_field, "prompt": prompt_field}


def _engine_params(cls, _width_field: str = "n", _max_tokens_name: str = "max_tokens", **kwargs):
    try:
        return cls(**kwargs)
    except InvalidParameterError as exc:
        raise engine_error(exc, width_field=_width_field, max_tokens_name=_max_tokens_name) from None


def engine_error(exc: ValueError, *, width_field: str = "n", prompt_field: str = "prompt",
                 max_tokens_name: str = "max_tokens") -> ApiError:
    """An engine admission error as the API answers it: an `InvalidParameterError`'s message rendered
    with the request's own field names, and its `param` renamed the same way. A request that can never
    fit the KV cache keeps the engine's message word for word (`code: kv_cache_capacity_exceeded`), the
    same text the Python API raises."""
    if isinstance(exc, RequestTooLargeError):
        return ApiError(400, str(exc), code=KV_CAPACITY_CODE)
    names = api_names(width_field=width_field, prompt_field=prompt_field, max_tokens_name=max_tokens_name)
    param = getattr(exc, "param", None)
    message = exc.render(names) if isinstance(exc, InvalidParameterError) else str(exc)
    return ApiError(400, message, param=names.get(param, param))


def choices_of(outs: list[RequestOutput], plan: Plan) -> list[CompletionOutput]:
    if plan.beam:
        return outs[0].outputs[:plan.n]
    samples = [out.outputs[0] for out in outs]
    if len(samples) > plan.n:  # best_of: the n most likely samples
        samples = sorted(samples, key=lambda c: c.cumulative_logprob, reverse=True)[:plan.n]
    return samples


def completion_prompts(req: CompletionRequest) -> list:
    prompt = req.prompt
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise invalid("prompt", "prompt is empty: give text, token ids, or a non-empty batch")
    if isinstance(prompt[0], int):
        return [{"prompt_token_ids": list(prompt)}]
    if isinstance(prompt[0], list):
        return [{"prompt_token_ids": list(ids)} for ids in prompt]
    return list(prompt)


def chat_prompts(tokenizer, req: ChatCompletionRequest) -> list[str]:
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise invalid("messages", "this model has no chat template: use /v1/completions")
    messages = []
    for message in req.messages:
        content = message.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        role = "system" if message.role == "developer" else message.role
        messages.append({"role": role, "content": content or ""})
    try:
        return [tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)]
    except Exception as exc:  # noqa: BLE001  (a template is code: it may refuse a conversation any way it likes)
        raise invalid("messages", f"the chat template cannot render these messages: {exc}") from None


# -- responses -------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; `cached_tokens`: prompt tokens taken from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def choice(chat: bool, index: int, text: str, finish_reason: str | None, beam_score: float | None) -> dict:
    """One choice of a whole response."""
    message = ({"message": {"role": "assistant", "content": text}} if chat
               else {"text": text, "logprobs": None})
    return _choice(index, message, finish_reason, beam_score)


def chunk_choice(chat: bool, index: int, text: str, finish_reason: str | None,
                 beam_score: float | None = None, first: bool = False) -> dict:
    """One choice of a streamed chunk: chat sends a delta (the role only in the first one)."""
    if chat:
        message = {"delta": {"role": "assistant", "content": text} if first else {"content": text}}
    else:
        message = {"text": text, "logprobs": None}
    return _choice(index, message, finish_reason, beam_score)


def _choice(index: int, message: dict, finish_reason: str | None, beam_score: float | None) -> dict:
    out: dict[str, Any] = {"index": index, **message, "finish_reason": finish_reason}
    if beam_score is not None:
        out["beam_score"] = beam_score
    return out
