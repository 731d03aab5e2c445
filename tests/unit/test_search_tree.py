"""`return_tree`: the search tree (widebeam/beam/tree.py) against the model-free beam state.

The search runs on seeded random log-probs; the tree is then replayed on its own: each kept
candidate's cumulative log-prob is its parent's plus the step's log-prob of its token (float32, as
the search adds), each step's live nodes are the W best non-EOS continuations of all candidates,
every finished node's score is its cumulative log-prob over its length ** length_penalty, and the
finished nodes merged step by step (the W best kept) give the returned hypotheses, tokens and scores
exactly, in order.
"""

from __future__ import annotations

import json
import tracemalloc

import pytest
import torch

from widebeam.beam.scores import divided_scores, length_normalizer
from widebeam.beam.search import BeamSearchState
from widebeam.beam.tree import BYTES_PER_FINISHED_NODE, BYTES_PER_NODE, NO_PARENT, path_to, ranked_hypotheses
from widebeam.params import BeamSearchParams

EOS = (0, 1)


def run_search(width: int, max_new_tokens: int, vocab: int, seed: int, **params):
    """(tree dict, hypotheses, the log-prob rows of every step) of a search on random log-probs; EOS
    ids are made likely enough that hypotheses finish before max_new_tokens."""
    generator = torch.Generator().manual_seed(seed)
    state = BeamSearchState(BeamSearchParams(beam_width=width, max_new_tokens=max_new_tokens,
                                             return_tree=True, **params), max_new_tokens, EOS)
    rows, num_rows = [], 1
    while not state.done:
        logits = torch.randn(num_rows, vocab, generator=generator) * 3
        logits[:, list(EOS)] += 2.5
        logprobs = torch.log_softmax(logits, dim=-1)
        rows.append(logprobs)
        result = state.step(logprobs)
        if result.empty:
            break
        num_rows = len(result)
    hypotheses = state.finalize()
    return state.tree.to_dict(), hypotheses, rows


def replay(tree: dict, rows: list[torch.Tensor], width: int, num_return: int, length_penalty: float):
    """The returned hypotheses rebuilt from the tree and the step inputs alone; asserts on the way."""
    num_nodes = tree["num_nodes"]
    by_step: dict[int, list[int]] = {}
    for node in range(num_nodes):
        by_step.setdefault(tree["step"][node], []).append(node)
    live_order = [NO_PARENT]  # the rows of a step: the previous step's live nodes, in tree order
    kept: list[tuple[float, int]] = []
    for step in range(1, tree["num_steps"] + 1):
        lp = rows[step - 1]
        row_of = {node: row for row, node in enumerate(live_order)}
        nodes = by_step.get(step, [])
        for node in nodes:
            parent = tree["parent"][node]
            assert parent == NO_PARENT or tree["step"][parent] == step - 1
            parent_cum = 0.0 if parent == NO_PARENT else tree["cumulative_logprob"][parent]
            expected = (torch.tensor(parent_cum, dtype=torch.float32)
                        + lp[row_of[parent], tree["token_id"][node]]).item()
            assert tree["cumulative_logprob"][node] == expected
        # the live nodes are the W best continuations that do not end in EOS, in rank order
        running = torch.tensor([0.0 if n == NO_PARENT else tree["cumulative_logprob"][n] for n in live_order])
        sums = (lp + running[:, None]).reshape(-1)
        sums[torch.tensor([t in EOS for t in range(lp.shape[1])]).repeat(lp.shape[0])] = float("-inf")
        live = [n for n in nodes if not tree["finished"][n]]
        if live:
            top = torch.topk(sums, len(live)).indices.tolist()
            assert [(row_of[tree["parent"][n]], tree["token_id"][n]) for n in live] == \
                [divmod(i, lp.shape[1]) for i in top]
        assert len(live) <= width and len(nodes) - len(live) <= width
        for node in nodes:
            if tree["finished"][node]:
                normalizer = length_normalizer(len(path_to(tree, node)), length_penalty)
                score = divided_scores(torch.tensor([tree["cumulative_logprob"][node]],
                                                    dtype=torch.float32), normalizer).double().item()
                assert tree["score"][node] == score
                kept.append((score, node))
        kept = sorted(kept, key=lambda entry: entry[0], reverse=True)[:width]  # stable, as the search
        live_order = live
    return [([tree["token_id"][n] for n in path_to(tree, node)], tree["cumulative_logprob"][node], score)
            for score, node in kept[:num_return]]


