"""Tree attention: speculative decoding verifies a tree of drafted tokens per sequence in one forward.

The check this feature rests on: every tree node's logits equal those of the last token of a plain
linear sequence made of the tokens before the tree and the root-to-node path, run on its own. Trees
come in one forward (after linear tokens), one level per forward (earlier levels already in the
cache), and batched beside plain decoding sequences that must not change. Every case runs on both
backends and on a model whose windowed layers' window (6) cuts into the prompt, with the blocks
behind every window released (NaN in the cache, -1 in the table).
"""

from __future__ import annotations

import math

import pytest
import torch
from tiny_models import save_tiny_model

from widebeam.model.attention.backends import get_attention_backend
from widebeam.model.loading.build import load_model
from widebeam.model.loading.sources import resolve_model
from widebeam.model.runner import ModelRunner, SequenceInput

CPU = torch.device("cpu")
T = 4  # tokens per block
NUM_BLOCKS = 160
WINDOW = 6
BACKENDS = ["reference", "sdpa"]
PROMPT = [5, 17, 33, 9, 100, 3, 8, 41, 77, 12, 64, 90, 23]  # 13 tokens: the window of 6 cuts into it
LINEAR = [31, 47]
# Depth-first order, mixed branching, depth 3: 0 -> 1 -> {2, 3}; 4 -> 5; 0 -> 6.
DFS_TREE = [-1, 0, 1, 1, -1, 4, 0]
DFS_TOKENS = [50, 51, 52, 53, 54, 55, 56]
# Level order (levels: {0, 1}, {2, 3, 4}, {5}); level 3 is a single node under 3, which must not
# see its parent's siblings 2 and 4, nor node 1.
LEVELS = [[-1, -1], [0, 0, 1], [3]]
LEVEL_TOKENS = [[60, 61], [62, 63, 64], [65]]


@pytest.fixture(scope="module", params=["llama", "qwen3-sliding"])
def model(request, tmp_path_factory):
    """A tiny Llama (one full-attention pool), or a Qwen3 with layer 0 full and layers 1-2 in a
    window of 6 (two pools)."""
    path = tmp_path_factory.mktemp(f"tree-{request.param}")
    if request.param == "llama":
        save_tiny_model(path, "llama")
    else:
        save_tiny_model(path, "qwen3", num_hidden_layers=3, head_dim=16, use_sliding_window=True,
                        sliding_window=WINDOW, max_window_layers=1)
    return load_model(resolve_model(str(path)), "float32", CPU)


