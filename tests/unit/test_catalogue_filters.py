"""Per-request item filters over a registered catalogue (widebeam/catalogue/filters.py): every
node's item range against a brute-force walk; through the engine on a tiny model, no returned item
outside the filter, results equal to registering the filtered items as a catalogue of their own and
searching that, an exhausted filter returning fewer results, named subsets, excluded items, the
per-request memory in stats(), and errors naming the parameter."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from widebeam.catalogue.filters import node_item_ranges
from widebeam.catalogue.trie import Catalogue
from widebeam.errors import InvalidParameterError
from widebeam.llm import LLM
from widebeam.params import BeamSearchParams

EOS = 2


def random_items(rng, num_items, vocab=128, lengths=(2, 3, 4)):
    return [list(rng.integers(3, vocab, size=int(rng.choice(lengths)))) for _ in range(num_items)]


@pytest.mark.parametrize("seed", range(5))
def test_node_ranges_cover_exactly_the_items_below(seed):
    rng = np.random.default_rng(seed)
    items = random_items(rng, 200, vocab=12, lengths=(1, 2, 3, 4))
    items += items[:10]  # duplicates share one trie item
    catalogue = Catalogue.from_sequences(items, 12)
    first, end = node_item_ranges(catalogue)
    # trie items in order: the distinct items sorted
    distinct = sorted({tuple(int(t) for t in item) for item in items})
    assert catalogue.num_items == len(distinct)
    for i, item in enumerate(items):
        assert distinct[catalogue.source_items[i]] == tuple(int(t) for t in item)

    def path(node):
        tokens = []
        while node:
            tokens.append(int(catalogue.node_token[node]))
            node = int(catalogue.node_parent[node])
        return tuple(reversed(tokens))

    for node in range(catalogue.num_nodes):
        prefix = path(node)
        below = [k for k, item in enumerate(distinct) if item[:len(prefix)] == prefix]
        assert list(range(int(first[node]), int(end[node]))) == below
        if catalogue.is_end[node]:
            assert distinct[int(first[node])] == prefix


@pytest.fixture(scope="module")
def setup(tiny_llama_dir):
    rng = np.random.default_rng(0)
    items = random_items(rng, 400)
    subset = sorted(rng.choice(len(items), size=40, replace=False).tolist())
    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", kv_cache_memory="8MiB", max_beam_width=16)
    llm.register_catalogue("shop", items, subsets={"store_17": subset, "tiny": subset[:3]})
    return llm, items, subset


def beams(output):
    return [(b.token_ids[:-1], b.score) for b in output.outputs]


def test_filtered_search_equals_searching_the_filtered_catalogue(setup):
    llm, items, _subset = setup
    rng = np.random.default_rng(1)
    prompts = [{"prompt_token_ids": rng.integers(3, 128, size=6).tolist()} for _ in range(6)]
    allowed_sets = [sorted(rng.choice(len(items), size=40, replace=False).tolist()) for _ in prompts]
    for prompt, allowed in zip(prompts, allowed_sets):
        llm.register_catalogue("sub", [items[i] for i in allowed])
        (filtered,) = llm.generate([prompt], BeamSearchParams(beam_width=8, catalogue="shop",
                                                              allowed_items=allowed), use_tqdm=False)
        (sub,) = llm.generate([prompt], BeamSearchParams(beam_width=8, catalogue="sub"), use_tqdm=False)
        allowed_items = {tuple(items[i]) for i in allowed}
        assert len(filtered.outputs) == 8
        for tokens, _ in beams(filtered):
            assert tuple(tokens) in allowed_items
        got, want = beams(filtered), beams(sub)
        assert [t for t, _ in got] == [t for t, _ in want]
        for (_, a), (_, b) in zip(got, want):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-5)


def test_no_item_outside_the_filter_over_many_requests(setup):
    llm, items, subset = setup
    rng = np.random.default_rng(2)
    prompts = [{"prompt_token_ids": rng.integers(3, 128, size=5).tolist()} for _ in range(20)]
    outputs = llm.generate(prompts, BeamSearchParams(beam_width=16, catalogue="shop",
                                                     catalogue_subset="store_17"), use_tqdm=False)
    allowed = {tuple(items[i]) for i in subset}
    returned = [tuple(b.token_ids[:-1]) for out in outputs for b in out.outputs]
    assert len(returned) == 20 * 16 and all(item in allowed for item in returned)
    # and unfiltered, most of them would have come from elsewhere: the filter is what kept them inside
    (free,) = llm.generate(prompts[:1], BeamSearchParams(beam_width=16, catalogue="shop"), use_tqdm=False)
    assert sum(tuple(b.token_ids[:-1]) not in allowed for b in free.outputs) >= 8


def test_exhausted_filter_returns_fewer_and_only_allowed(setup):
    llm, items, subset = setup
    prompt = {"prompt_token_ids": [5, 9, 33]}
    (out,) = llm.generate([prompt], BeamSearchParams(beam_width=8, catalogue="shop", catalogue_subset="tiny"),
                          use_tqdm=False)
    assert sorted(tuple(b.token_ids[:-1]) for b in out.outputs) == sorted(tuple(items[i]) for i in subset[:3])


def first_tokens(items, indices) -> list[int]:
    return sorted({int(items[i][0]) for i in indices})


@pytest.mark.parametrize("case", ["allowed empty", "excluded all", "subset disjoint", "first codes banned",
                                  "allowed items' tokens banned", "subset's first codes banned"])
def test_a_filter_or_ban_that_leaves_no_item_is_refused_naming_the_field(setup, case):
    """Known at admission, so never an empty answer: the field that emptied the items is named, with
    what would do, and nothing is queued."""
    llm, items, subset = setup
    outside = [i for i in range(len(items)) if i not in set(subset)]
    kwargs, param, says = {
        "allowed empty": ({"allowed_items": []}, "allowed_items",
                          f"allowed_items is empty: list at least one item index in [0, {len(items)})"),
        "excluded all": ({"excluded_items": list(range(len(items)))}, "excluded_items",
                         "excluded_items excludes every item of the catalogue"),
        "subset disjoint": ({"catalogue_subset": "store_17", "allowed_items": outside[:5]}, "allowed_items",
                            "allowed_items and catalogue_subset 'store_17' share no item"),
        "first codes banned": ({"bad_words_ids": [[t] for t in first_tokens(items, range(len(items)))]},
                               "bad_words_ids", "bad_words_ids bans a token of every item of the catalogue"),
        # the items' last tokens: the first codes stay open, yet no item can end
        "allowed items' tokens banned": ({"allowed_items": subset[:2],
                                          "bad_words_ids": [[int(items[i][-1])] for i in subset[:2]]},
                                         "bad_words_ids", "every item that allowed_items allow"),
        "subset's first codes banned": ({"catalogue_subset": "tiny",
                                         "bad_words_ids": [[t] for t in first_tokens(items, subset[:3])]},
                                        "bad_words_ids", "every item that catalogue_subset allow"),
    }[case]
    engine = llm.engine
    rejected = engine.stats()["rejected"]
    with pytest.raises(InvalidParameterError) as error:
        engine.add_request(f"empty-{case}", {"prompt_token_ids": [5, 9, 33]},
                           BeamSearchParams(beam_width=4, catalogue="shop", **kwargs))
    assert error.value.param == param and says in str(error.value), str(error.value)
    assert not engine.has_unfinished() and engine.stats()["rejected"] == rejected + 1
    # one item left open is enough: the same request with that item's tokens unbanned runs
    if case in ("first codes banned", "allowed items' tokens banned"):
        open_item = {int(t) for t in items[subset[0]]}
        kept = [w for w in kwargs["bad_words_ids"] if w[0] not in open_item]
        (out,) = llm.generate([{"prompt_token_ids": [5, 9, 33]}],
                              BeamSearchParams(beam_width=4, catalogue="shop",
                                               **{**kwargs, "bad_words_ids": kept}), use_tqdm=False)
        assert out.outputs and all(b.finish_reason == "stop" for b in out.outputs)
        assert not any(t in {w[0] for w in kept} for b in out.outputs for t in b.token_ids)


def test_a_subset_and_allowed_items_together_allow_only_their_intersection(setup):
    """Both filters apply: the answer is the one for their intersection given as `allowed_items`, and
    differs from either filter alone (so a search honouring one of them fails here)."""
    llm, items, subset = setup
    rng = np.random.default_rng(5)
    outside = [i for i in range(len(items)) if i not in set(subset)]
    inside = subset[::2]  # half the subset, and as many items outside it
    allowed = sorted(inside + rng.choice(outside, size=len(inside), replace=False).tolist())
    intersection = sorted(set(allowed) & set(subset))
    base = BeamSearchParams(beam_width=8, catalogue="shop")
    changed_subset = changed_allowed = False
    for seed in range(4):
        prompt = {"prompt_token_ids": np.random.default_rng(seed).integers(3, 128, size=6).tolist()}
        (both,) = llm.generate([prompt], base.replace(catalogue_subset="store_17", allowed_items=allowed),
                               use_tqdm=False)
        (want,) = llm.generate([prompt], base.replace(allowed_items=intersection), use_tqdm=False)
        assert [t for t, _ in beams(both)] == [t for t, _ in beams(want)]
        assert {tuple(t) for t, _ in beams(both)} <= {tuple(items[i]) for i in intersection}
        (only_subset,) = llm.generate([prompt], base.replace(catalogue_subset="store_17"), use_tqdm=False)
        (only_allowed,) = llm.generate([prompt], base.replace(allowed_items=allowed), use_tqdm=False)
        changed_subset |= beams(only_subset) != beams(both)
        changed_allowed |= beams(only_allowed) != beams(both)
    assert changed_subset and changed_allowed, "each filter alone gives the same answer: nothing is tested"


def test_excluded_items_are_the_complement(setup):
    llm, items, subset = setup
    prompt = {"prompt_token_ids": [7, 7, 40, 41]}
    rest = [i for i in range(len(items)) if i not in set(subset)]
    params = BeamSearchParams(beam_width=8, catalogue="shop")
    (excluded,) = llm.generate([prompt], params.replace(excluded_items=rest), use_tqdm=False)
    (allowed,) = llm.generate([prompt], params.replace(allowed_items=subset), use_tqdm=False)
    assert beams(excluded) == beams(allowed)


def test_filter_memory_is_in_stats_while_the_request_lives(setup):
    llm, _items, _subset = setup
    engine = llm.engine
    engine.add_request("f", {"prompt_token_ids": [5, 6]},
                       BeamSearchParams(beam_width=4, catalogue="shop", catalogue_subset="store_17"))
    stats = engine.stats()["catalogue_filters"]
    num_items = engine.catalogues["shop"].num_items
    # a bitmap and one int32 per 64 items: 1.5 bits per item, and one more word of padding
    assert stats["live_filters"] == 1
    assert num_items * 3 / 16 <= stats["filter_bytes"] <= num_items * 3 / 16 + 24
    assert stats["index_bytes"] > 0
    while engine.has_unfinished():
        engine.step()
    assert engine.stats()["catalogue_filters"] == {**stats, "live_filters": 0, "filter_bytes": 0}


@pytest.mark.parametrize("kwargs, param", [
    ({"allowed_items": [1, 2]}, "allowed_items"),
    ({"catalogue": "shop", "allowed_items": [1, -2]}, "allowed_items"),
    ({"catalogue": "shop", "excluded_items": ["a"]}, "excluded_items"),
    ({"catalogue_subset": "store_17"}, "catalogue_subset"),
])
def test_param_errors_name_the_parameter(kwargs, param):
    with pytest.raises(InvalidParameterError) as error:
        BeamSearchParams(**kwargs)
    assert error.value.param == param


@pytest.mark.parametrize("kwargs, param", [
    ({"allowed_items": [400]}, "allowed_items"),
    ({"excluded_items": [10**6]}, "excluded_items"),
    ({"catalogue_subset": "store_99"}, "catalogue_subset"),
])
def test_engine_errors_name_the_parameter(setup, kwargs, param):
    llm = setup[0]
    with pytest.raises(InvalidParameterError) as error:
        llm.generate([{"prompt_token_ids": [5]}], BeamSearchParams(catalogue="shop", **kwargs),
                     use_tqdm=False)
    assert error.value.param == param


def test_http_filter_fields_reach_the_engine():
    from widebeam.server.protocol import plan_request
    from widebeam.server.schemas import ApiError, CompletionRequest

    plan = plan_request(CompletionRequest(prompt="x", use_beam_search=True, n=2, catalogue="shop",
                                          catalogue_subset="store_17", excluded_items=[3, 4]))
    (params,) = plan.params
    assert params.catalogue_subset == "store_17" and params.excluded_items.tolist() == [3, 4]
    with pytest.raises(ApiError) as error:
        plan_request(CompletionRequest(prompt="x", catalogue_subset="store_17"))
    assert error.value.param == "catalogue_subset"


@pytest.mark.parametrize("num_items, seed, density", [
    (1, 0, 0.3), (31, 1, 0.3), (32, 2, 0.3), (33, 3, 0.3), (63, 6, 0.5), (64, 7, 0.5), (65, 8, 0.5),
    (200, 4, 0.3), (1000, 5, 0.3),
    # every bit set: int32 words of -1 (the sign bit), block counts at their largest
    (1000, 9, 1.0), (129, 10, 0.97)])
@pytest.mark.parametrize("use_numpy", [True, False], ids=["numpy-walk", "torch-walk"])
def test_bitmap_counts_equal_the_prefix_sum(num_items, seed, density, use_numpy):
    from widebeam.catalogue.filters import ItemFilter

    rng = np.random.default_rng(seed)
    catalogue = Catalogue.from_sequences([[i // 100 + 3, i % 100 + 3] for i in range(num_items)], 128)
    allowed = rng.random(catalogue.num_items) < density
    item_filter = ItemFilter(catalogue, allowed, use_numpy=use_numpy)
    expected = np.concatenate(([0], np.cumsum(allowed)))
    index = torch.arange(catalogue.num_items + 1)
    assert item_filter.allowed_before(index).tolist() == expected.tolist()
    assert item_filter.nbytes <= catalogue.num_items * 3 / 16 + 24
    children = torch.arange(1, catalogue.num_nodes)  # the children of every node, end to end
    counts = catalogue.child_start[1:] - catalogue.child_start[:-1]
    assert torch.equal(item_filter.live_children(children, counts), item_filter.live(children))
    assert torch.equal(item_filter.live_indices(children, counts),
                       torch.nonzero(item_filter.live(children)).squeeze(1))
    first, end = node_item_ranges(catalogue)
    assert item_filter.live(children).tolist() == [bool(expected[e] > expected[f])
                                                   for f, e in zip(first[1:].tolist(), end[1:].tolist())]
    ends = torch.nonzero(catalogue.is_end).squeeze(1)
    assert item_filter.ends_allowed(ends).tolist() == allowed[first[ends].numpy()].tolist()


def test_serve_flags_register_subsets_from_files(tiny_llama_dir, tmp_path):
    """`widebeam serve --catalogue shop=PATH --catalogue-subset shop:few=PATH`: the engine's catalogue
    has the subset, read from a text file of item indices."""
    import argparse

    from widebeam.engine_args import catalogue_spec, catalogue_subset_spec, catalogues_kwargs

    items = tmp_path / "items.jsonl"
    items.write_text("\n".join(json.dumps([10 + i, 20 + i]) for i in range(50)) + "\n")
    few = tmp_path / "few.txt"
    few.write_text("[3, 7, 11]")
    args = argparse.Namespace(catalogue=[catalogue_spec(f"shop={items}")],
                              catalogue_subset=[catalogue_subset_spec(f"shop:few={few}")])
    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", kv_cache_memory="4MiB", max_beam_width=8,
              **catalogues_kwargs(args))
    params = BeamSearchParams(beam_width=8, catalogue="shop", catalogue_subset="few")
    (out,) = llm.generate([{"prompt_token_ids": [5, 6]}], params, use_tqdm=False)
    assert sorted(b.token_ids[:-1] for b in out.outputs) == [[13, 23], [17, 27], [21, 31]]
    with pytest.raises(argparse.ArgumentTypeError):
        catalogues_kwargs(argparse.Namespace(catalogue=[], catalogue_subset=[("nope", "few", str(few))]))
    with pytest.raises(argparse.ArgumentTypeError):
        catalogue_subset_spec(f"shop={few}")
