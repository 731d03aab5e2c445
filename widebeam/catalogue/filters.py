"""Per-request item filters over a registered catalogue, applied inside the trie walk.

Items in trie (depth-first, token) order are numbered 0 .. num_items - 1, and every trie node covers
a contiguous range of them, [node_first_item, node_end_item): its subtree's items, the one ending at
the node itself first (a prefix sorts before its extensions). A request's filter is then one
prefix count over its allowed items (`allowed_before(i)`: allowed items among the first i, read
from a bitmap and one running count per 32 items: two bits per item in all), and a
node has an allowed item below it exactly when `allowed_before[end] - allowed_before[first] > 0`:
a few gathers per candidate child, for all beams at once. The constraint drops every child with none
(so no beam ever enters a branch with no allowed item below it) and the end-of-sequence token where
the item ending at the node is not allowed; a filter that leaves fewer items than beams returns
fewer results, never an item outside it.

Item indices are the caller's: for a catalogue built from a list, array or file, the i-th item given
(duplicates share one trie item); for a prebuilt `Catalogue`, the trie order itself. The node ranges
are built once per catalogue, on the first filtered request (two int32 per node), and the source
index -> trie item map (one int32 per item given) when the catalogue is built; neither is in
`Catalogue.nbytes` (what the start-up layout sizes), both are in `LLMEngine.stats()["catalogue_filters"]`.
Per request: the bitmap and the running counts, about two bits per item (`ItemFilter.nbytes`),
freed with the request.
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


_POPCOUNT = np.array([b.bit_count() for b in range(256)], dtype=np.int32)
_GROUP_ITEMS = 32  # items per stored running count: one int32 per 32 items, one more bit per item


class ItemFilter:
    """One request's allowed items of one catalogue: a bitmap (one bit per item) and the allowed
    count before every group of 32 items (one int32 per group: one more bit per item), from which
    the walk reads "allowed items among the first i" with a few gathers."""

    def __init__(self, catalogue: Catalogue, allowed: np.ndarray):
        """`allowed`: [num_items] bool over trie items."""
        self.first_item, self.end_item = node_item_ranges(catalogue)
        packed = np.packbits(allowed, bitorder="little")  # bit k of byte j: item 8j + k
        num_groups = -(-allowed.shape[0] // _GROUP_ITEMS)
        padded = np.zeros(num_groups * 4 + 4, dtype=np.uint8)  # room for i = num_items
        padded[:packed.shape[0]] = packed
        group_counts = _POPCOUNT[padded[:num_groups * 4]].reshape(num_groups, 4).sum(axis=1)
        before = np.zeros(num_groups + 1, dtype=np.int32)
        np.cumsum(group_counts, out=before[1:])
        device = catalogue.device
        self.bits = torch.from_numpy(padded).to(device)
        self.group_before = torch.from_numpy(before).to(device)
        self.popcount = torch.from_numpy(_POPCOUNT).to(device)
        self.num_allowed_items = int(before[-1])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.bits, self.group_before))

    def allowed_before(self, index: torch.Tensor) -> torch.Tensor:
        """[n] allowed items among the first `index[j]` items (index in [0, num_items])."""
        group = index // _GROUP_ITEMS
        byte = index // 8
        total = self.group_before[group]
        for k in range(_GROUP_ITEMS // 8 - 1):  # whole bytes of the group before index's byte
            at = group * (_GROUP_ITEMS // 8) + k
            total = total + torch.where(at < byte, self.popcount[self.bits[at].long()], 0)
        partial = self.bits[byte].long() & ((1 << (index % 8)) - 1)
        return total + self.popcount[partial]

    def live(self, nodes: torch.Tensor) -> torch.Tensor:
        """[n] bool: whether each node has an allowed item in its subtree."""
        return (self.allowed_before(self.end_item[nodes].long())
                > self.allowed_before(self.first_item[nodes].long()))

    def ends_allowed(self, nodes: torch.Tensor) -> torch.Tensor:
        """[n] bool: whether the item ending at each node (its range's first) is allowed; only
        meaningful where the node ends an item."""
        first = self.first_item[nodes].long()
        return ((self.bits[first // 8].long() >> (first % 8)) & 1).bool()


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
