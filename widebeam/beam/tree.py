"""The search tree of one beam search (`BeamSearchParams(return_tree=True)`): every candidate a step kept.

A step of the search (beam/search.py) ranks the live beams' continuations and keeps two kinds of them:
the next live beams (at most W) and the hypotheses that finish at that step (at most W). Each kept
candidate is one node here: its token, its parent node (-1: the prompt), the step that generated it
(1 = the first generated token), its cumulative log-prob, and whether it finished (its length-penalised
score and finish reason). A live beam that a stop string finishes (`finish_live_beams`) becomes a
finished node itself, with no token of its own. Nothing that was not kept is recorded: a pruned node
is a kept node none of whose continuations was kept.

Memory: counted, not capped. A step adds at most 2W nodes (W live, W finished), so a request's tree
holds at most 2 x W x N nodes, N = max_new_tokens; each node costs `BYTES_PER_NODE` (26) bytes in the
compact arrays below, a finished one 200 more (`nbytes` reports the total; the unit test traces the
allocations and checks it). W and N are the request's own, already bounded by
the engine (max_beam_width, max_seq_len), and the tree is off by default. The JSON form (`to_dict`) is
larger: docs/ui.md gives both for W=1024, N=8.

`to_dict` is the wire format (docs/ui.md), columnar, one list per field, index = node id:
token_id, parent, step, cumulative_logprob, finished, score (null unless finished), finish_reason,
rank (the node's place in the returned hypotheses, null if not returned), pruned_at (the step at
which the beam was dropped: a node of step t with no kept continuation and not finished has
pruned_at t + 1 when the search ran step t + 1, else t, the step the search ended at; null otherwise).
"""

from __future__ import annotations

from array import array

NO_PARENT = -1
# token_id, parent, step (int32 each), cumulative log-prob (float64), finished and has-child flags (one
# byte each), the search's node -> tree node (int32, live nodes only: counted for every node)
BYTES_PER_NODE = 4 + 4 + 4 + 8 + 1 + 1 + 4
# a finished node's score and finish reason in two dicts (a float and an int object, two dict slots)
BYTES_PER_FINISHED_NODE = 200


class SearchTree:
    """The kept candidates of one beam search, filled by `BeamSearchState` as it steps."""

    def __init__(self, beam_width: int, length_penalty: float):
        self.beam_width = beam_width
        self.length_penalty = length_penalty
        self._token = array("i")
        self._parent = array("i")
        self._step = array("i")
        self._cumulative = array("d")
        self._finished = array("b")
        self._score: dict[int, float] = {}  # finished nodes only
        self._reason: dict[int, str] = {}
        self._has_child = bytearray()
        self._search_node = array("i")  # the search's node id -> tree node id (live nodes only)
        self._rank: dict[int, int] = {}
        self.num_steps = 0

    def __len__(self) -> int:
        return len(self._token)

    @property
    def nbytes(self) -> int:
        """Bytes of the tree's arrays (what `to_dict` is built from), counted as it grows."""
        return len(self._token) * BYTES_PER_NODE + BYTES_PER_FINISHED_NODE * len(self._score)

    def _add(self, token: int, parent: int, step: int, cumulative: float, finished: bool) -> int:
        if parent != NO_PARENT:
            self._has_child[parent] = 1
        self._token.append(token)
        self._parent.append(parent)
        self._step.append(step)
        self._cumulative.append(cumulative)
        self._finished.append(1 if finished else 0)
        self._has_child.append(0)
        return len(self._token) - 1

    def tree_node(self, search_node: int) -> int:
        """The tree node of a search node (-1, the prompt, stays -1)."""
        return NO_PARENT if search_node < 0 else self._search_node[search_node]

    def record_step(self, step: int, finished: list, live_parents: list[int], live_tokens: list[int],
                    live_scores: list[float]) -> None:
        """One step's kept candidates. `finished`: the new `_Finished` entries (their `node` is the
        parent's search node, `extra_token` the finishing token); each gets its `tree_id`. `live_*`:
        the next live beams, parents as search nodes, in the order the search numbers them."""
        self.num_steps = step
        for entry in finished:
            entry.tree_id = self._add(entry.extra_token, self.tree_node(entry.node), step,
                                      entry.cumulative_logprob, True)
            self._score[entry.tree_id] = entry.score
            self._reason[entry.tree_id] = entry.finish_reason
        for parent, token, cumulative in zip(live_parents, live_tokens, live_scores):
            self._search_node.append(self._add(token, self.tree_node(parent), step, cumulative, False))

    def finish_node(self, entry) -> None:
        """A live beam finished where it stands (a stop string, or filled in by `finalize`)."""
        tree_id = self.tree_node(entry.node)
        entry.tree_id = tree_id
        self._finished[tree_id] = 1
        self._score[tree_id] = entry.score
        self._reason[tree_id] = entry.finish_reason

    def set_ranks(self, tree_ids: list[int]) -> None:
        """The returned hypotheses' nodes, best first."""
        self._rank = {tree_id: rank for rank, tree_id in enumerate(tree_ids)}

    def pruned_at(self, node: int) -> int | None:
        if self._finished[node] or self._has_child[node]:
            return None
        step = self._step[node]
        return step + 1 if step < self.num_steps else step

    def to_dict(self, token_text=None) -> dict:
        """The JSON-ready tree (module docstring). `token_text(token_id) -> str`: the text of every
        distinct token, under "token_text" keyed by the id as a string (for hover labels)."""
        nodes = range(len(self._token))
        tree = {
            "beam_width": self.beam_width,
            "length_penalty": self.length_penalty,
            "num_steps": self.num_steps,
            "num_nodes": len(self._token),
            "nbytes": self.nbytes,
            "token_id": self._token.tolist(),
            "parent": self._parent.tolist(),
            "step": self._step.tolist(),
            "cumulative_logprob": self._cumulative.tolist(),
            "finished": [bool(f) for f in self._finished],
            "score": [self._score.get(i) for i in nodes],
            "finish_reason": [self._reason.get(i) for i in nodes],
            "rank": [self._rank.get(i) for i in nodes],
            "pruned_at": [self.pruned_at(i) for i in nodes],
        }
        if token_text is not None:
            tree["token_text"] = {str(t): token_text(t) for t in sorted(set(self._token))}
        return tree


def path_to(tree: dict, node: int) -> list[int]:
    """The nodes from the first generated token to `node` in a `to_dict` tree; a finished node that
    only marks a live beam (a stop string) ends the path like any other."""
    nodes = []
    while node != NO_PARENT:
        nodes.append(node)
        node = tree["parent"][node]
    nodes.reverse()
    return nodes


def ranked_hypotheses(tree: dict) -> list[tuple[list[int], float, float]]:
    """(token ids, cumulative log-prob, score) of each returned hypothesis, best first, from the tree
    alone: what a client redraws, and what the tests compare with the engine's answer."""
    ranked = sorted((rank, node) for node, rank in enumerate(tree["rank"]) if rank is not None)
    return [([tree["token_id"][n] for n in path_to(tree, node)], tree["cumulative_logprob"][node],
             tree["score"][node]) for _, node in ranked]
