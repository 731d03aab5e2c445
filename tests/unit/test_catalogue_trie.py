"""The catalogue trie and its constraint, checked against a plain Python set of items: every node's
children and ends, child lookup for many beams at once, the masks (children, EOS at item ends, EOS
only on the last step), and the per-beam state following reorders and drops."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from widebeam.catalogue.constraint import CatalogueConstraint
from widebeam.catalogue.trie import Catalogue, CatalogueError
from widebeam.decoding.context import TokenHistory

VOCAB = 12
EOS = 0
items_strategy = st.lists(st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=5), min_size=1,
                          max_size=40)


def reference(items):
    children, ends = {}, set()
    for item in items:
        for i in range(len(item)):
            children.setdefault(tuple(item[:i]), set()).add(item[i])
        ends.add(tuple(item))
    return children, ends


def walk(catalogue, prefix):
    node = 0
    for token in prefix:
        node = int(catalogue.child_nodes(torch.tensor([node]), torch.tensor([token]))[0])
        if node < 0:
            return -1
    return node


@settings(max_examples=200, deadline=None)
@given(items_strategy)
def test_every_prefix_has_the_reference_children_and_ends(items):
    catalogue = Catalogue.from_sequences(items, VOCAB)
    children, ends = reference(items)
    assert catalogue.num_items == len(ends)
    assert catalogue.num_nodes == 1 + len({tuple(item[:i])
                                           for item in items for i in range(1, len(item) + 1)})
    for prefix, allowed in children.items():
        node = walk(catalogue, prefix)
        assert node >= 0 and catalogue.children(node) == sorted(allowed)
        assert bool(catalogue.is_end[node]) == (prefix in ends)
    for item in items:
        assert catalogue.contains(item)
        assert not catalogue.contains(list(item) + [VOCAB - 1]) or tuple(item) + (VOCAB - 1,) in ends


def test_a_padded_array_builds_the_same_trie():
    items = [[3, 4, 5], [3, 4], [7]]
    array = np.array([[3, 4, 5], [3, 4, -1], [7, -1, -1]])
    a, b = Catalogue.from_sequences(items, VOCAB), Catalogue.from_sequences(array, VOCAB)
    for name in ("node_token", "node_parent", "child_start", "is_end"):
        assert torch.equal(getattr(a, name), getattr(b, name))
    assert a.nbytes == b.nbytes > 0 and a.max_item_tokens == 3


@pytest.mark.parametrize(("items", "message"), [
    ([], "empty"), ([[]], "item 0 is empty"), ([[1], [VOCAB]], "outside the vocabulary"),
    ([[1, "a"]], "integers"), (np.array([[1, -1, 2]]), "padded at the end"),
])
def test_malformed_catalogues_say_what_is_wrong(items, message):
    with pytest.raises(CatalogueError, match=message):
        Catalogue.from_sequences(items, VOCAB)


def allowed_sets(scores):
    return [set(torch.nonzero(torch.isfinite(row)).flatten().tolist()) for row in scores]


def test_the_constraint_masks_children_and_eos_at_ends_and_follows_the_beams():
    items = [[3, 4], [3, 4, 5], [3, 6], [7]]
    catalogue = Catalogue.from_sequences(items, VOCAB)
    constraint = CatalogueConstraint(catalogue, [EOS], max_new_tokens=4)
    history = TokenHistory([1])  # the decoder's: the constraint reads the moves of each step's context
    cpu = torch.device("cpu")
    scores = torch.randn(1, VOCAB)
    kept = scores.clone()
    constraint.process(scores, history.context(1, 0, cpu))
    assert allowed_sets(scores) == [{3, 7}]
    assert torch.equal(scores[0, [3, 7]], kept[0, [3, 7]])  # allowed scores untouched
    history.move([0, 0], [3, 7])  # two beams from the prompt
    scores = torch.randn(2, VOCAB)
    constraint.process(scores, history.context(2, 1, cpu))
    assert allowed_sets(scores) == [{4, 6}, {EOS}]
    history.move([0, 0], [4, 6])
    scores = torch.randn(2, VOCAB)
    context = history.context(2, 2, cpu)
    constraint.process(scores, context)
    assert allowed_sets(scores) == [{5, EOS}, {EOS}]
    constraint.process(scores, context)  # the same step asked twice: its moves apply once
    assert allowed_sets(scores) == [{5, EOS}, {EOS}]
    history.move([0, 0], [5, 5])  # both continue [3, 4] with 5 (as a step with two EOS ids could)
    history.keep([1])  # beam 0 finished on a stop string
    assert constraint.nodes is not None and constraint.nodes.shape[0] == 2  # moved on the next context
    scores = torch.randn(1, VOCAB)
    constraint.process(scores, history.context(1, 3, cpu))  # the last step: EOS only, never an item cut short
    assert allowed_sets(scores) == [{EOS}]


def test_masks_for_many_beams_match_the_reference():
    rng = random.Random(0)
    items = [[rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 4))] for _ in range(60)]
    catalogue = Catalogue.from_sequences(items, VOCAB)
    children, ends = reference(items)
    prefixes = rng.sample(sorted(children), min(25, len(children)))
    constraint = CatalogueConstraint(catalogue, [EOS], max_new_tokens=10)
    constraint.nodes = torch.tensor([walk(catalogue, p) for p in prefixes])
    scores = torch.randn(len(prefixes), VOCAB)
    constraint.process(scores, TokenHistory([]).context(len(prefixes), 1, torch.device("cpu")))
    assert allowed_sets(scores) == [children[p] | ({EOS} if p in ends else set()) for p in prefixes]
