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

The per-row token history follows the decoder:
- beam search: the processor is a `BeamStateProcessor`; `BeamDecoder` calls `reorder(parents, tokens)`
  after each step (row i = old row `parents[i]` + `tokens[i]`) and `drop(rows)` for beams that finished on
  a stop string, so each row's history is its beam's own.
- sampling / greedy (one row): `SamplingDecoder` never calls `reorder`; `follow(token_ids)` hands the
  processor the decoder's own list of generated tokens as a live reference, read at each call up to
  `num_generated_tokens` (so a speculative round's verified tokens count as they are recorded).

The history is one tensor [rows, prompt + generated] of token ids: every live row of a request has the
same length, so penalties are a gather/scatter over it, not a [rows, vocab] count table kept between steps.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch


class TokenPenalties:
    """Repetition, presence and frequency penalties of one request (see the module docstring)."""

    def __init__(self, prompt_token_ids: Sequence[int], repetition_penalty: float = 1.0,
                 presence_penalty: float = 0.0, frequency_penalty: float = 0.0):
        self.repetition_penalty = float(repetition_penalty)
        self.presence_penalty = float(presence_penalty)
        self.frequency_penalty = float(frequency_penalty)
        self.prompt_len = len(prompt_token_ids)
        # [rows, prompt_len + generated]: one row (the prompt) before the first step
        self.ids = torch.tensor([list(prompt_token_ids)], dtype=torch.long).reshape(1, self.prompt_len)
        self._live: list[int] | None = None  # a SamplingDecoder's generated tokens (see `follow`)

    @staticmethod
    def wanted(repetition_penalty: float, presence_penalty: float, frequency_penalty: float) -> bool:
        """Whether any penalty is on (off values add no processor)."""
        return repetition_penalty != 1.0 or presence_penalty != 0.0 or frequency_penalty != 0.0

    def follow(self, generated_token_ids: list[int]) -> None:
        """One sequence (sampling, greedy): read its generated tokens from this live list."""
        self._live = generated_token_ids

    def _history(self, device: torch.device, num_generated_tokens: int) -> torch.Tensor:
        if self._live is not None:
            generated = self._live[:num_generated_tokens]
            known = self.ids.shape[1] - self.prompt_len
            if len(generated) > known:
                new = torch.tensor(generated[known:], dtype=torch.long, device=self.ids.device)
                self.ids = torch.cat((self.ids, new[None]), 1)
            elif len(generated) < known:
                self.ids = self.ids[:, :self.prompt_len + len(generated)]
        if self.ids.device != device:
            self.ids = self.ids.to(device)
        return self.ids

    def __call__(self, scores: torch.Tensor, num_generated_tokens: int) -> None:
        ids = self._history(scores.device, num_generated_tokens)
        if ids.shape[0] != scores.shape[0]:
            raise ValueError(f"penalties follow {ids.shape[0]} rows, got scores for {scores.shape[0]}")
        if self.repetition_penalty != 1.0 and ids.shape[1]:
            seen = scores.gather(1, ids)
            p = self.repetition_penalty
            scores.scatter_(1, ids, torch.where(seen < 0, seen * p, seen / p))
        generated = ids[:, self.prompt_len:]
        if (self.presence_penalty or self.frequency_penalty) and generated.shape[1]:
            counts = torch.zeros_like(scores).scatter_add_(
                1, generated, torch.ones(generated.shape, dtype=scores.dtype, device=scores.device))
            scores -= self.frequency_penalty * counts + self.presence_penalty * (counts > 0).to(scores.dtype)

    def reorder(self, parent_indices: Sequence[int], token_ids: Sequence[int]) -> None:
        """Beam i of the next step continues beam `parent_indices[i]` with `token_ids[i]`."""
        device = self.ids.device
        parents = torch.tensor(list(parent_indices), dtype=torch.long, device=device)
        tokens = torch.tensor(list(token_ids), dtype=torch.long, device=device)
        self.ids = torch.cat((self.ids.index_select(0, parents), tokens[:, None]), 1)

    def drop(self, seq_indices: Iterable[int]) -> None:
        """These live beams finished (stop strings); the others keep their order."""
        gone = set(seq_indices)
        if gone:
            keep = [i for i in range(self.ids.shape[0]) if i not in gone]
            self.ids = self.ids.index_select(0, torch.tensor(keep, dtype=torch.long, device=self.ids.device))
