"""Finishing a round: the decoder replayed on the target's scores, one ordinary step at a time.

Every decode of a request is a round: each live sequence fed its pending tokens and D >= 0 drafted
nodes (a tree) in one forward pass, which returned one row of scores after the last pending token
(the root) and one after each node. The decoder steps on the root's rows; while every sequence the
step chose is a drafted node, the target has already scored what comes next, so it steps again on
those nodes' rows. The first step that leaves the tree ends the round. With no drafts (D = 0, or a
drafter that found nothing) that is exactly one step: a plain decode step.

Each step is the decoder's own step on the target's own scores, so beam search (parents, tokens,
scores, finished hypotheses, stop strings) is what plain decoding gives, for any draft; sampling
verifies a drafted token by rejection against a point-mass proposal (sampling.py:
`verify_draft_token`), which keeps the target's distribution.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from widebeam.decoding.decoders import StepScores
from widebeam.outputs import RequestDelta
from widebeam.speculative.tree import ROOT, DraftTree


@dataclass(frozen=True)
class ReplayedRound:
    """What a round chose: new sequence i continues old sequence `parent_indices[i]` with the
    tokens `paths[i]` (its pending tokens next round); `num_steps` decoder steps were taken."""

    parent_indices: list[int]
    paths: list[list[int]]
    num_steps: int


def replay_round(decoder, stream, delta: RequestDelta, root_rows: Sequence[int], trees: Sequence[DraftTree],
                 scores: StepScores) -> ReplayedRound:
    """Step `decoder` on `scores` from each old sequence's `root_rows[i]` (node j of `trees[i]` is
    scored at row `root_rows[i] + 1 + j`) while the chosen sequences stay inside the trees. `stream`
    is told every step (text, stop strings) and fills `delta`."""
    current: list[tuple[int, int | None]] = [(i, ROOT) for i in range(len(root_rows))]  # (old seq, node)
    paths: list[list[int]] = [[] for _ in root_rows]
    num_steps = 0
    while True:
        rows = [root_rows[seq] + 1 + node for seq, node in current]
        drafted = [trees[seq].child_token_ids(node) for seq, node in current]
        step = decoder.advance(scores.select(rows), drafted)
        num_steps += 1
        stopped = stream.on_step(delta, step)
        if decoder.done:
            break
        current = [(current[p][0], trees[current[p][0]].child(current[p][1], token))
                   for p, token in zip(step.parent_indices, step.token_ids)]
        paths = [paths[p] + [token] for p, token in zip(step.parent_indices, step.token_ids)]
        if stopped:
            current = [c for i, c in enumerate(current) if i not in stopped]
            paths = [path for i, path in enumerate(paths) if i not in stopped]
        if any(node is None for _, node in current):
            break  # the next step's scores were not drafted: the round ends here
    return ReplayedRound([seq for seq, _ in current], paths, num_steps)
