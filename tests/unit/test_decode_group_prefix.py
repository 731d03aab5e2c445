"""The shared prefix of a decode group: the leading blocks every member's table holds, full for all
of them, found by slice compares; checked against the definition, block by block."""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from widebeam.model.attention.metadata import _common_full_blocks


def _by_definition(tables: list[list[int]], seq_lens: list[int], tokens_per_block: int) -> int:
    limit = min(seq_lens) // tokens_per_block
    shared = 0
    while shared < limit and all(shared < len(t) and t[shared] == tables[0][shared] for t in tables):
        shared += 1
    return shared


@settings(max_examples=300, deadline=None)
@given(data=st.data(), tokens_per_block=st.sampled_from([1, 2, 4, 16]),
       base=st.lists(st.integers(0, 40), max_size=12), num_members=st.integers(2, 6))
def test_common_full_blocks_is_the_longest_prefix_every_member_holds_full(data, tokens_per_block, base,
                                                                         num_members):
    tables, seq_lens = [], []
    for _ in range(num_members):
        kept = data.draw(st.integers(0, len(base)))
        table = base[:kept] + data.draw(st.lists(st.integers(0, 40), max_size=4))
        tables.append(table)
        seq_lens.append(data.draw(st.integers(0, len(table) * tokens_per_block)))
    meta = SimpleNamespace(block_tables=tables, seq_lens=seq_lens, tokens_per_block=tokens_per_block)
    members = data.draw(st.permutations(range(num_members)))
    ordered = [tables[i] for i in members]
    assert _common_full_blocks(meta, list(members)) == _by_definition(
        ordered, [seq_lens[i] for i in members], tokens_per_block)


def test_a_wide_group_over_a_long_prompt():
    prompt = list(range(100, 228))  # 128 full prompt blocks
    tables = [prompt + [b] for b in range(64)] + [prompt[:77] + [5] + prompt[78:] + [9]]
    meta = SimpleNamespace(block_tables=tables, seq_lens=[128 * 16 + 3] * len(tables), tokens_per_block=16)
    assert _common_full_blocks(meta, list(range(64))) == 128
    assert _common_full_blocks(meta, list(range(65))) == 77
