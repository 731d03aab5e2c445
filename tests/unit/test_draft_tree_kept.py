"""Which accepted drafted nodes keep their K/V after a round (`DraftTree.num_kept`): the leading path
nodes sitting where fed tokens would (node j at depth j + 1), never the path's last token, and with a
draft model only nodes it was fed (every level but the deepest)."""

from __future__ import annotations

import pytest

from widebeam.speculative.tree import ROOT, DraftTree


def chain(tokens):
    tree, parent = DraftTree(), ROOT
    for token in tokens:
        parent = tree.add(parent, token)
    return tree


def wide():  # W > 4 with D = 4: the root's four best children, one level
    tree = DraftTree()
    for token in (10, 11, 12, 13):
        tree.add(ROOT, token)
    return tree


def two_way():  # W <= 4: two children of the root, then one below the first
    tree = DraftTree()
    first = tree.add(ROOT, 10)
    tree.add(ROOT, 11)
    tree.add(first, 20)  # node 2, at depth 2: not where the second fed token would sit (node 1 is)
    return tree


@pytest.mark.parametrize(("tree", "path", "draft_fed", "kept"), [
    (chain([1, 2, 3, 4]), [1, 2, 3, 4, 5], False, 4),  # all accepted, the bonus token fed next
    (chain([1, 2, 3, 4]), [1, 2, 3, 4, 5], True, 3),  # the draft never fed its deepest node
    (chain([1, 2, 3, 4]), [1, 2, 9], False, 2),  # left the chain after two
    (chain([1, 2, 3, 4]), [7], False, 0),  # nothing accepted
    (wide(), [10, 99], False, 1),
    (wide(), [10, 99], True, 0),  # a one-level tree: the draft fed none of it
    (wide(), [11, 99], False, 0),  # node 1 sits at depth 1, where the first fed token would not
    (two_way(), [10, 20, 99], False, 1),  # node 2 is below node 0 but not at index 1
    (two_way(), [10, 20, 99], True, 1),
])
def test_kept_nodes(tree, path, draft_fed, kept):
    assert tree.num_kept(path, draft_fed) == kept
