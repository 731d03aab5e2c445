"""Per-request item filters over a registered catalogue, applied inside the trie walk.

Items in trie (depth-first, token) order are numbered 0 .. num_items - 1, and every trie node covers
a contiguous range of them, [node_first_item, node_end_item): its subtree's items, the one ending at
the node itself first (a prefix sorts before its extensions). A request's filter is then one
prefix count over its allowed items (`allowed_before(i)`: allowed items among the first i, read
from a bitmap and one running count per 64 items: 1.5 bits per item in all), and a
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
Per request: the bitmap and the running counts, 1.5 bits per item (`ItemFilter.nbytes`), freed
with the request.
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
    if catalogue.num_items >= 2**31 - _WORD_ITEMS:
        raise ValueError(f"item filters index items with int32: {catalogue.num_items} items is too many")
    ranges = (torch.from_numpy(first.astype(np.int32)).to(catalogue.device),
              torch.from_numpy((first + subtree).astype(np.int32)).to(catalogue.device))
    catalogue._item_ranges = ranges
    return ranges


_WORD_ITEMS = 64  # items per bitmap word, and per stored running count
_HAS_BITWISE_COUNT = hasattr(np, "bitwise_count")  # numpy >= 2.0: the CPU's popcount instruction


def _popcount64(words: torch.Tensor) -> torch.Tensor:
    """Set bits of each int64, with elementwise ops only (torch has no popcount): the SWAR sum of
    bit pairs, nibbles, bytes, then the bytes' total in the top byte. Two's complement wraps keep it
    exact for words with the top bit set (the masks drop every sign-extended bit)."""
    x = words - ((words >> 1) & 0x5555555555555555)
    x = (x & 0x3333333333333333) + ((x >> 2) & 0x3333333333333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F0F0F0F0F
    return (x * 0x0101010101010101) >> 56


class ItemFilter:
    """One request's allowed items of one catalogue: a bitmap (one bit per item, 64 to a word) and
    the allowed count before every word (one int32 per 64 items: half a bit per item), from which the
    walk reads "allowed items among the first i" with two gathers and a popcount.

    On CPU the walk runs in numpy over the same memory (zero-copy views): `np.bitwise_count` is the
    popcount instruction, and numpy's uint64 shifts and gathers are vectorised, where torch's int64
    shifts and products fall back to scalar code on AVX2 and its advanced-indexing gathers are slow
    (~4x the whole filtered level at 1M items; benchmarks/catalogue_filter_micro.py). Elsewhere
    (CUDA) the torch ops, with a SWAR popcount."""

    def __init__(self, catalogue: Catalogue, allowed: np.ndarray, use_numpy: bool | None = None):
        """`allowed`: [num_items] bool over trie items; `use_numpy`: the numpy walk (default: on CPU
        when numpy has `bitwise_count`; tests force either)."""
        self.first_item, self.end_item = node_item_ranges(catalogue)
        num_words = allowed.shape[0] // _WORD_ITEMS + 1  # room for i = num_items
        packed = np.zeros(num_words * 8, dtype=np.uint8)
        bits = np.packbits(allowed, bitorder="little")  # bit k of byte j: item 8j + k
        packed[:bits.shape[0]] = bits
        words = packed.view("<i8")  # bit k of word w: item 64w + k
        if _HAS_BITWISE_COUNT:
            counts = np.bitwise_count(words.view(np.uint64))
        else:
            counts = np.unpackbits(packed, bitorder="little").reshape(num_words, _WORD_ITEMS).sum(axis=1)
        before = np.zeros(num_words, dtype=np.int32)
        np.cumsum(counts[:-1], out=before[1:])
        device = catalogue.device
        self.words = torch.from_numpy(words.astype(np.int64)).to(device)
        self.word_before = torch.from_numpy(before).to(device)
        self.num_allowed_items = int(allowed.sum())
        if use_numpy is None:
            use_numpy = device.type == "cpu" and _HAS_BITWISE_COUNT
        self.use_numpy = use_numpy
        if use_numpy:  # views of the tensors above: no bytes of their own
            self._words = self.words.numpy().view(np.uint64)
            self._word_before = self.word_before.numpy()
            self._first_item, self._end_item = self.first_item.numpy(), self.end_item.numpy()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.words, self.word_before))

    def _allowed_before_np(self, index: np.ndarray) -> np.ndarray:
        """`allowed_before` in numpy, in place where it can be (each pass over 100k+ candidates counts);
        gathers by `np.take` with int64 indices (fancy indexing, or int32 indices, cost 2-4x)."""
        word = index.astype(np.int64) >> 6
        below = (index & 63).astype(np.uint64)
        np.left_shift(np.uint64(1), below, out=below)
        below -= np.uint64(1)  # the bits of the items before index in its word
        below &= np.take(self._words, word)
        before = np.take(self._word_before, word)
        before += np.bitwise_count(below)
        return before

    def allowed_before(self, index: torch.Tensor) -> torch.Tensor:
        """[n] allowed items among the first `index[j]` items (index in [0, num_items])."""
        if self.use_numpy:
            return torch.from_numpy(self._allowed_before_np(index.numpy()))
        word = index >> 6
        below = (torch.ones_like(index, dtype=torch.int64) << (index & 63)) - 1  # bits before index
        return self.word_before.index_select(0, word) + _popcount64(self.words.index_select(0, word) & below)

    def live(self, nodes: torch.Tensor) -> torch.Tensor:
        """[n] bool: whether each node has an allowed item in its subtree."""
        return (self.allowed_before(self.end_item.index_select(0, nodes))
                > self.allowed_before(self.first_item.index_select(0, nodes)))

    def live_children(self, children: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """`live(children)` for the children of several nodes laid end to end, `counts[r]` of the
        r-th: siblings are consecutive nodes whose item ranges abut (a child's end is the next one's
        first), so one count per child plus one per node's last child does (half the reads)."""
        if children.numel() == 0:
            return torch.zeros(0, dtype=torch.bool, device=children.device)
        last = (torch.cumsum(counts, 0) - 1)[counts > 0]  # each node's last child, in `children`
        if self.use_numpy:
            kids = children.numpy()
            starts = self._allowed_before_np(np.take(self._first_item, kids))
            ends = np.empty_like(starts)
            ends[:-1] = starts[1:]
            last_np = last.numpy()
            ends[last_np] = self._allowed_before_np(np.take(self._end_item, np.take(kids, last_np)))
            return torch.from_numpy(ends > starts)
        starts = self.allowed_before(self.first_item.index_select(0, children))
        ends = torch.cat((starts[1:], starts[:1]))
        ends[last] = self.allowed_before(self.end_item.index_select(0, children.index_select(0, last)))
        return ends > starts

    def live_indices(self, children: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """[num live] int64: the positions in `children` of the live ones (`live_children`), in order
        (numpy's nonzero: ~5x torch's on CPU)."""
        live = self.live_children(children, counts)
        if self.use_numpy:
            return torch.from_numpy(np.flatnonzero(live.numpy()))
        return torch.nonzero(live).squeeze(1)

    def ends_allowed(self, nodes: torch.Tensor) -> torch.Tensor:
        """[n] bool: whether the item ending at each node (its range's first) is allowed; only
        meaningful where the node ends an item."""
        first = self.first_item.index_select(0, nodes).to(torch.int64)
        return ((self.words.index_select(0, first >> 6) >> (first & 63)) & 1).bool()


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
