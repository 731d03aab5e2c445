"""The catalogue's byte model (catalogue/sizing.py) is the trie's own: what `widebeam plan` counts
for a catalogue is `Catalogue.nbytes` of the trie the engine builds, and the model stays torch-free."""

from __future__ import annotations

import subprocess
import sys

import pytest

from widebeam.catalogue.sizing import CataloguePlan, catalogue_nbytes, catalogue_node_bound
from widebeam.catalogue.sources import trie_size

ITEMS = [[1, 2, 3], [1, 2, 4], [5, 6], [7, 8, 9, 10]]


def test_the_byte_model_is_the_tries_nbytes():
    from widebeam.catalogue.trie import Catalogue

    catalogue = Catalogue.from_sequences(ITEMS, 16)
    num_items, num_nodes, width = trie_size(ITEMS)
    assert (num_items, num_nodes, width) == (catalogue.num_items, catalogue.num_nodes, 4)
    assert catalogue_nbytes(num_nodes) == catalogue.nbytes


def test_counted_catalogues_add_up():
    first, second = trie_size(ITEMS), trie_size([[3, 3, 3, 3, 3, 3]])
    both = CataloguePlan.counted([first, second])
    assert both == CataloguePlan(nbytes=catalogue_nbytes(first[1]) + catalogue_nbytes(second[1]),
                                 num_items=5, num_nodes=first[1] + second[1], max_item_tokens=6, exact=True)


@pytest.mark.parametrize("num_items, nbytes", [(1000, None), (1000, 5 << 20), (None, 5 << 20)])
def test_bounded_catalogues(num_items, nbytes):
    plan = CataloguePlan.bounded(num_items, 4, nbytes)
    num_nodes = catalogue_node_bound(num_items, 4) if num_items is not None else None
    assert plan.num_nodes == num_nodes and plan.upper_bound == (nbytes is None)
    assert plan.nbytes == (nbytes if nbytes is not None else 33 * (num_items * 4 + 1))


def test_plan_and_its_command_stay_torch_free():
    code = ("import sys, widebeam.catalogue.sizing, widebeam.plan, widebeam.plan_cli\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.strip() == "False", out.stderr
