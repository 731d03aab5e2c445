"""A request (server/schemas.py) as engine parameters, and the engine's answers back: `plan_request`
turns the request's fields into one `Plan` (the engine requests of each prompt), `engine_error` an
engine admission error into the `ApiError` the API answers, and `completion_prompts`/`chat_prompts`
and `choices_of` pick the prompts and the returned choices. Every mistake in a request becomes an
`ApiError` naming the field.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pydantic import BaseModel

from widebeam.errors import InvalidParameterError, RequestTooLargeError
from widebeam.outputs import CompletionOutput, RequestOutput
from widebeam.params import BeamSearchParams, SamplingParams
from widebeam.server.schemas import (
    MAX_INLINE_ITEM_TOKENS,
    MAX_INLINE_ITEMS,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    _GenerationFields,
    invalid,
)

# Sampled requests with n > 1 become n engine requests; a bound keeps one call from flooding the queue.
MAX_ENGINE_REQUESTS_PER_CALL = 128
KV_CAPACITY_CODE = "kv_cache_capacity_exceeded"
MAX_TOKEN_ID = 2**31 - 1
CATALOGUE_FIELDS = ("catalogue", "allowed_sequences", "catalogue_subset", "allowed_items", "excluded_items")


log = logging.getLogger("widebeam.server")


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
    def return_tree(self) -> bool:
        """Beam search asked for its search tree (`return_tree`)."""
        return self.beam and self.params[0].return_tree

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
    extra = {"logprobs": num_top, "prompt_logprobs": num_prompt_top, "response_format": req.response_format,
             "decoder_prefix": req.decoder_prefix or (), "forced_bos_token_id": req.forced_bos_token_id,
             "no_repeat_ngram_size": req.no_repeat_ngram_size or 0, "bad_words_ids": req.bad_words_ids or (),
             "max_input_length": req.max_input_length, "priority": req.priority}
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
    for name in ("beam_width", "beam_width_schedule", "length_penalty", "early_stopping", "num_beam_groups",
                 "diversity_penalty", "patience", "prefix_bias_beta", "return_alternatives",
                 "min_alternative_expansion_prob"):
        if _given(req, name):
            raise invalid(name, f"{name} applies only to beam search: add use_beam_search: true")
    if req.return_tree:  # a sample has no search tree
        raise invalid("return_tree", "return_tree applies only to beam search: add use_beam_search: true")
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
    schedule = req.beam_width_schedule
    if schedule is not None:
        # n beams come from the schedule's last width; a width field beside it must be its widest
        # step (BeamSearchParams says so, naming the field)
        width_field = "beam_width_schedule" if width_field == "n" else width_field
        # None: not given, so the schedule's widest step (never a default's value, which would read
        # as given and could disagree with the schedule)
        width = (req.beam_width if _given(req, "beam_width")
                 else req.best_of if _given(req, "best_of") else None)
    elif req.n > width:
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
        beam_width_schedule=schedule, catalogue_subset=req.catalogue_subset, allowed_items=req.allowed_items,
        excluded_items=req.excluded_items, num_beam_groups=req.num_beam_groups or 1,
        diversity_penalty=req.diversity_penalty or 0.0, return_tree=req.return_tree,
        patience=1.0 if req.patience is None else req.patience,
        prefix_bias_beta=req.prefix_bias_beta or 0.0, return_alternatives=bool(req.return_alternatives),
        min_alternative_expansion_prob=req.min_alternative_expansion_prob or 0.0, _width_field=width_field,
        _max_tokens_name=max_tokens_name, **_penalties(req), **extra)
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


def check_echo(req: _GenerationFields, plan: Plan, engine) -> None:
    """`echo` only where there is a prompt to echo, and streamed only where its log-probs can lead."""
    if plan.echo and is_encoder_decoder(engine):
        raise invalid("echo", "echo applies to decoder-only models: this one is an encoder-decoder, whose "
                              "prompt is a source its decoder neither continues nor scores (the decoder "
                              "starts from its start token), so there is no prompt to echo or to give "
                              "log-probs for: drop echo (the source is the prompt you sent)")
    if req.stream and plan.echo and plan.num_top_logprobs is not None and not plan.beam:
        raise invalid("echo", "echo with logprobs cannot be streamed for sampled choices (the prompt's "
                              "log-probs come with the final output): drop stream or logprobs")


def is_encoder_decoder(engine) -> bool:
    """The served model encodes its prompt as a source (its decoder starts from a start token)."""
    rules = getattr(engine, "prompt_rules", None)
    return rules is not None and rules.decoder_start_token_id is not None


def vocab_size(engine) -> int:
    """The served model's vocabulary (an engine without prompt rules, a test's, bounds nothing)."""
    rules = getattr(engine, "prompt_rules", None)
    return rules.vocab_size if rules is not None else 2**63


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
