"""The grammar constraint: a logits processor that keeps every sequence of a request inside a grammar
(xgrammar's `GrammarMatcher`, one per live beam), with that per-beam state following the beams.

Each step, each row's matcher fills its row of a token bitmask and every token the grammar does not
allow next gets -inf (the end-of-sequence token only where the grammar is complete). In beam search
the beam decoder then calls `reorder(parents, tokens)`: a parent continued by several beams is forked
(`GrammarMatcher.fork`, the parsing state copied, the compiled grammar shared) rather than replayed
from the start, and each new beam's matcher accepts its token. A sampled sequence's matcher reads the
decoder's generated tokens (`follow`) and accepts those it has not seen before each step.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch


class GrammarConstraint:
    def __init__(self, compiled_grammar, vocab_size: int):
        import xgrammar

        self._xgr = xgrammar
        self.compiled_grammar = compiled_grammar
        self.vocab_size = vocab_size
        self.matchers = [xgrammar.GrammarMatcher(compiled_grammar)]  # the prompt's row
        self._bitmask = None
        self._generated: list[int] | None = None  # a sampled sequence's tokens (see `follow`)
        self._num_accepted = 0

    def follow(self, generated_token_ids: list[int]) -> None:
        """One sequence (sampling, greedy): read its generated tokens from this live list."""
        self._generated = generated_token_ids

    def __call__(self, scores: torch.Tensor, num_generated_tokens: int) -> None:
        if self._generated is not None:
            self._catch_up(num_generated_tokens)
        rows = scores.shape[0]
        if rows != len(self.matchers):
            raise ValueError(f"the grammar follows {len(self.matchers)} sequences, got scores for {rows}")
        if self._bitmask is None or self._bitmask.shape[0] < rows:
            self._bitmask = self._xgr.allocate_token_bitmask(rows, self.vocab_size)
        bitmask = self._bitmask[:rows]
        for i, matcher in enumerate(self.matchers):
            matcher.fill_next_token_bitmask(bitmask, i)
        if scores.device.type == "cpu":
            self._xgr.apply_token_bitmask_inplace(scores, bitmask, vocab_size=self.vocab_size)
        else:
            self._xgr.apply_token_bitmask_inplace(scores, bitmask.to(scores.device), vocab_size=self.vocab_size)
        if scores.shape[1] > self.vocab_size:  # ids past the tokenizer's (padding rows of lm_head)
            scores[:, self.vocab_size:] = float("-inf")

    def _catch_up(self, num_generated_tokens: int) -> None:
        matcher = self.matchers[0]
        for token in self._generated[self._num_accepted:num_generated_tokens]:
            self._accept(matcher, token)
        self._num_accepted = max(self._num_accepted, num_generated_tokens)

    @staticmethod
    def _accept(matcher, token: int) -> None:
        if not matcher.accept_token(int(token)):
            raise ValueError(f"token {token} breaks the grammar (it was masked: a processor after the "
                             "grammar must have allowed it)")

    def reorder(self, parent_indices: Sequence[int], token_ids: Sequence[int]) -> None:
        """Beam i of the next step continues beam `parent_indices[i]` with `token_ids[i]`."""
        taken: set[int] = set()
        matchers = []
        for parent in parent_indices:  # fork before any accepts: a fork copies the parent's state
            matchers.append(self.matchers[parent].fork() if parent in taken else self.matchers[parent])
            taken.add(parent)
        for matcher, token in zip(matchers, token_ids):
            self._accept(matcher, token)
        self.matchers = matchers

    def drop(self, seq_indices: Iterable[int]) -> None:
        """These live beams finished (stop strings); the others keep their order."""
        gone = set(seq_indices)
        self.matchers = [m for i, m in enumerate(self.matchers) if i not in gone]
