"""Micro-benchmark of the filtered trie walk (issue #33): the catalogue constraint's allowed
(beam, token) pairs at one level, through the real `CatalogueConstraint`, with and without a
request's item filter, on a OneRec-shaped synthetic catalogue (3 codes per item, Zipf-popular
first code; the catalogue of benchmarks/genrec_onerec.py).

    python benchmarks/catalogue_filter_micro.py                     # 1M items, W=256, a 10% filter
    python benchmarks/catalogue_filter_micro.py --items 100000 --width 64 --repeats 20

Per level (the beams placed on the W nodes of that depth with the most children, as a wide search
reaches them): candidates (children of the beams' nodes), the unfiltered and filtered walk's median
time over the repeats (alternated, so drift favours neither), the ratio, and the filter's set-up
time (`ItemFilter`, once per request). Checks the filtered pairs against the unfiltered ones masked
by a brute-force "has an allowed item below" (exactly equal), so a faster walk cannot be a wrong one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch
from genrec_onerec import make_catalogue  # benchmarks/ is on sys.path as a script

from widebeam.catalogue.constraint import CatalogueConstraint
from widebeam.catalogue.filters import FilteredCatalogue, ItemFilter, node_item_ranges
from widebeam.catalogue.trie import Catalogue

EOS = 2


def level_nodes(catalogue: Catalogue, depth: int, width: int) -> torch.Tensor:
    """The `width` nodes at `depth` with the most children (ties: lowest id), in node order."""
    lo, hi = 0, 1
    for _ in range(depth):
        lo, hi = int(catalogue.child_start[lo]), int(catalogue.child_start[hi])
    nodes = torch.arange(lo, hi)
    counts = catalogue.child_start[nodes + 1] - catalogue.child_start[nodes]
    top = torch.topk(counts, min(width, nodes.shape[0]), sorted=False).indices
    return nodes[top.sort().values]


def brute_force(catalogue: Catalogue, allowed: np.ndarray, rows, tokens, nodes) -> tuple:
    """The unfiltered pairs kept where the child has an allowed item below it (EOS: where the item
    ending at the beam's node is allowed), from a plain prefix sum."""
    first, end = (t.numpy() for t in node_item_ranges(catalogue))
    before = np.concatenate(([0], np.cumsum(allowed)))
    keep = []
    for row, token in zip(rows.tolist(), tokens.tolist()):
        node = int(nodes[row])
        if token == EOS:
            keep.append(bool(allowed[first[node]]))
        else:
            child = int(catalogue.child_nodes(torch.tensor([node]), torch.tensor([token]))[0])
            keep.append(bool(before[end[child]] > before[first[child]]))
    keep = torch.tensor(keep, dtype=torch.bool)
    return rows[keep], tokens[keep]


def timed(constraint: CatalogueConstraint, num_rows: int, step: int) -> float:
    begin = time.perf_counter()
    constraint._allowed(num_rows, step)
    return time.perf_counter() - begin


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=1_000_000)
    parser.add_argument("--codes", type=int, default=8192, help="codes per level")
    parser.add_argument("--width", type=int, default=256, help="beams (nodes) per level")
    parser.add_argument("--fraction", type=float, default=0.1, help="the filter's share of the items")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: one busy thread)")
    parser.add_argument("--check-rows", type=int, default=2000,
                        help="pairs per level checked against the brute force (0: none)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    base_vocab = 3
    items = make_catalogue(args.items, base_vocab, args.codes, rng)
    catalogue = Catalogue.from_sequences(items, base_vocab + 3 * args.codes)
    node_item_ranges(catalogue)  # built once per catalogue, not per request
    allowed = np.zeros(catalogue.num_items, dtype=bool)
    allowed[rng.choice(catalogue.num_items, size=int(args.fraction * catalogue.num_items), replace=False)] = 1
    setups = []
    for _ in range(5):
        begin = time.perf_counter()
        item_filter = ItemFilter(catalogue, allowed)
        setups.append(time.perf_counter() - begin)
    filtered = FilteredCatalogue(catalogue, item_filter)
    print(json.dumps({"items": catalogue.num_items, "nodes": catalogue.num_nodes, "threads": args.threads,
                      "filter_setup_ms": round(1e3 * statistics.median(setups), 3),
                      "filter_bytes": item_filter.nbytes}), flush=True)
    max_new_tokens = 4  # 3 codes and EOS
    for depth in range(3):
        nodes = level_nodes(catalogue, depth, args.width)
        plain, masked = (CatalogueConstraint(c, [EOS], max_new_tokens) for c in (catalogue, filtered))
        plain.nodes, masked.nodes = nodes, nodes
        rows, tokens = plain._allowed(nodes.shape[0], depth)
        got = masked._allowed(nodes.shape[0], depth)
        if args.check_rows:
            pick = torch.from_numpy(np.sort(rng.choice(rows.shape[0], min(args.check_rows, rows.shape[0]),
                                                       replace=False)))
            want = brute_force(catalogue, allowed, rows[pick], tokens[pick], nodes)
            # the filtered pairs are the unfiltered ones, in order, less the dead: compare on the sample
            kept = {(int(r), int(t)) for r, t in zip(*got)}
            sample = [(int(r), int(t)) for r, t in zip(rows[pick], tokens[pick])]
            assert [p for p in sample if p in kept] == [(int(r), int(t)) for r, t in zip(*want)], depth
            order = {p: i for i, p in enumerate(zip(rows.tolist(), tokens.tolist()))}
            positions = [order[(int(r), int(t))] for r, t in zip(*got)]
            assert positions == sorted(positions), "the filtered pairs keep the unfiltered order"
        times = {"unfiltered": [], "filtered": []}
        for repeat in range(args.repeats):
            pair = [("unfiltered", plain), ("filtered", masked)]
            for name, constraint in pair if repeat % 2 == 0 else pair[::-1]:
                times[name].append(timed(constraint, nodes.shape[0], depth))
        unfiltered, filtered_s = (statistics.median(times[k]) for k in ("unfiltered", "filtered"))
        print(json.dumps({"depth": depth, "beams": int(nodes.shape[0]), "candidates": int(rows.shape[0]),
                          "kept": int(got[0].shape[0]), "unfiltered_ms": round(1e3 * unfiltered, 3),
                          "filtered_ms": round(1e3 * filtered_s, 3),
                          "ratio": round(filtered_s / unfiltered, 2)}), flush=True)


if __name__ == "__main__":
    main()
