"""Token penalties as one logits processor: `repetition_penalty` (transformers / vLLM) and
`presence_penalty` / `frequency_penalty` (OpenAI / vLLM).

For each row (a sequence; a live beam in beam search), in this order:

1. repetition (`p`, 1 = off): every token id that occurs in the row's prompt + generated tokens gets
   `score / p` if its score is > 0, else `score * p` (transformers' `RepetitionPenaltyLogitsProcessor`;
   vLLM applies the same to prompt + output tokens).
2. presence and frequency (0 = off): every token id generated `c > 0` times so far (the prompt does not
   count) gets `score -= frequency * c + presence` (OpenAI's formula; vLLM's `apply_penalties`, which
   also runs them after the repetition penalty).

"Prompt" is the token ids the decoder starts from, as transformers' `input_ids`: a decoder-only model's
prompt, an encoder-decoder's decoder start token (the source is not penalised, as in transformers).

The scores are whatever the decoder hands its processors: logits for sampling and greedy (before
temperature, top-k and top-p, as both transformers and vLLM do), the log-softmax of each beam in beam
search (transformers' beam search runs its processors there, with each beam's own `input_ids`: the
prompt + that beam's generated tokens; no renormalisation afterwards).

The rows' token histories are the decoder's (`StepContext.history`, decoding/context.py): one tensor
[rows, prompt + generated] of token ids, each row its beam's own (moved with the beams, rows of beams
finished on a stop string dropped), one row for sampling and greedy (a speculative round's verified
tokens count as the decoder records them). Every live row of a request has the same length, so the
penalties are a gather/scatter over it, recomputed each step: nothing is kept between steps.
"""

from __future__ import annotations

import torch

from widebeam.decoding.context import StepContext
from widebeam.decoding.processors import StepProcessor


class TokenPenalties(StepProcessor):
    """Repetition, presence and frequency penalties of one request (see the module docstring)."""

    def __init__(self, repetition_penalty: float = 1.0, presence_penalty: float = 0.0,
                 frequency_penalty: float = 0.0):
        self.repetition_penalty = float(repetition_penalty)
        self.presence_penalty = float(presence_penalty)
        self.frequency_penalty = float(frequency_penalty)

    @staticmethod
    def wanted(repetition_penalty: float, presence_penalty: float, frequency_penalty: float) -> bool:
        """Whether any penalty is on (off values add no processor)."""
        return repetition_penalty != 1.0 or presence_penalty != 0.0 or frequency_penalty != 0.0

    def process(self, scores: torch.Tensor, context: StepContext) -> None:
        ids = context.history  # [rows, prompt_len + generated]
        if ids.shape[0] != scores.shape[0]:
            raise ValueError(f"penalties follow {ids.shape[0]} rows, got scores for {scores.shape[0]}")
        if self.repetition_penalty != 1.0 and ids.shape[1]:
            seen = scores.gather(1, ids)
            p = self.repetition_penalty
            scores.scatter_(1, ids, torch.where(seen < 0, seen * p, seen / p))
        generated = ids[:, context.prompt_len:]  # [rows, generated]
        if (self.presence_penalty or self.frequency_penalty) and generated.shape[1]:
            counts = torch.zeros_like(scores).scatter_add_(
                1, generated, torch.ones(generated.shape, dtype=scores.dtype, device=scores.device))
            scores -= self.frequency_penalty * counts + self.presence_penalty * (counts > 0).to(scores.dtype)