@pytest.mark.parametrize("width", [1, 4, 16, 64])
@pytest.mark.parametrize("length_penalty,early_stopping", [(1.0, False), (0.5, True), (2.0, "never")])
def test_replaying_the_tree_reproduces_the_hypotheses_exactly(width, length_penalty, early_stopping):
    num_return = max(1, width // 2)
    tree, hypotheses, rows = run_search(width, 8, 300, seed=width, length_penalty=length_penalty,
                                        early_stopping=early_stopping, num_return_sequences=num_return)
    returned = [(h.token_ids, h.cumulative_logprob, h.score) for h in hypotheses]
    assert returned, "the search returned nothing"
    assert replay(tree, rows, width, num_return, length_penalty) == returned
    assert ranked_hypotheses(tree) == returned  # what a client reads off the tree
    assert sorted(r for r in tree["rank"] if r is not None) == list(range(len(returned)))


@pytest.mark.parametrize("width, max_new_tokens, early_stopping, stops_early", [
    (4, 6, False, False), (16, 6, False, False),  # the search runs to max_new_tokens
    (1, 30, False, True), (4, 30, True, True), (16, 30, True, True),  # it ends with beams still live
])
def test_live_and_pruned_nodes(width, max_new_tokens, early_stopping, stops_early):
    """A node with no kept continuation that did not finish was dropped at the next step the search
    ran, or, when no step ran after its own (the search ended with it live), at its own step: never
    past the last step, counted here by the rows the search was fed, not read off the tree."""
    tree, _, rows = run_search(width, max_new_tokens, 200, seed=7, early_stopping=early_stopping)
    last_step = len(rows)  # the steps the search ran
    assert (last_step < max_new_tokens) == stops_early
    assert tree["num_steps"] == last_step
    dropped_at_the_end = 0
    for node in range(tree["num_nodes"]):
        children = [c for c in range(tree["num_nodes"]) if tree["parent"][c] == node]
        if tree["finished"][node] or children:
            assert tree["pruned_at"][node] is None
            continue
        step = tree["step"][node]
        if step < last_step:
            assert tree["pruned_at"][node] == step + 1
        else:  # live when the search ended: dropped at that step, not after it
            assert tree["pruned_at"][node] == last_step
            dropped_at_the_end += 1
    assert max(p for p in tree["pruned_at"] if p is not None) <= last_step
    # an early stop leaves the last step's live beams unfinished (the branch above is reached);
    # a search that ran to max_new_tokens finished every candidate of its last step
    assert dropped_at_the_end == (width if stops_early else 0)
    # every step before the last keeps W live beams (the vocabulary is wide enough)
    for step in range(1, last_step):
        live = [n for n in range(tree["num_nodes"]) if tree["step"][n] == step and not tree["finished"][n]]
        assert len(live) == width


def test_stop_string_finishes_a_live_node():
    state = BeamSearchState(BeamSearchParams(beam_width=4, max_new_tokens=5, return_tree=True), 5, EOS)
    torch.manual_seed(0)
    state.step(torch.log_softmax(torch.randn(1, 50), dim=-1))
    state.finish_live_beams([2])
    tree = state.tree.to_dict()
    stopped = [n for n in range(tree["num_nodes"]) if tree["finished"][n]]
    assert len(stopped) == 1 and tree["finish_reason"][stopped[0]] == "stop"
    assert tree["step"][stopped[0]] == 1 and tree["pruned_at"][stopped[0]] is None


def test_tree_off_by_default():
    state = BeamSearchState(BeamSearchParams(beam_width=2, max_new_tokens=3), 3, EOS)
    assert state.tree is None


def test_return_tree_must_be_a_bool():
    with pytest.raises(ValueError, match="return_tree"):
        BeamSearchParams(return_tree=1)


def _traced_bytes(pattern: str) -> int:
    return sum(stat.size for stat in tracemalloc.take_snapshot().filter_traces(
        [tracemalloc.Filter(True, pattern)]).statistics("filename"))


def test_memory_of_a_wide_tree_is_counted():
    """W=1024, N=8 (all 8 steps): at most 2 W N nodes; `nbytes` is what the tree's own allocations
    hold (traced) within 2x; the JSON form is larger. docs/ui.md quotes the numbers printed."""
    width, steps = 1024, 8
    generator = torch.Generator().manual_seed(3)
    state = BeamSearchState(BeamSearchParams(beam_width=width, max_new_tokens=steps, return_tree=True,
                                             early_stopping="never"), steps, EOS)
    num_rows = 1
    tracemalloc.start()
    try:
        while not state.done:
            result = state.step(torch.log_softmax(torch.randn(num_rows, 4096, generator=generator), dim=-1))
            num_rows = len(result) or 1
        hypotheses = state.finalize()
        traced_tree = _traced_bytes("*beam/tree.py")
        tree = state.tree.to_dict()
        traced_with_dict = _traced_bytes("*beam/tree.py")
    finally:
        tracemalloc.stop()
    assert tree["num_steps"] == steps and len(hypotheses) == width
    assert tree["num_nodes"] <= 2 * width * steps
    assert tree["nbytes"] <= 2 * width * steps * BYTES_PER_NODE + width * steps * BYTES_PER_FINISHED_NODE
    assert tree["nbytes"] / 2 <= traced_tree <= 2 * tree["nbytes"]
    json_bytes = len(json.dumps(tree))
    print(f"\nW={width} N={steps}: {tree['num_nodes']} nodes; nbytes {tree['nbytes']}, traced "
          f"{traced_tree}; as a dict {traced_with_dict - traced_tree}; JSON {json_bytes} bytes")
