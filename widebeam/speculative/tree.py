"""The drafted token tree of one sequence, and how wide it branches for a beam width.

Node j holds one drafted token; its parent is another node (parents come before children) or -1,
the root: the last pending token of the sequence. The tree is laid out in the KV cache right after
the pending tokens, in node order (`SequenceInput.tree_parents`), so node j's K/V sit at logical
index `committed + num_pending + j` and its position is `committed + num_pending - 1 + depth(j)`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ROOT = -1


def branching_for_width(beam_width: int) -> int:
    """Children drafted per node for a request of this beam width.

    A step of exact beam search stays inside the tree only if every (beam, token) it selects was
    drafted. Measured on SmolLM2-135M with the target itself as a perfect draft (issue #15), the
    share of steps whose whole selection lies inside each beam's top-c children is, for c = 1:
    0.29-0.33 at W=4 and 0.04-0.08 at W=16; c = 2: 0.88-0.92 at W=4, 0.33-0.54 at W=16; c = 4:
    1.00 at W=4, 0.71-0.83 at W=16. Greedy and sampling (W=1) need one child: the argmax is the only
    token greedy can pick, and a point-mass proposal is what rejection sampling checks. W=2..4 take
    two children (about 9 steps in 10 covered at half the nodes of four); wider beams take four,
    below which most steps fall outside the tree.
    """
    if beam_width <= 1:
        return 1
    return 2 if beam_width <= 4 else 4


def max_tree_depth(num_nodes: int, branching: int) -> int:
    """The deepest a tree of `num_nodes` nodes gets when every level but the last takes `branching`
    children of one node at least (a draft model's: its first level is the root's best `branching`
    children), so the most steps one round takes is this + 1. A chain (branching 1) is `num_nodes` deep."""
    return num_nodes - min(branching, num_nodes) + 1 if num_nodes else 0


@dataclass
class DraftTree:
    """Drafted tokens in breadth-first order, with each node's parent and draft score."""

    token_ids: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)  # the draft's cumulative log-prob of the path
    depths: list[int] = field(default_factory=list)
    _children: dict[tuple[int, int], int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.token_ids)

    def add(self, parent: int, token_id: int, score: float = 0.0) -> int:
        node = len(self.token_ids)
        self.token_ids.append(token_id)
        self.parents.append(parent)
        self.scores.append(score)
        self.depths.append(1 if parent == ROOT else self.depths[parent] + 1)
        self._children[(parent, token_id)] = node
        return node

    def child(self, node: int | None, token_id: int) -> int | None:
        """The node drafted for `token_id` after `node` (ROOT: the pending token); None if none was."""
        if node is None:
            return None
        return self._children.get((node, token_id))

    def child_token_ids(self, node: int) -> list[int]:
        """The tokens drafted right after `node` (ROOT: after the pending tokens)."""
        return [self.token_ids[j] for j, parent in enumerate(self.parents) if parent == node]

    def path(self, node: int) -> list[int]:
        """Tokens from the root's first child down to `node`."""
        tokens = []
        while node != ROOT:
            tokens.append(self.token_ids[node])
            node = self.parents[node]
        return tokens[::-1]

    def level(self, depth: int) -> list[int]:
        return [j for j, d in enumerate(self.depths) if d == depth]

    def num_kept(self, path: list[int], draft_fed: bool = False) -> int:
        """How many leading tokens of a chosen `path` are nodes whose K/V may stay where the verify pass
        wrote them: node j at depth j + 1 sits where the (j + 1)-th fed token would (a chain's nodes
        do). Never the path's last token (the next round feeds one at least). With `draft_fed`, only
        nodes a draft model was fed too: it feeds a level only to draft the next, so not the deepest
        (`ModelDrafter.draft`)."""
        limit = len(path) - 1
        if draft_fed:
            limit = min(limit, max(self.depths, default=0) - 1)
        n, node = 0, ROOT
        while n < limit:
            node = self.child(node, path[n])
            if node != n:
                break
            n += 1
        return n
