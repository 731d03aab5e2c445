"""What `generate` returns: per request, its completions (for beam search: the beams, best first)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]  # generated tokens only
    cumulative_logprob: float
    finish_reason: str | None  # "stop", "length", or None while running
    score: float | None = None  # beam search: the length-penalised score transformers reports


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
