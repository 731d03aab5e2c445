"""A catalogue of items (token-id sequences) as a prefix trie in flat tensors.

Nodes are numbered breadth-first, root 0, children of a node in token order. So the children of
node p are the contiguous ids `child_start[p] .. child_start[p + 1] - 1` (CSR without an edge
array: node n's token is `node_token[n]`), parents are non-decreasing in node order, and the key
`parent * vocab + token` of nodes 1.. is strictly increasing: finding the child of (node, token)
is one `searchsorted` for all beams at once. A node may end an item and be the prefix of longer
ones (`is_end`).

Built without a Python loop over items: the items are sorted lexicographically as a padded
[num_items, max_len] array, and depth by depth a row opens a new node where its prefix differs
from the row before it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

PAD = -1


class CatalogueError(ValueError):
    """A catalogue that cannot be built: empty, an empty item, or a token outside the vocabulary."""


class Catalogue:
    def __init__(self, node_token: torch.Tensor, node_parent: torch.Tensor, child_start: torch.Tensor,
                 is_end: torch.Tensor, num_items: int, max_item_tokens: int, vocab_size: int,
                 min_item_tokens: int | None = None, source_items: np.ndarray | None = None):
        self.node_token = node_token  # [num_nodes] the token that leads into each node (root: 0)
        self.node_parent = node_parent  # [num_nodes] (root: 0)
        self.child_start = child_start  # [num_nodes + 1]
        self.is_end = is_end  # [num_nodes] an item ends here
        self.num_items = num_items
        self.max_item_tokens = max_item_tokens
        # the shortest item: a request needs max_new_tokens >= it + 1 (its EOS) to return any item
        self.min_item_tokens = (_shallowest_end(node_parent, is_end) if min_item_tokens is None
                                else min_item_tokens)
        self.vocab_size = vocab_size
        # Host-side [items given] int32: the i-th item given -> its rank in trie (depth-first) order,
        # what per-request filters index (catalogue/filters.py); None: items are named in trie order.
        self.source_items = source_items
        # [num_nodes - 1] parent * vocab + token of nodes 1.., strictly increasing
        self.child_keys = node_parent[1:] * vocab_size + node_token[1:]

    @property
    def num_nodes(self) -> int:
        return int(self.node_token.shape[0])

    @property
    def device(self) -> torch.device:
        return self.node_token.device

    @property
    def nbytes(self) -> int:
        """Device bytes of every tensor the catalogue holds."""
        tensors = (self.node_token, self.node_parent, self.child_start, self.is_end, self.child_keys)
        return sum(t.numel() * t.element_size() for t in tensors)

    def to(self, device: torch.device | str) -> Catalogue:
        if torch.device(device) == self.device:
            return self
        return Catalogue(self.node_token.to(device), self.node_parent.to(device), self.child_start.to(device),
                         self.is_end.to(device), self.num_items, self.max_item_tokens, self.vocab_size,
                         self.min_item_tokens, self.source_items)

    # -- building -------------------------------------------------------------------------------------
    @classmethod
    def from_sequences(cls, items: Iterable[Sequence[int]] | np.ndarray, vocab_size: int,
                       device: torch.device | str = "cpu") -> Catalogue:
        """Items as token-id sequences (a list of lists, or a [num_items, width] integer array whose
        rows are padded with -1); duplicates are kept once."""
        array = items if isinstance(items, np.ndarray) else _padded(items)
        if array.ndim != 2 or array.shape[0] == 0 or array.shape[1] == 0:
            raise CatalogueError("the catalogue is empty: give at least one item of at least one token")
        array = array.astype(np.int64, copy=False)
        lengths = (array != PAD).sum(axis=1)
        if (lengths == 0).any():
            raise CatalogueError(f"item {int(np.argmax(lengths == 0))} is empty")
        if ((array != PAD) & ((array < 0) | (array >= vocab_size))).any():
            row = int(np.argmax(((array != PAD) & ((array < 0) | (array >= vocab_size))).any(axis=1)))
            raise CatalogueError(f"item {row} holds a token id outside the vocabulary [0, {vocab_size})")
        # a padding cell before a real one would make a hole in an item
        if (np.diff((array != PAD).astype(np.int8), axis=1) > 0).any():
            raise CatalogueError("items must be padded at the end only (-1 after the last token)")
        # lexicographic order; padding (-1) sorts before every token, so a prefix item precedes its extensions
        order = np.lexsort(array.T[::-1])
        array, lengths = array[order], lengths[order]
        width = array.shape[1]
        # row differs from the one before in its first d tokens
        different = np.zeros(array.shape[0], dtype=bool)
        different[0] = True
        node_token = [np.zeros(1, dtype=np.int64)]
        node_parent = [np.zeros(1, dtype=np.int64)]
        row_node = np.zeros(array.shape[0], dtype=np.int64)  # each row's node at the previous depth
        is_end = [np.zeros(1, dtype=bool)]
        num_nodes = 1
        ends_at = lengths  # an item's last token is at depth == its length
        for depth in range(1, width + 1):
            column = array[:, depth - 1]
            valid = column != PAD
            different[1:] |= column[1:] != column[:-1]
            opens = valid & different
            new_ids = num_nodes + np.cumsum(opens) - 1  # the node a row's prefix of this depth opens
            # rows whose prefix of this depth exists already take the id of the row that opened it
            depth_node = np.where(opens, new_ids, 0)
            depth_node = np.maximum.accumulate(depth_node) * valid
            node_token.append(column[opens])
            node_parent.append(row_node[opens])
            ends = np.zeros(int(opens.sum()), dtype=bool)
            ending_nodes = depth_node[valid & (ends_at == depth)] - num_nodes
            ends[ending_nodes] = True
            is_end.append(ends)
            num_nodes += int(opens.sum())
            row_node = depth_node
        node_token_t = torch.from_numpy(np.concatenate(node_token))
        node_parent_t = torch.from_numpy(np.concatenate(node_parent))
        # children of p: nodes whose parent is p (nodes 1.. have non-decreasing parents)
        child_start = torch.searchsorted(node_parent_t[1:].contiguous(), torch.arange(num_nodes + 1)) + 1
        num_items = int(np.concatenate(is_end).sum())
        # sorted rows are the items in trie order, a duplicate right after its first copy
        source_items = np.empty(array.shape[0], dtype=np.int32)
        source_items[order] = np.cumsum(different) - 1
        return cls(node_token_t.to(device), node_parent_t.to(device), child_start.to(device),
                   torch.from_numpy(np.concatenate(is_end)).to(device), num_items, int(lengths.max()),
                   vocab_size, int(lengths.min()), source_items)

    # -- reading ----------------------------------------------------------------------------------------
    def children(self, node: int) -> list[int]:
        """Tokens allowed after `node` (tests and debugging; the hot path is tensor-only)."""
        start, end = int(self.child_start[node]), int(self.child_start[node + 1])
        return self.node_token[start:end].tolist()

    def child_nodes(self, nodes: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """The node reached from each `nodes[i]` by `token_ids[i]`; -1 where that is no child."""
        keys = nodes * self.vocab_size + token_ids
        # a catalogue has at least one item, so at least one key: the clamp never leaves it empty
        index = torch.searchsorted(self.child_keys, keys).clamp_(max=self.child_keys.shape[0] - 1)
        return torch.where(self.child_keys[index] == keys, index + 1, torch.full_like(index, -1))

    def contains(self, token_ids: Sequence[int]) -> bool:
        """Whether `token_ids` is an item (walks the trie; for tests and checks)."""
        node = 0
        for token in token_ids:
            nxt = int(self.child_nodes(torch.tensor([node], device=self.device),
                                       torch.tensor([token], device=self.device))[0])
            if nxt < 0:
                return False
            node = nxt
        return bool(self.is_end[node])


def _shallowest_end(node_parent: torch.Tensor, is_end: torch.Tensor) -> int:
    """The depth of the shallowest node that ends an item (a trie built without its lengths): nodes are
    breadth-first, so the first ending node is the shallowest; its depth is its chain of parents."""
    ends = torch.nonzero(is_end.cpu()).flatten()
    if ends.numel() == 0:
        return 0
    node, depth = int(ends[0]), 0
    parents = node_parent.cpu()
    while node != 0:
        node, depth = int(parents[node]), depth + 1
    return depth


def _padded(items: Iterable[Sequence[int]]) -> np.ndarray:
    rows = [list(item) for item in items]
    if not rows:
        raise CatalogueError("the catalogue is empty: give at least one item of at least one token")
    width = max(len(row) for row in rows)
    array = np.full((len(rows), max(width, 1)), PAD, dtype=np.int64)
    for i, row in enumerate(rows):
        for j, token in enumerate(row):
            if isinstance(token, bool) or not isinstance(token, (int, np.integer)):
                raise CatalogueError(f"item {i} holds {token!r}: token ids must be integers")
        array[i, :len(row)] = row
    return array
