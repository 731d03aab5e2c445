"""Bans that read the history: `no_repeat_ngram_size` and multi-token `bad_words_ids`, as transformers
defines them (`NoRepeatNGramLogitsProcessor`, `NoBadWordsLogitsProcessor`); and CTranslate2's soft
prefix (`PrefixBias`), which reads the step only.

Both are stateless: each step they read the live rows' token ids (`StepContext.history`: the decoder's
prompt + each row's own generated tokens, moved with the beams), so they follow every reorder without
keeping anything. "Prompt" is what transformers calls `input_ids`: a decoder-only model's prompt (an
n-gram of the prompt may not be repeated either, as in transformers), an encoder-decoder's decoder start
token and decoder prefix (the source is not read).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from widebeam.decoding.context import StepContext
from widebeam.decoding.processors import StepProcessor


class NoRepeatNGram(StepProcessor):
    """No n-gram of `ngram_size` tokens occurs twice in a row's history: a token that would complete an
    n-gram already present gets -inf. transformers' vectorised rule: the row's last n-1 tokens are
    matched against every window of its history; a matching window bans its own last token."""

    def __init__(self, ngram_size: int):
        if ngram_size < 1:
            raise ValueError(f"no_repeat_ngram_size must be >= 1 here, got {ngram_size}")
        self.ngram_size = ngram_size

    def process(self, scores: torch.Tensor, context: StepContext) -> None:
        n = self.ngram_size
        ids = context.history  # [rows, length]
        length = ids.shape[1]
        if length < n:  # no complete n-gram yet
            return
        suffix = ids[:, length + 1 - n:]  # [rows, n - 1]: the n-gram the next token would complete
        windows = ids.unfold(1, n, 1)  # [rows, length - n + 1, n]
        matches = (windows[..., :-1] == suffix[:, None, :]).all(dim=-1)  # [rows, windows]
        vocab = scores.shape[1]
        # Unmatched windows (and ids past the scores' vocabulary) land in a spare column.
        banned = torch.zeros((scores.shape[0], vocab + 1), dtype=torch.bool, device=scores.device)
        banned.scatter_(1, torch.where(matches, windows[..., -1].clamp(max=vocab), vocab), True)
        scores.masked_fill_(banned[:, :vocab], float("-inf"))


class BadWords(StepProcessor):
    """Token sequences that may never appear: a sequence's last token gets -inf in every row whose
    history ends with the rest of it (a one-token sequence is banned everywhere). As in transformers, a
    one-token sequence that is an end-of-sequence id is left out (banning it would forbid ending)."""

    def __init__(self, sequences: Iterable[Sequence[int]], eos_token_ids: Iterable[int] = ()):
        eos = set(eos_token_ids)
        sequences = [tuple(s) for s in sequences if not (len(s) == 1 and s[0] in eos)]
        self.single = sorted({s[0] for s in sequences if len(s) == 1})
        by_prefix_len: dict[int, list[tuple[int, ...]]] = {}
        for s in sequences:
            if len(s) > 1:
                by_prefix_len.setdefault(len(s) - 1, []).append(s)
        # prefix length -> (prefixes [k, length], last tokens [k]), moved to the scores' device once
        self._groups = {n: (torch.tensor([s[:-1] for s in group]), torch.tensor([s[-1] for s in group]))
                        for n, group in sorted(by_prefix_len.items())}
        self._device: torch.device | None = None

    def process(self, scores: torch.Tensor, context: StepContext) -> None:
        if self.single:
            scores[:, self.single] = float("-inf")
        if not self._groups:
            return
        if self._device != scores.device:
            device = scores.device
            self._groups = {n: (p.to(device), t.to(device)) for n, (p, t) in self._groups.items()}
            self._device = scores.device
        ids = context.history
        for prefix_len, (prefixes, last_tokens) in self._groups.items():
            if prefix_len > ids.shape[1]:  # the history is shorter than the prefix
                continue
            matching = (ids[:, None, -prefix_len:] == prefixes).all(dim=-1)  # [rows, k]
            rows, which = torch.nonzero(matching, as_tuple=True)
            scores[rows, last_tokens[which]] = float("-inf")


class PrefixBias(StepProcessor):
    """CTranslate2's soft target prefix (`prefix_bias_beta`, arXiv 1912.03393 section 4.2): while fewer
    than len(prefix) tokens were generated, the distribution at step t of every row whose generated tokens
    are still prefix[:t] becomes (1 - beta) * p + beta * onehot(prefix[t]): the prefix token's log-prob
    log((1 - beta) p + beta), every other token's log(1 - beta) + log p. A row that left the prefix is not
    biased (CTranslate2's `beams_diverged_from_prefix`; it tracks that per beam slot, here per row's own
    tokens, which is the same at width 1). The biased rows are log-softmaxed first (beam search hands
    log-probs already; greedy hands logits), so the result is a normalised distribution whatever comes in."""

    def __init__(self, prefix: Sequence[int], beta: float):
        self.prefix = list(prefix)
        self.beta = float(beta)

    def process(self, scores: torch.Tensor, context: StepContext) -> None:
        step = context.num_generated_tokens
        if step >= len(self.prefix):
            return
        ids = context.history
        generated = ids[:, ids.shape[1] - step:]  # the prompt (decoder start) before them is not biased
        prefix = torch.tensor(self.prefix[:step], dtype=ids.dtype, device=ids.device)
        rows = torch.nonzero((generated == prefix).all(dim=-1), as_tuple=True)[0]  # still on the prefix
        if rows.numel() == 0:
            return
        logprobs = torch.log_softmax(scores[rows], dim=-1)
        token = self.prefix[step]
        biased = torch.log((1.0 - self.beta) * logprobs[:, token].exp() + self.beta)
        logprobs = logprobs + torch.log1p(torch.tensor(-self.beta, dtype=scores.dtype))
        logprobs[:, token] = biased
        scores[rows] = logprobs
