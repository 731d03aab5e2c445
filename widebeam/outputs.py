"""What `generate` returns: per request, its completions (for beam search: the beams, best first)."""

from __future__ import annotations

from dataclasses import dataclass, field

from widebeam.logprobs import TokenLogprobs


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]  # generated tokens only
    cumulative_logprob: float
    finish_reason: str | None  # "stop", "length", "banned" (no token was left), or None while running
    score: float | None = None  # beam search: the length-penalised score transformers reports
    # With `logprobs=k`: one dict per generated token (see widebeam/logprobs.py for what they are).
    logprobs: list[TokenLogprobs] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    # KV accounting per pool: the most distinct blocks the request held at once, and its bound.
    peak_blocks: dict[str, int] = field(default_factory=dict)
    required_blocks: dict[str, int] = field(default_factory=dict)
    # Prompt tokens whose K/V came from the prefix cache (an encoder-decoder's: source tokens whose
    # encoder output was cached), not computed for this request.
    num_cached_tokens: int = 0
    # With `prompt_logprobs=k`: one dict per prompt token, None for the first (widebeam/logprobs.py).
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # Beam search with `return_tree=True`: the search tree, JSON-ready (widebeam/beam/tree.py).
    tree: dict | None = None


@dataclass
class RequestDelta:
    """What one engine step changed for one request: `LLMEngine.step()` returns one per request
    that took part in the step.

    Sampled requests stream: `new_token_ids` and `new_text` are what this step appended (text held
    back while it could still be the start of a stop string, so the concatenation of every delta's
    `new_text` is the final text). Beam requests report `num_generated_tokens` only: their beams are
    reordered every step, so their text is final only at the end. `first_token` is True on the step
    that produced the request's first generated token; `output` is set on the step it finished.
    With `logprobs=k`, a sampled request's `new_logprobs` holds one entry per new token id.

    A request whose own processing failed in the step (a logits processor, sampling, the beam step,
    stop handling, detokenization) is aborted alone, its blocks freed: its delta has `finished` set,
    `error` saying what failed, and no `output`. The other requests of the step go on.
    """

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    num_generated_tokens: int = 0
    first_token: bool = False
    finished: bool = False
    output: RequestOutput | None = None
    error: str | None = None
    # Sampled requests with `logprobs=k`: the entries of `new_token_ids`, one each (no decoded_token).
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)


@dataclass
class ScoreOutput:
    """The log-probs of one given continuation after its prompt (`LLM.score`): one per token, under the
    model's raw log-softmax, and their sum."""

    prompt_token_ids: list[int]  # as the engine counted the prompt (an encoder-decoder's source)
    token_ids: list[int]  # the continuation
    token_logprobs: list[float]
    logprob: float  # the sum of token_logprobs
