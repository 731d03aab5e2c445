"""The grammar constraint: a logits processor that keeps every sequence of a request inside a grammar
(xgrammar's `GrammarMatcher`, one per live row), with that per-row state moved with the beams.

Each step, each row's matcher fills its row of a token bitmask and every token the grammar does not
allow next gets -inf (the end-of-sequence token only where the grammar is complete). Before that,
the matchers follow the step context's moves (sampling and beams alike): a parent continued by
several rows is forked (`GrammarMatcher.fork`, the parsing state copied, the compiled grammar shared)
rather than replayed from the start, and each new row's matcher accepts its token.
"""

from __future__ import annotations

import torch

from widebeam.decoding.context import BeamMoves, StepContext
from widebeam.decoding.processors import BeamStateFollower, StepProcessor


class GrammarConstraint(BeamStateFollower, StepProcessor):
    def __init__(self, compiled_grammar, vocab_size: int):
        import xgrammar

        self._xgr = xgrammar
        self.compiled_grammar = compiled_grammar
        self.vocab_size = vocab_size
        self.matchers = [xgrammar.GrammarMatcher(compiled_grammar)]  # the prompt's row
        self._bitmask = None

    def process(self, scores: torch.Tensor, context: StepContext) -> None:
        self.follow(context)
        rows = scores.shape[0]
        if rows != len(self.matchers):
            raise ValueError(f"the grammar follows {len(self.matchers)} sequences, got scores for {rows}")
        if self._bitmask is None or self._bitmask.shape[0] < rows:
            self._bitmask = self._xgr.allocate_token_bitmask(rows, self.vocab_size)
        bitmask = self._bitmask[:rows]
        for i, matcher in enumerate(self.matchers):
            matcher.fill_next_token_bitmask(bitmask, i)
        if scores.device.type != "cpu":
            bitmask = bitmask.to(scores.device)
        self._xgr.apply_token_bitmask_inplace(scores, bitmask, vocab_size=self.vocab_size)
        if scores.shape[1] > self.vocab_size:  # ids past the tokenizer's (padding rows of lm_head)
            scores[:, self.vocab_size:] = float("-inf")

    @staticmethod
    def _accept(matcher, token: int) -> None:
        if not matcher.accept_token(int(token)):
            raise ValueError(f"token {token} breaks the grammar (it was masked: a processor after the "
                             "grammar must have allowed it)")

    def move(self, moves: BeamMoves) -> None:
        """Row i of this step continues row `moves.parent_indices[i]` with `moves.token_ids[i]`."""
        taken: set[int] = set()
        matchers = []
        for parent in moves.parent_indices:  # fork before any accepts: a fork copies the parent's state
            matchers.append(self.matchers[parent].fork() if parent in taken else self.matchers[parent])
            taken.add(parent)
        for matcher, token in zip(matchers, moves.token_ids):
            self._accept(matcher, token)
        self.matchers = matchers
