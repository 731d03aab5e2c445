"""`return_alternatives` (CTranslate2's autocompletion / interactive-translation feature): the best
continuations that differ at the first free position, after the decoder prefix.

The first step (the prefix is the decoder's prompt, so that step is the first free position) expands the
`beam_width` most likely tokens of the processed distribution, dropping those whose probability is below
`min_alternative_expansion_prob` (the most likely one always stays); each alternative is then continued
on its own by greedy search (no competition between alternatives) until an end token, a stop string or
`max_new_tokens`. The alternatives come back in the order of their first token's probability (the order
an autocompletion menu shows), each scored as a beam is: its cumulative log-prob (of the processed rows,
as beam search scores) over `generated_len ** length_penalty`.

Where this differs from CTranslate2 (its `decode_alternatives` in `src/decoding.cc`; measured in
tests/parity/test_ctranslate2_options.py, docs/decoding-options.md): CTranslate2 continues each
alternative with its configured search (`beam_size`), this decoder greedily, which is CTranslate2's with
`beam_size=1`; it draws the first tokens with the end tokens banned before the log-softmax (renormalised),
and returns `num_hypotheses` alternatives, here `beam_width` are expanded and `num_return_sequences`
returned.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from widebeam.beam.scores import hypothesis_score
from widebeam.beam.search import BANNED, Hypothesis
from widebeam.decoding.context import TokenHistory, drop_rows
from widebeam.decoding.decoders import Advance
from widebeam.decoding.processors import LogitsProcessor, StepProcessor, apply_processors, step_processors
from widebeam.params import BeamSearchParams


class AlternativesDecoder:
    """The decoders' interface (decoding/decoders.py) over the alternatives' rows."""

    batched_greedy = False

    tree = None  # no beam search runs (return_tree is refused with return_alternatives)

    def __init__(self, params: BeamSearchParams, max_new_tokens: int, eos_token_ids: frozenset[int],
                 processors: Sequence[LogitsProcessor | StepProcessor], prompt_token_ids: Sequence[int] = ()):
        self.params = params
        self.max_new_tokens = max_new_tokens
        eos = set() if params.ignore_eos else set(eos_token_ids)
        self.end_token_ids = sorted(eos | set(params.stop_token_ids))
        self.processors = step_processors(processors)
        self.history = TokenHistory(prompt_token_ids)
        self.prompt_logprobs = None
        self._generated = 0
        self._live: list[int] = []  # alternative index of each live row
        self._tokens: list[list[int]] = []  # per alternative
        self._logprobs: list[float] = []  # per alternative: cumulative
        self._reasons: list[str | None] = []
        self._done = False

    @property
    def num_generated_tokens(self) -> int:
        return self._generated

    @property
    def done(self) -> bool:
        return self._done

    @property
    def live_token_ids(self) -> list[list[int]]:
        if not self._tokens:
            return [[]]
        return [list(self._tokens[a]) for a in self._live]

    def advance(self, scores, drafted: Sequence[Sequence[int]] = ()) -> Advance:
        num_rows = scores.logprobs.shape[0]
        context = self.history.context(num_rows, self._generated, scores.logprobs.device)
        if self.processors:  # on the log-softmax, as beam search runs them
            logprobs = apply_processors(self.processors, scores.logprobs.clone(), context)
        else:
            logprobs = scores.logprobs
        if self._generated < self.params.min_new_tokens and self.end_token_ids:
            logprobs = logprobs.clone()
            logprobs[:, self.end_token_ids] = float("-inf")
        if self._generated == 0:
            rows, tokens, values = self._expand(logprobs)
            if not rows:  # the prompt allows no token: one alternative of none, ended (never empty)
                self._tokens, self._logprobs, self._reasons = [[]], [0.0], [BANNED]
                self._done = True
                return Advance([], [])
        else:
            values_t, tokens_t = logprobs.max(dim=-1)
            rows, tokens, values = list(range(num_rows)), tokens_t.tolist(), values_t.double().tolist()
        self._generated += 1
        parents, next_tokens, live = [], [], []
        for row, token, value in zip(rows, tokens, values):
            if self._generated == 1:  # a new alternative, forked from the prompt's row
                alternative = len(self._tokens)
                self._tokens.append([])
                self._logprobs.append(0.0)
                self._reasons.append(None)
            else:
                alternative = self._live[row]
            if not value > float("-inf"):  # every token banned: it ends where it stands
                self._reasons[alternative] = BANNED
                continue
            self._tokens[alternative].append(token)
            self._logprobs[alternative] += value
            if token in self.end_token_ids:
                self._reasons[alternative] = "stop"
            elif self._generated >= self.max_new_tokens:
                self._reasons[alternative] = "length"
            else:
                parents.append(row)
                next_tokens.append(token)
                live.append(alternative)
        self._live = live
        self.history.move(parents, next_tokens)
        if not live:
            self._done = True
        return Advance(parents, next_tokens)

    def _expand(self, logprobs: torch.Tensor) -> tuple[list[int], list[int], list[float]]:
        """The first free position: the `beam_width` most likely tokens of the prompt's row with a
        probability of at least `min_alternative_expansion_prob` (the most likely one always)."""
        k = min(self.params.beam_width, logprobs.shape[1])
        values, tokens = torch.topk(logprobs[0], k)
        values_l, tokens_l = values.double().tolist(), tokens.tolist()
        threshold = self.params.min_alternative_expansion_prob
        kept = [i for i, v in enumerate(values_l)
                if v > float("-inf") and (i == 0 or math.exp(v) >= threshold)]
        return [0] * len(kept), [tokens_l[i] for i in kept], [values_l[i] for i in kept]

    def stop(self, seq_indices: Sequence[int] | None = None) -> None:
        """These live rows' text hit a stop string: their alternatives finish now."""
        num_live = len(self._live)
        seq_indices = list(range(num_live) if seq_indices is None else seq_indices)
        for i in seq_indices:
            self._reasons[self._live[i]] = "stop"
        kept = drop_rows(num_live, seq_indices)
        self._live = [self._live[i] for i in kept]
        self.history.keep(kept)
        if not self._live:
            self._done = True

    def finalize(self) -> list[Hypothesis]:
        """The alternatives in the order of their first token's probability, `num_return_sequences` of
        them (an aborted request's unfinished ones with finish reason "length")."""
        out = []
        for tokens, logprob, reason in zip(self._tokens, self._logprobs, self._reasons):
            score = hypothesis_score(logprob, max(1, len(tokens)), self.params.length_penalty)
            out.append(Hypothesis(list(tokens), logprob, score, reason or "length"))
        return out[:self.params.num_return_sequences]
