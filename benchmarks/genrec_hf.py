"""transformers' side of benchmarks/genrec.py: a `prefix_allowed_tokens_fn` over widebeam's own trie,
so both engines are held to the same catalogue."""

from __future__ import annotations

import torch

from widebeam.catalogue.trie import Catalogue


def allowed_tokens_fn(catalogue: Catalogue, prompt_len: int, eos_ids: list[int]):
    """transformers' `prefix_allowed_tokens_fn` over the same trie: the children of the node the
    generated prefix reaches, plus EOS where that node ends an item (memoised per prefix)."""
    nodes: dict[tuple, int] = {(): 0}
    allowed: dict[tuple, list[int]] = {}

    def node_of(prefix: tuple) -> int:
        node = nodes.get(prefix)
        if node is None:
            parent = node_of(prefix[:-1])
            node = -1 if parent < 0 else int(catalogue.child_nodes(torch.tensor([parent]),
                                                                   torch.tensor([prefix[-1]]))[0])
            nodes[prefix] = node
        return node

    def fn(batch_id: int, input_ids: torch.Tensor) -> list[int]:
        prefix = tuple(input_ids[prompt_len:].tolist())
        result = allowed.get(prefix)
        if result is None:
            node = node_of(prefix)
            if node < 0:  # not reachable through this function; EOS ends it
                result = list(eos_ids)
            else:
                result = catalogue.children(node) + (list(eos_ids) if bool(catalogue.is_end[node]) else [])
                result = result or list(eos_ids)
            allowed[prefix] = result
        return result

    return fn
