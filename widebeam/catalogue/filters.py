"""Per-request item filters over a registered catalogue, applied inside the trie walk.

Items in trie (depth-first, token) order are numbered 0 .. num_items - 1, and every trie node covers
a contiguous range of them, [node_first_item, node_end_item): its subtree's items, the one ending at
the node itself first (a prefix sorts before its extensions). A request's filter is then one
prefix sum over its allowed items (`allowed_before[i]`: allowed items among the first i), and a
node has an allowed item below it exactly when `allowed_before[end] - allowed_before[first] > 0`:
one gather per candidate child, for all beams at once. The constraint drops every child with none
(so no beam ever enters a branch with no allowed item below it) and the end-of-sequence token where
the item ending at the node is not allowed; a filter that leaves fewer items than beams returns
fewer results, never an item outside it.

Item indices are the caller's: for a catalogue built from a list, array or file, the i-th item given
(duplicates share one trie item); for a prebuilt `Catalogue`, the trie order itself. The node ranges
are built once per catalogue, on the first filtered request (two int32 per node), and the source
index -> trie item map (one int32 per item given) when the catalogue is built; neither is in
`Catalogue.nbytes` (what the start-up layout sizes), both are in `LLMEngine.stats()["catalogue_filters"]`.
Per request: the prefix sum, int32 per item + 1 (`ItemFilter.nbytes`), freed with the request.
"""

from __future__ import annotations

import numpy as np
import torch

from widebeam.catalogue.trie import Catalogue


def node_item_ranges(catalogue: Catalogue) -> tuple[torch.Tensor, torch.Tensor]:
    """([num_nodes] first item, [num_nodes] end item) of every node's subtree, in trie item order;
    computed from the trie alone (breadth-first nodes, contiguous children), level by level."""
    cached = getattr(catalogue, "_item_ranges", None)
    if cached is not None:
        return cached
    child_start = catalogue.child_start.cpu().numpy()
    parent = catalogue.node_parent.cpu().numpy()
    is_end = catalogue.is_end.cpu().numpy().astype(np.int64)
    num_nodes = parent.shape[0]
    levels = [(0, 1)]  # breadth-first: each depth's nodes are one contiguous range
    while True:
        lo, hi = levels[-1]
        nxt = (int(child_start[lo]), int(child_start[hi]))
        if nxt[0] >= nxt[1]:
            break
        levels.append(nxt)
    subtree = is_end.copy()  # items in each node's subtree, bottom-up
    for lo, hi in reversed(levels[1:]):
        np.add.at(subtree, parent[lo:hi], subtree[lo:hi])
    first = np.zeros(num_nodes, dtype=np.int64)
    for lo, hi in levels[1:]:
        # a child starts after its parent's own item and its earlier siblings' subtrees
        counts = subtree[lo:hi]
        before = np.cumsum(counts) - counts  # exclusive running sum over the level
        group_start = child_start[parent[lo:hi]] - lo  # each child's first sibling, within the level
        first[lo:hi] = first[parent[lo:hi]] + is_end[parent[lo:hi]] + before - before[group_start]
    ranges = (torch.from_numpy(first.astype(np.int32)).to(catalogue.device),
              torch.from_numpy((first + subtree).astype(np.int32)).to(catalogue.device))
    catalogue._item_ranges = ranges
    return ranges


class ItemFilter:
    """One request's allowed items of one catalogue, as the prefix sum the walk reads."""

    def __init__(self, catalogue: Catalogue, allowed: np.ndarray):
        """`allowed`: [num_items] bool over trie items."""
        self.first_item, self.end_item = node_item_ranges(catalogue)
        counts = np.zeros(allowed.shape[0] + 1, dtype=np.int32)
        np.cumsum(allowed, out=counts[1:])
        self.allowed_before = torch.from_numpy(counts).to(catalogue.device)
        self.num_allowed_items = int(counts[-1])

    @property
    def nbytes(self) -> int:
        return self.allowed_before.numel() * self.allowed_before.element_size()

    def live(self, nodes: torch.Tensor) -> torch.Tensor:
        """[n] bool: whether each node has an allowed item in its subtree."""
        before = self.allowed_before
        return before[self.end_item[nodes].long()] > before[self.first_item[nodes].long()]

    def ends_allowed(self, nodes: torch.Tensor) -> torch.Tensor:
        """[n] bool: whether the item ending at each node (its range's first) is allowed; only
        meaningful where the node ends an item."""
        first = self.first_item[nodes].long()
        return self.allowed_before[first + 1] > self.allowed_before[first]


class FilteredCatalogue(Catalogue):
    """A catalogue's trie (its tensors shared, nothing copied) with one request's `item_filter`."""

    def __init__(self, catalogue: Catalogue, item_filter: ItemFilter):
        super().__init__(catalogue.node_token, catalogue.node_parent, catalogue.child_start, catalogue.is_end,
                         catalogue.num_items, catalogue.max_item_tokens, catalogue.vocab_size,
                         catalogue.min_item_tokens)
        self.item_filter = item_filter
        self.source_items = catalogue.source_items


def filter_stats(live: list[ItemFilter], catalogues) -> dict:
    """The live requests' filters and their bytes, and the registered catalogues' filter index bytes
    (node ranges once built, the source -> trie item map)."""
    index = 0
    for catalogue in catalogues.values():
        ranges = getattr(catalogue, "_item_ranges", None)
        if ranges is not None:
            index += sum(t.numel() * t.element_size() for t in ranges)
        if catalogue.source_items is not None:
            index += catalogue.source_items.nbytes
    return {"live_filters": len(live), "filter_bytes": sum(f.nbytes for f in live), "index_bytes": index}
