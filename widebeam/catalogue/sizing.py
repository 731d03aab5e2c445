"""The catalogue's byte model: what a trie of so many nodes takes on the device, written once.

`Catalogue.nbytes` (trie.py) measures the tensors it holds; `widebeam plan` counts the same bytes
before any tensor exists, from a trie's node count (counted exactly from a file, catalogue/sources.py:
`trie_size`) or from its bound. Torch-free: `widebeam plan` imports it.
"""

from __future__ import annotations

from dataclasses import dataclass

# The trie's device tensors (widebeam/catalogue/trie.py), per node: node_token, node_parent and
# child_start (int64, one more entry), child_keys (int64, one fewer: nodes 1..) and is_end (bool).
CATALOGUE_BYTES_PER_NODE = 8 + 8 + 8 + 8 + 1


def catalogue_nbytes(num_nodes: int) -> int:
    """`Catalogue.nbytes` of a trie of `num_nodes` nodes (the root included): 33 bytes a node."""
    return CATALOGUE_BYTES_PER_NODE * num_nodes


def catalogue_node_bound(num_items: int, max_item_tokens: int) -> int:
    """At most one node per token of every item, plus the root (items sharing prefixes share nodes)."""
    return num_items * max_item_tokens + 1


@dataclass(frozen=True)
class CataloguePlan:
    """A start-up catalogue's size. `exact`: counted from its items (`widebeam plan --catalogue FILE`),
    else an estimate (the node bound from --catalogue-items and --catalogue-item-tokens) or bytes given."""

    nbytes: int
    num_items: int | None = None
    num_nodes: int | None = None
    max_item_tokens: int | None = None
    exact: bool = False
    upper_bound: bool = False  # nbytes is the bound for num_items x max_item_tokens (no prefix shared)

    @classmethod
    def counted(cls, tries: list[tuple[int, int, int]]) -> CataloguePlan:
        """The exact size of catalogues whose tries are counted (`trie_size`: items, nodes, longest
        item, one triple per catalogue), summed."""
        return cls(nbytes=sum(catalogue_nbytes(num_nodes) for _, num_nodes, _ in tries),
                   num_items=sum(num_items for num_items, _, _ in tries),
                   num_nodes=sum(num_nodes for _, num_nodes, _ in tries),
                   max_item_tokens=max((width for _, _, width in tries), default=0), exact=True)

    @classmethod
    def bounded(cls, num_items: int | None, max_item_tokens: int, nbytes: int | None = None) -> CataloguePlan:
        """An estimate without the items: the node bound of `num_items` x `max_item_tokens`, or the
        bytes given (`nbytes`, as measured: `Catalogue.nbytes`), which override it."""
        num_nodes = catalogue_node_bound(num_items, max_item_tokens) if num_items is not None else None
        return cls(nbytes=nbytes if nbytes is not None else catalogue_nbytes(num_nodes), num_items=num_items,
                   num_nodes=num_nodes, max_item_tokens=max_item_tokens, upper_bound=nbytes is None)

    def entry(self) -> dict:
        return {"bytes": self.nbytes, "num_items": self.num_items, "num_nodes": self.num_nodes,
                "max_item_tokens": self.max_item_tokens, "exact": self.exact, "upper_bound": self.upper_bound}
