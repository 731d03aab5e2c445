"""The OpenAI-compatible wire format: the request and response models (pydantic), the error object
(`ApiError`: every mistake in a request becomes one naming the field), and the response dicts the
handlers write. Turning a request into engine parameters is protocol.py's.

Beam search rides on the OpenAI fields: `use_beam_search: true`, `n` beams returned, `best_of` or
`beam_width` beams searched (default `n`), `length_penalty`, `early_stopping`, `stop`,
`stop_token_ids`, `min_tokens`, `max_tokens`. Each beam choice carries its `beam_score`.
`beam_width_schedule` (a list of per-step widths, the last repeating) replaces a fixed width; `n`
beams come from its last width. `num_beam_groups` with `diversity_penalty`: diverse beam search.

Generative retrieval (catalogue-constrained beams) adds `catalogue` (the name of one the server
registered, `widebeam serve --catalogue NAME=PATH`) or an inline `allowed_sequences` (token-id lists,
at most `MAX_INLINE_ITEMS` items of at most `MAX_INLINE_ITEM_TOKENS` tokens), both only with
`use_beam_search`: every returned choice is then one item (its text), and `max_tokens` defaults to
the longest item plus its end-of-sequence token. A `max_tokens` below the shortest item plus its EOS,
a `min_tokens` past the longest item, or any `stop` / `stop_token_ids` is a 400 naming the field.
Per-request item filters over a catalogue: `catalogue_subset` (a subset registered beside it),
`allowed_items` / `excluded_items` (item indices); no returned item lies outside them.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from widebeam.params import MAX_LOGPROBS

# Inline catalogues are built per request: a bound on their size (a large one belongs at start-up).
MAX_INLINE_ITEMS = 10_000
MAX_INLINE_ITEM_TOKENS = 64


class ApiError(Exception):
    """An error answered as an OpenAI error object: {"error": {message, type, param, code}}."""

    def __init__(self, status_code: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.type = type
        self.headers = headers  # e.g. a 429's Retry-After

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
    beam_width_schedule: list[int] | None = Field(
        None, description="beam search only: the width of each step ([64, 256, 1024]: step 1 keeps 64 "
                          "beams, step 2 256, then 1024; the last repeats); n <= its last width")
    length_penalty: float | None = Field(None, description="beam search only; default 1.0")
    early_stopping: bool | Literal["never"] | None = Field(None,
                                                           description="beam search only; default false")
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    priority: int = Field(0, description="scheduling priority, vLLM's: lower is served first (ties in "
                                         "arrival order); changes when a request runs, never its output")
    catalogue: str | None = Field(None, description="beam search only: constrain every beam to the items of "
                                                    "this registered catalogue (widebeam serve --catalogue "
                                                    "NAME=PATH); each choice is one item")
    num_beam_groups: int | None = Field(None, ge=1, description="beam search only: diverse beam search over "
                                                                "this many groups (divides the beams)")
    diversity_penalty: float | None = Field(None, ge=0, description="beam search with num_beam_groups > 1: "
                                                                    "the Hamming diversity penalty")
    catalogue_subset: str | None = Field(None, description="beam search with `catalogue` only: return only "
                                                           "items of this subset registered beside it")
    allowed_items: list[int] | None = Field(None, description="beam search with a catalogue only: the only "
                                                              "item indices that may come back")
    excluded_items: list[int] | None = Field(None, description="beam search with a catalogue only: item "
                                                               "indices that never come back")
    allowed_sequences: list[list[int]] | None = Field(
        None,
        description=f"beam search only: an inline catalogue, token-id lists (at most {MAX_INLINE_ITEMS} "
                    f"items of at most {MAX_INLINE_ITEM_TOKENS} tokens); excludes `catalogue`")
    # Penalties (OpenAI's presence/frequency in [-2, 2]; transformers/vLLM's repetition_penalty, here
    # in [0.01, 100] where float32 stays finite: params.py checks both and names the field).
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    # Structured output: {"type": "text" | "json_object" | "json_schema",
    #                     "json_schema": {name, schema, strict}}
    response_format: dict | None = None
    # Encoder-decoder models (translation): the decoder starts from these tokens after its start token
    # (NLLB's target language code, a forced partial translation); text is tokenized without special
    # tokens; a decoder-only model refuses it but as a soft prefix (prefix_bias_beta).
    # `forced_bos_token_id`: the first generated token (HF's; only without a decoder_prefix).
    decoder_prefix: str | list[int] | None = None
    forced_bos_token_id: int | None = Field(None, ge=0)
    # widebeam's extension: the beam search tree (widebeam/beam/tree.py, docs/ui.md) in the response's
    # `search_trees` (one per prompt), or in a stream's closing event of each prompt as `search_tree`
    return_tree: bool = Field(False, description="beam search only: return the search tree (every "
                                                 "candidate each step kept) in `search_trees`")
    # Decoding options translation users set (docs/decoding-options.md): transformers' n-gram and
    # multi-token bans, CTranslate2's prompt truncation and (beam search only) patience.
    no_repeat_ngram_size: int | None = Field(None, ge=0, description="no n-gram of this size twice; 0: off")
    bad_words_ids: list[list[int]] | None = Field(None, description="token sequences never generated")
    max_input_length: int | None = Field(None, ge=1, description="truncate the prompt to this many tokens "
                                                                 "instead of refusing it")
    patience: float | None = Field(None, ge=1, description="beam search only: stop once beam_width * "
                                                           "patience hypotheses finished (CTranslate2's)")
    prefix_bias_beta: float | None = Field(None, ge=0, lt=1, description="beam search only: the "
                                           "decoder_prefix becomes a soft bias (CTranslate2's); 0: off")
    return_alternatives: bool | None = Field(None, description="beam search only: the n best continuations "
                                             "differing at the first position after decoder_prefix")
    min_alternative_expansion_prob: float | None = Field(None, ge=0, le=1)
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
    echo: bool = Field(False, description="decoder-only models: the prompt used (its kept tokens with "
                                          "max_input_length) before each choice's text, and its log-probs")
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