class Harness:
    """A runner over NaN-filled pools (an unwritten or released slot read shows up as NaN) and a
    block allocator that never reuses a block."""

    def __init__(self, model, backend: str):
        pools = {name: NUM_BLOCKS for name in dict.fromkeys(model.layer_pool_names)}
        self.runner = ModelRunner(model, pools, T, CPU, torch.float32, attention_backend=backend)
        for tensor in self.runner.kv_tensors.values():
            tensor.fill_(float("nan"))
        self.next_block = 0

    def new_table(self, num_tokens: int) -> list[int]:
        num_blocks = math.ceil(num_tokens / T)
        table = list(range(self.next_block, self.next_block + num_blocks))
        self.next_block += num_blocks
        assert self.next_block <= NUM_BLOCKS
        return table

    def seq(self, table: list[int], tokens: list[int], num_computed: int, tree: list[int] | None = None,
            group: str | None = None) -> SequenceInput:
        """The step's input; in windowed pools the blocks behind every query's window are released:
        NaN in the cache and -1 in the table."""
        logical = range(num_computed, num_computed + len(tokens))
        slots = [table[i // T] * T + i % T for i in logical]
        tables = {}
        for pool, window in self.runner.pool_windows.items():
            tables[pool] = list(table)
            if window is not None:
                first_visible_position = (min(positions(num_computed + len(tokens), tree)[num_computed:])
                                          - window + 1)
                for b in range(len(table)):
                    if (b + 1) * T <= first_visible_position:
                        self.runner.kv_tensors[pool][:, :, table[b] * T:(table[b] + 1) * T] = float("nan")
                        tables[pool][b] = -1
        return SequenceInput(list(tokens), num_computed, tables, {pool: slots for pool in tables}, group,
                             tree_parents=tree)

    def linear_logits(self, sequences: list[list[int]]) -> torch.Tensor:
        """Each token list prefilled on its own in a fresh table: its last token's logits [N, vocab]."""
        return self.runner.execute([self.seq(self.new_table(len(s)), s, 0) for s in sequences])


def positions(seq_len: int, tree: list[int] | None) -> list[int]:
    """Every token's position, by the definition: linear tokens at their logical index, a tree node
    one below its parent (the token before the tree for -1)."""
    tree = tree or []
    tree_start = seq_len - len(tree)
    result = list(range(tree_start))
    for j, parent in enumerate(tree):
        result.append(tree_start if parent < 0 else result[tree_start + parent] + 1)
    return result


def path(tree: list[int], tokens: list[int], node: int) -> list[int]:
    """The tokens from the tree's root to `node`."""
    nodes = []
    while node >= 0:
        nodes.append(node)
        node = tree[node]
    return [tokens[j] for j in reversed(nodes)]


def assert_close(actual, expected):
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_tree_after_linear_tokens_matches_each_root_to_node_path(model, backend):
    h = Harness(model, backend)
    table = h.new_table(len(PROMPT) + len(LINEAR) + len(DFS_TREE))
    h.runner.execute([h.seq(table, PROMPT, 0)])
    logits = h.runner.execute([h.seq(table, LINEAR + DFS_TOKENS, len(PROMPT), tree=DFS_TREE)],
                              all_logits=True)
    assert logits.shape[0] == len(LINEAR) + len(DFS_TREE)
    expected = h.linear_logits([PROMPT + LINEAR[:i + 1] for i in range(len(LINEAR))]
                               + [PROMPT + LINEAR + path(DFS_TREE, DFS_TOKENS, j)
                                  for j in range(len(DFS_TREE))])
    assert_close(logits, expected)


@pytest.mark.parametrize("backend", BACKENDS)
def test_tree_fed_one_level_per_forward(model, backend):
    """Level 1 after two linear tokens, then each deeper level alone, its tree_parents covering the
    earlier levels (already in the cache) too."""
    h = Harness(model, backend)
    tree = [parent for level in LEVELS for parent in level]
    tokens = [token for level in LEVEL_TOKENS for token in level]
    table = h.new_table(len(PROMPT) + len(LINEAR) + len(tree))
    h.runner.execute([h.seq(table, PROMPT, 0)])
    num_computed, num_nodes = len(PROMPT), 0
    for depth, (level, level_tokens) in enumerate(zip(LEVELS, LEVEL_TOKENS)):
        new_tokens = LINEAR + level_tokens if depth == 0 else level_tokens
        num_nodes += len(level)
        logits = h.runner.execute([h.seq(table, new_tokens, num_computed, tree=tree[:num_nodes])],
                                  all_logits=True)
        nodes = range(num_nodes - len(level), num_nodes)
        expected = h.linear_logits([PROMPT + LINEAR + path(tree, tokens, j) for j in nodes])
        assert_close(logits[-len(level):], expected)
        num_computed += len(new_tokens)


@pytest.mark.parametrize("backend", BACKENDS)
def test_trees_beside_plain_decoding_sequences(model, backend):
    """Two beams decoding over a shared prompt (a shared-prefix decode group), a tree after linear
    tokens, and a one-node step of a tree whose first level is cached, all in one forward, all
    labelled with one group: the plain rows must not change, the single tree query must not join
    the decode group."""
    h = Harness(model, backend)
    prompt = PROMPT[:12]  # three full blocks, shared by both beams
    shared = h.new_table(len(prompt))
    beams = [shared + h.new_table(1) for _ in range(2)]
    tree_table = h.new_table(len(PROMPT) + len(LINEAR) + len(DFS_TREE))
    level_table = h.new_table(len(PROMPT) + 3)
    h.runner.execute([h.seq(beams[0], prompt, 0), h.seq(tree_table, PROMPT, 0),
                      h.seq(level_table, PROMPT + [60, 61], 0, tree=[-1, -1])])
    step = [h.seq(beams[0], [70], len(prompt), group="g"), h.seq(beams[1], [71], len(prompt), group="g"),
            h.seq(tree_table, LINEAR + DFS_TOKENS, len(PROMPT), tree=DFS_TREE, group="g"),
            h.seq(level_table, [62], len(PROMPT) + 2, tree=[-1, -1, 1], group="g")]
    logits = h.runner.execute(step, all_logits=True)
    expected = h.linear_logits([prompt + [70], prompt + [71]]
                               + [PROMPT + LINEAR[:i + 1] for i in range(len(LINEAR))]
                               + [PROMPT + LINEAR + path(DFS_TREE, DFS_TOKENS, j)
                                  for j in range(len(DFS_TREE))]
                               + [PROMPT + [61, 62]])
    assert_close(logits, expected)
    # And the two beams read the same as a batch of them alone.
    assert_close(logits[:2], h.runner.execute(step[:2]))


# -- the mask itself, against the definition (no model) ----------------------------------------------
def visible(seq_len: int, tree: list[int], window: int | None, query: int, key: int) -> bool:
    """Query logical index `query` sees key `key`: by the definition in SequenceInput.tree_parents."""
    tree_start = seq_len - len(tree)
    pos = positions(seq_len, tree)
    if key >= tree_start:  # a tree key: only a tree query that is it or below it
        if query < tree_start:
            return False
        node, ancestors = query - tree_start, set()
        while node >= 0:
            ancestors.add(node)
            node = tree[node]
        seen = key - tree_start in ancestors
    else:
        seen = key <= query
    return seen and (window is None or 0 <= pos[query] - pos[key] < window)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window", [None, 3, 5])
@pytest.mark.parametrize("num_queries", [1, 3, 9])
def test_tree_mask_and_key_start_follow_the_definition(backend, window, num_queries):
    """A 6-node tree after 11 linear tokens; the step's queries start inside the tree (1, 3) or
    before it (9). Keys start at the smallest query position's window, and a single tree query is
    never in a decode group."""
    tree = [-1, 0, 1, -1, 3, 2]
    seq_len = 17
    table = list(range(math.ceil(seq_len / T)))
    meta = get_attention_backend(backend).build_metadata(
        query_start_loc=[0, num_queries], seq_lens=[seq_len], block_tables=[table],
        slot_mapping=[0] * num_queries,
        tokens_per_block=T, device=CPU, groups=["g"], sliding_window=window, trees=[tree])
    assert meta.trees == [tree] and not meta.decode_groups
    (keys,) = meta.sequences
    first_query = seq_len - num_queries
    min_position = min(positions(seq_len, tree)[first_query:])
    key_start = 0 if window is None else max(0, min_position - window + 1)
    assert meta.key_start(0) == key_start and not keys.causal
    # blocks 0, 1, ... in order: slot = index
    assert keys.key_slots.tolist() == list(range(key_start, seq_len))
    expected = [[visible(seq_len, tree, window, q, k) for k in range(key_start, seq_len)]
                for q in range(first_query, seq_len)]
    assert keys.mask.tolist() == expected


def test_plain_sequences_build_what_they_did_without_trees():
    """trees=[None, ...] (what the runner passes without trees) changes nothing."""
    # two beams decoding over three shared blocks, and a 5-token prefill chunk after 15 cached tokens
    layout = {"query_start_loc": [0, 1, 2, 7], "seq_lens": [13, 13, 20],
              "block_tables": [[0, 1, 2, 3], [0, 1, 2, 4], [5, 6, 7, 8, 9]], "slot_mapping": [0] * 7,
              "tokens_per_block": T, "device": CPU, "groups": ["g", "g", None]}
    for window in (None, 6):
        plain = get_attention_backend("sdpa").build_metadata(**layout, sliding_window=window)
        treeless = get_attention_backend("sdpa").build_metadata(**layout, sliding_window=window,
                                                                trees=[None] * 3)
        assert treeless.trees is None
        assert ([g.prefix_tokens for g in plain.decode_groups]
                == [g.prefix_tokens for g in treeless.decode_groups])
        for a, b in zip(plain.sequences, treeless.sequences):
            assert (torch.equal(a.mask, b.mask) and torch.equal(a.key_slots, b.key_slots)
                    and a.causal == b.causal)


def test_invalid_tree_parents_are_refused(tiny_llama_dir):
    model = load_model(resolve_model(str(tiny_llama_dir)), "float32", CPU)
    runner = ModelRunner(model, {"self": 8}, T, CPU, torch.float32)
    with pytest.raises(ValueError, match="parent"):
        runner.execute([SequenceInput([5, 6, 7], 0, {"self": [0]}, {"self": [0, 1, 2]},
                                      tree_parents=[-1, 1])])


def test_a_scoped_worker_keeps_the_tree(tiny_llama_dir):
    """A draft worker renames pools in its inputs; the tree must come through."""
    from widebeam.worker import Worker

    draft = Worker("draft", load_model(resolve_model(str(tiny_llama_dir)), "float32", CPU), "float32",
                   prefix="draft")
    seq = SequenceInput([5, 6], 3, {"draft": [0, 1]}, {"draft": [3, 4]}, "g", tree_parents=[-1, 0])
    local = draft._localized(seq)
    assert local.tree_parents == [-1, 0] and local.block_tables == {"self": [0, 1]} and local.group == "g"
