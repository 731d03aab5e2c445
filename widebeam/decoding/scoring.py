"""Forced decoding: a decoder whose rows follow given continuations instead of choosing tokens.

`ScoringDecoder` speaks the decoders' interface (decoding/decoders.py: `advance`, `done`,
`live_token_ids`, `finalize`...), so a scoring request runs through the engine's ordinary step path:
the prompt is prefilled once, then rows fork from it as beams do, sharing its blocks. The rows are the
continuations' prefix tree, level by level: before step d every distinct prefix of d tokens (of a
continuation longer than d) is one live row, so continuations that share a prefix share its rows and
its forward-pass tokens. Step d reads, for every continuation longer than d, the log-prob of its token
d in the row of its prefix (raw log-softmax: no processor), and forks the rows of step d + 1. A
continuation's last token is scored but never fed: a continuation of L tokens costs L - 1 rows' tokens
beyond the prompt, fewer where prefixes are shared.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from widebeam.beam.search import Hypothesis
from widebeam.decoding.decoders import Advance
from widebeam.decoding.logprobs import token_logprobs
from widebeam.score_params import ScoreParams


class ScoringDecoder:
    """The rows of one scoring request (see the module docstring); `finalize` returns one hypothesis
    per continuation, in the order given: its tokens, the sum of their log-probs (`cumulative_logprob`
    and `score`) and each token's entry (`annotations`: `{token: Logprob(logprob, rank)}`)."""

    batched_greedy = False

    tree = None  # forced decoding searches nothing

    def __init__(self, params: ScoreParams):
        self.params = params
        self.prompt_logprobs = None
        items = params.token_continuations
        self._items = items
        self._depth = 0
        # rows at each depth: the distinct prefixes, in first-seen order
        self._rows: list[dict[tuple[int, ...], int]] = []
        for d in range(max(len(c) for c in items)):
            rows: dict[tuple[int, ...], int] = {}
            for c in items:
                if len(c) > d:
                    rows.setdefault(c[:d], len(rows))
            self._rows.append(rows)
        self._entries: list[list] = [[] for _ in items]

    @property
    def num_generated_tokens(self) -> int:
        return self._depth

    @property
    def done(self) -> bool:
        return self._depth >= len(self._rows)

    @property
    def live_token_ids(self) -> list[list[int]]:
        """Each live row's tokens after the prompt (its prefix), in row order."""
        if self.done:
            return []
        return [list(prefix) for prefix in self._rows[self._depth]]

    def advance(self, scores, drafted: Sequence[Sequence[int]] = ()):
        """Score token `depth` of every continuation longer than `depth` in its prefix's row; the next
        rows (the prefixes one token longer) fork from theirs."""
        d = self._depth
        rows = self._rows[d]
        logprobs: torch.Tensor = scores.logprobs
        if logprobs.shape[0] != len(rows):
            raise ValueError(f"scoring expects {len(rows)} rows at depth {d}, got {logprobs.shape[0]}")
        which = [i for i, c in enumerate(self._items) if len(c) > d]
        entries = token_logprobs(logprobs, [rows[self._items[i][:d]] for i in which],
                                 [self._items[i][d] for i in which], 0)
        for i, entry in zip(which, entries):
            self._entries[i].append(entry)
        self._depth = d + 1
        if self.done:
            return Advance([], [])
        next_rows = self._rows[d + 1]
        return Advance([rows[prefix[:d]] for prefix in next_rows], [prefix[d] for prefix in next_rows])

    def stop(self, seq_indices: Sequence[int] | None = None) -> None:
        """Nothing stops a forced row (scoring has no stop strings)."""

    def finalize(self) -> list[Hypothesis]:
        out = []
        for tokens, entries in zip(self._items, self._entries):
            values = [entry[token].logprob for token, entry in zip(tokens, entries)]
            total = float(sum(values))
            reason = "length" if len(entries) == len(tokens) else None  # None: aborted before the end
            out.append(Hypothesis(list(tokens), total, total, reason, list(entries)))
        return out
