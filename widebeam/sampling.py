"""Choosing the next token from logits: greedy, or temperature / top-k / top-p sampling."""

from __future__ import annotations

import torch

from widebeam.params import SamplingParams


def filtered_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature-scaled logits [vocab] with tokens outside top-k / top-p set to -inf."""
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the tokens before it already cover top_p; the first is always kept
        drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
        drop_sorted[0] = False  # a top_p that rounds to 0 in float32 must still leave one token
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
                 logprobs: torch.Tensor | None = None) -> tuple[int, float]:
    """The next token of one sequence and its log-probability under the model's distribution
    (`logprobs`, the log-softmax of `logits`, when the caller has it already)."""
    if logprobs is None:
        logprobs = torch.log_softmax(logits.float(), dim=-1)
    if params.greedy:
        token = int(torch.argmax(logits))
    else:
        probs = torch.softmax(filtered_logits(logits.float(), params), dim=-1)
        token = int(torch.multinomial(probs.cpu(), 1, generator=generator))
    return token, float(logprobs[token])


def verify_draft_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
                       draft_token: int | None,
                       logprobs: torch.Tensor | None = None) -> tuple[int, float, bool]:
    """Speculative rejection sampling against a point-mass proposal (the draft proposes one token,
    deterministically): accept `draft_token` with probability p(draft), else sample from p with the
    draft token removed and renormalised. The token's distribution is p exactly:
    P(x) = p(x) for the drafted x, and (1 - p(x)) * p(y) / (1 - p(x)) = p(y) for any other y.
    Greedy (p one-hot at the argmax) reduces to "accept iff the draft is the argmax".
    Returns (token, its log-prob under the model, accepted)."""
    if draft_token is None:
        token, logprob = sample_token(logits, params, generator, logprobs)
        return token, logprob, False
    if logprobs is None:
        logprobs = torch.log_softmax(logits.float(), dim=-1)
    if params.greedy:
        token = int(torch.argmax(logits))
        return token, float(logprobs[token]), token == draft_token
    probs = torch.softmax(filtered_logits(logits.float(), params), dim=-1).cpu()
    if float(torch.rand(1, generator=generator)) < float(probs[draft_token]):
        return draft_token, float(logprobs[draft_token]), True
    residual = probs.clone()
    residual[draft_token] = 0.0
    token = int(torch.multinomial(residual, 1, generator=generator))
    return token, float(logprobs[token]), False
