"""Attention metadata: where one step's tokens sit in one KV pool, as device tensors built once.

Slot `block_id * T + offset` of a layer's cache holds one token's K (or V): `[num_slots, kv_heads,
head_dim]`. A forward pass carries the new tokens of many sequences flattened into one batch. The
runner describes a step on the host (query offsets, sequence lengths, block tables, group labels,
the pool's window: python ints it already has) and the pool's attention backend turns that, once
per step, into every index tensor and mask its layers read (`AttentionBackend.build_metadata`).
Every layer of the pool then reads the same `AttentionMetadata`: no index is rebuilt per layer and
nothing is read back from the device.

The window has one source: `AttentionMetadata.sliding_window`, the pool's. Query j of a sequence
with Q new tokens and S cached tokens (this step's included) sits at position S - Q + j and sees
key p when 0 <= (S - Q + j) - p < window. Blocks wholly behind every query's window may have been
released (-1 in the table): no index built here ever points into them.

Token trees (speculative decoding verifies many drafted continuations in one pass): the last
`len(parents)` tokens of a sequence may form a tree, `parents[j]` the tree index of node j's parent
(-1: the last token before the tree). Tokens still sit in the cache in logical order, but a node's
position (RoPE and window) is its depth below the tree's base, and it sees the tokens before the tree
plus its own ancestors only, never a sibling's branch. Positions in the tree are never above logical
indices, so the first key any query can see follows from the smallest query *position*.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from widebeam.kv.tables import common_prefix_length


class Attends(Protocol):
    """What a layer calls on the metadata's backend (backends.py: `AttentionBackend.forward`); named
    here so the metadata need not import the backends that build it."""

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, position_bias: PositionBias | None = None) -> torch.Tensor: ...


@dataclass
class SequenceKeys:
    """One sequence attended on its own: its query rows and the keys they may see."""

    start: int  # rows start..end-1 of the flattened tokens
    end: int
    key_slots: torch.Tensor  # [S] slots of positions key_start .. seq_len-1, in order
    mask: torch.Tensor  # [Q, S] True = may attend
    causal: bool  # the mask is exactly lower-triangular and square (a prefill from position 0, no window cut)
    # Host tensors the layout was built from, kept (not copied) for a position bias to read:
    query_positions: torch.Tensor | None = None  # [Q] each query's position
    key_positions: torch.Tensor | None = None  # [S] each key's position


@dataclass
class DecodeGroup:
    """One-query sequences whose first `prefix_tokens` keys are the same physical slots (the beams
    of one request over their prompt's shared blocks); `prefix_tokens` is 0 for a batch of
    sequences that share nothing."""

    token_index: torch.Tensor  # [B] rows of the flattened tokens
    prefix_slots: torch.Tensor  # [prefix_tokens], shared by every row
    suffix_slots: torch.Tensor  # [B, S] each row's own keys (positions >= prefix_tokens), padded
    suffix_mask: torch.Tensor  # [B, S] True = a real key of the row (padding is False)
    suffix_hidden: torch.Tensor  # [B, 1, S] ~suffix_mask, shaped to mask [B, G, S] scores
    prefix_tokens: int
    # Loose rows (nothing shared) whose keys each sit in one run of consecutive slots: (first slot,
    # number of keys) per row, read through a view of the cache instead of gathered; None otherwise.
    key_ranges: list[tuple[int, int]] | None = None
    # The shared prefix's first slot when its blocks are consecutive ids (one run of slots: read as a
    # view of the cache, not gathered), else None.
    prefix_start: int | None = None
    # Host tensors the group was built from, kept (not copied) for a position bias to read:
    seq_lens: torch.Tensor | None = None  # [B] each row's length; its query sits at seq_len - 1
    suffix_positions: torch.Tensor | None = None  # [B, S] each row's own keys' positions (padding: any)


# Loose rows read in place one by one up to this many; past it one padded batch (a gather) is faster.
MAX_IN_PLACE_ROWS = 4


@dataclass
class AttentionMetadata:
    """One pool's view of one step. Build it with `AttentionBackend.build_metadata`."""

    query_start_loc: list[int]  # [num_seqs + 1] offsets into the flattened tokens
    seq_lens: list[int]  # tokens each sequence has in the cache once this step's are written
    block_tables: list[list[int]]
    slot_mapping: torch.Tensor  # [num_tokens] where each new token's K/V go
    tokens_per_block: int
    backend: Attends  # the backend that built this metadata; the pool's layers attend through it
    sliding_window: int | None = None  # the pool's window (None: full attention)
    groups: list[str | None] | None = None  # per sequence: decoding sequences of one group may share blocks
    # per sequence: the parents of its trailing token tree (see the module docstring), or None
    trees: list[list[int] | None] | None = None
    sequences: list[SequenceKeys] = field(default_factory=list)  # attended one at a time
    decode_groups: list[DecodeGroup] = field(default_factory=list)  # one-query sequences attended together

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    def query_lens(self) -> list[int]:
        return [self.query_start_loc[i + 1] - self.query_start_loc[i] for i in range(self.num_seqs)]

    def tree(self, seq_index: int) -> list[int] | None:
        """The sequence's tree parents, or None for a plain (linear) sequence."""
        return (self.trees[seq_index] or None) if self.trees else None

    def min_query_position(self, seq_index: int) -> int:
        """The smallest position among this step's queries of the sequence."""
        num_queries = self.query_start_loc[seq_index + 1] - self.query_start_loc[seq_index]
        first_query = self.seq_lens[seq_index] - num_queries  # logical index
        parents = self.tree(seq_index)
        tree_start = self.seq_lens[seq_index] - len(parents) if parents else self.seq_lens[seq_index]
        if first_query < tree_start:
            return first_query  # a linear query: below every tree position
        return tree_start - 1 + min(tree_depths(parents)[first_query - tree_start:])

    def key_start(self, seq_index: int) -> int:
        """First key (logical index) any query of this step can see (0 without a window). A tree
        node's position never exceeds its logical index, so no key before this is in any window."""
        if self.sliding_window is None:
            return 0
        return max(0, self.min_query_position(seq_index) - self.sliding_window + 1)


def tree_depths(parents: list[int]) -> list[int]:
    """Each tree node's depth below the tree's base: 1 for a node whose parent is -1 (the last token
    before the tree), its parent's + 1 otherwise. A node's position is tree_start - 1 + its depth."""
    depths: list[int] = []
    for j, parent in enumerate(parents):
        if not -1 <= parent < j:
            raise ValueError(f"tree node {j} has parent {parent}; a parent is -1 or an earlier node")
        depths.append(1 if parent < 0 else depths[parent] + 1)
    return depths


def tree_ancestry(parents: list[int]) -> torch.Tensor:
    """[N, N] bool: [j, a] is True when node a is node j itself or one of its ancestors."""
    num_nodes = len(parents)
    ancestry = torch.eye(num_nodes, dtype=torch.bool)
    for j, parent in enumerate(parents):
        if parent >= 0:
            ancestry[j] |= ancestry[parent]  # parent < j: its row is already complete
    return ancestry


# -- builders: host lists in, device tensors out (run once per step, never per layer) ---------------
def sequence_keys(meta: AttentionMetadata, seq_index: int, device: torch.device) -> SequenceKeys:
    """The slots and the causal (and windowed, and tree) mask of one sequence's queries."""
    parents = meta.tree(seq_index)
    if parents:
        return _tree_sequence_keys(meta, seq_index, parents, device)
    t = meta.tokens_per_block
    start, end = meta.query_start_loc[seq_index], meta.query_start_loc[seq_index + 1]
    seq_len, key_start = meta.seq_lens[seq_index], meta.key_start(seq_index)
    positions = torch.arange(key_start, seq_len)
    table = torch.tensor(meta.block_tables[seq_index], dtype=torch.long)
    slots = table[positions // t] * t + positions % t
    query_positions = torch.arange(seq_len - (end - start), seq_len)
    diff = query_positions[:, None] - positions[None, :]
    mask = diff >= 0
    if meta.sliding_window is not None:
        mask &= diff < meta.sliding_window
    causal = key_start == 0 and end - start == seq_len and (meta.sliding_window is None
                                                            or meta.sliding_window >= seq_len)
    return SequenceKeys(start, end, slots.to(device), mask.to(device), causal, query_positions, positions)


def _tree_sequence_keys(meta: AttentionMetadata, seq_index: int, parents: list[int],
                        device: torch.device) -> SequenceKeys:
    """A sequence ending in a token tree: keys by logical index, visibility by ancestry, the window
    by position (a node's depth below the tree's base, not its logical index)."""
    t = meta.tokens_per_block
    start, end = meta.query_start_loc[seq_index], meta.query_start_loc[seq_index + 1]
    seq_len, key_start = meta.seq_lens[seq_index], meta.key_start(seq_index)
    tree_start = seq_len - len(parents)
    if tree_start < 0:
        raise ValueError(f"a tree of {len(parents)} nodes in a sequence of {seq_len} tokens")
    position_of = torch.arange(seq_len)  # [seq_len] logical index -> position
    position_of[tree_start:] = tree_start - 1 + torch.tensor(tree_depths(parents), dtype=torch.long)
    first_query = seq_len - (end - start)  # logical index
    key_index = torch.arange(key_start, seq_len)  # logical; blocks before key_start may be released
    query_index = torch.arange(first_query, seq_len)
    table = torch.tensor(meta.block_tables[seq_index], dtype=torch.long)
    slots = table[key_index // t] * t + key_index % t
    # Linear tokens: causal in logical order (a linear query is before every tree key, a tree query
    # after every linear key). Inside the tree, a node sees only itself and its ancestors, never a
    # sibling's branch: the [tree queries, tree keys] corner is the ancestry matrix's.
    mask = query_index[:, None] >= key_index[None, :]  # [Q, S]
    first_query_node, first_key_node = (max(first_query, tree_start) - tree_start,
                                        max(key_start, tree_start) - tree_start)
    mask[tree_start + first_query_node - first_query:, tree_start + first_key_node - key_start:] = (
        tree_ancestry(parents)[first_query_node:, first_key_node:])
    if meta.sliding_window is not None:
        diff = position_of[query_index][:, None] - position_of[key_index][None, :]
        mask &= (diff >= 0) & (diff < meta.sliding_window)
    return SequenceKeys(start, end, slots.to(device), mask.to(device), causal=False,
                        query_positions=position_of[first_query:], key_positions=position_of[key_start:])


def build_decode_groups(meta: AttentionMetadata, device: torch.device) -> list[DecodeGroup]:
    """The one-query sequences: one group per label whose members share full prefix blocks, and one
    group of every other decoding sequence."""
    lens = meta.query_lens()
    by_label: dict[str, list[int]] = {}
    loose: list[int] = []
    for i in range(meta.num_seqs):
        if lens[i] != 1 or meta.tree(i):  # a tree node must not see its siblings: attended on its own
            continue
        # Windowed pools release blocks behind the window, so their tables share no usable prefix.
        label = meta.groups[i] if meta.groups and meta.sliding_window is None else None
        if label is None:
            loose.append(i)
        else:
            by_label.setdefault(label, []).append(i)
    groups = []
    for members in by_label.values():
        num_shared_blocks = _common_full_blocks(meta, members) if len(members) > 1 else 0
        if num_shared_blocks == 0:
            loose.extend(members)
        else:
            groups.append(_group(meta, members, num_shared_blocks * meta.tokens_per_block, device))
    if loose:
        groups.append(_group(meta, sorted(loose), 0, device))
    return groups


def _common_full_blocks(meta: AttentionMetadata, members: list[int]) -> int:
    """Leading blocks every member's table shares, counting only blocks full for all of them.

    Tables compare as slices (a C loop each, not a Python step per block): a wide step checks
    hundreds of beams over a long prompt's blocks."""
    first = meta.block_tables[members[0]]
    limit = min(meta.seq_lens[i] for i in members) // meta.tokens_per_block
    shared_prefix = first[:limit]
    for i in members[1:]:
        table = meta.block_tables[i]
        if table[:limit] == shared_prefix:
            continue
        limit = common_prefix_length(table[:limit], shared_prefix)
        if limit == 0:
            break
        shared_prefix = first[:limit]
    return limit


def _group(meta: AttentionMetadata, members: list[int], prefix_tokens: int,
           device: torch.device) -> DecodeGroup:
    t = meta.tokens_per_block
    prefix_table = torch.tensor(meta.block_tables[members[0]][: prefix_tokens // t], dtype=torch.long)
    prefix_slots = (prefix_table[:, None] * t + torch.arange(t)).reshape(-1)
    # A decoding query sees every key from its key_start on, so the window is all in `starts`.
    starts = [max(prefix_tokens, meta.key_start(i)) for i in members]
    ends = [meta.seq_lens[i] for i in members]
    # Only the blocks holding each row's own keys, padded with the row's first block.
    own_blocks = [meta.block_tables[i][start // t:(end - 1) // t + 1]
                  for i, start, end in zip(members, starts, ends)]
    num_blocks = max(len(blocks) for blocks in own_blocks)
    # [B, nb]
    blocks = torch.tensor([b + [b[0]] * (num_blocks - len(b)) for b in own_blocks], dtype=torch.long)
    start_t, end_t = torch.tensor(starts), torch.tensor(ends)
    suffix_len = max(end - start for start, end in zip(starts, ends))
    suffix_positions = start_t[:, None] + torch.arange(suffix_len)  # [B, S]
    suffix_mask = suffix_positions < end_t[:, None]
    # A padded key repeats the row's first key: the cache is never zeroed, and a masked key must
    # still hold finite numbers (0 x NaN is NaN).
    suffix_positions = torch.where(suffix_mask, suffix_positions, start_t[:, None])
    offsets = suffix_positions - (start_t // t * t)[:, None]  # from the first own block's slot 0
    suffix_slots = blocks.gather(1, offsets // t) * t + offsets % t
    return DecodeGroup(
        token_index=torch.tensor([meta.query_start_loc[i] for i in members], dtype=torch.long, device=device),
        prefix_slots=prefix_slots.to(device),
        suffix_slots=suffix_slots.to(device),
        suffix_mask=suffix_mask.to(device),
        suffix_hidden=(~suffix_mask)[:, None, :].to(device),
        prefix_tokens=prefix_tokens,
        key_ranges=_key_ranges(own_blocks, starts, ends, t) if prefix_tokens == 0 else None,
        prefix_start=_first_slot_of_run(meta.block_tables[members[0]][: prefix_tokens // t], t),
        seq_lens=end_t,
        suffix_positions=suffix_positions,
    )


def _first_slot_of_run(blocks: list[int], tokens_per_block: int) -> int | None:
    """The first slot of `blocks` when they are consecutive ids (one run of slots), else None."""
    if not blocks or any(b != blocks[0] + j for j, b in enumerate(blocks)):
        return None
    return blocks[0] * tokens_per_block


def _key_ranges(own_blocks: list[list[int]], starts: list[int], ends: list[int],
                tokens_per_block: int) -> list[tuple[int, int]] | None:
    """(first slot, keys) per row when every row's own blocks are consecutive ids (one slot run: a
    request's blocks mostly come off the free list in order), else None; only for a few rows."""
    if len(own_blocks) > MAX_IN_PLACE_ROWS:
        return None
    ranges = []
    for blocks, start, end in zip(own_blocks, starts, ends):
        if any(b != blocks[0] + j for j, b in enumerate(blocks)):
            return None
        ranges.append((blocks[0] * tokens_per_block + start % tokens_per_block, end - start))
    return ranges


# -- an additive bias per head as a function of positions (T5's relative position bias) -----------
class PositionBias:
    """An additive attention bias per head, `fn(query_positions, key_positions) -> [H, *shape]` for
    broadcastable long tensors (T5: a learned value per head and relative-position bucket).

    A model makes one per stack and forward pass and hands it to every layer of the stack; the bias
    of each sequence (or decode group) is computed by the first layer that asks and reused by the
    others, as T5 computes it once in the first layer. Positions come from the host tensors the
    metadata was built from, moved to `device` only here, so a pass without a bias pays nothing.
    The bias is added to the scaled scores, before the mask and the softmax.
    """

    def __init__(self, fn, device: torch.device):
        self.fn, self.device = fn, device
        self._by_part: dict[tuple[int, str], tuple[object, torch.Tensor]] = {}

    def _memo(self, part: object, kind: str, make) -> torch.Tensor:
        key = (id(part), kind)
        if key not in self._by_part:
            self._by_part[key] = (part, make())  # holding `part` keeps its id unique for this pass
        return self._by_part[key][1]

    def _positions(self, positions: torch.Tensor) -> torch.Tensor:
        return positions.to(device=self.device, dtype=torch.long)

    def sequence(self, seq: SequenceKeys) -> torch.Tensor:
        """[H, Q, S] float32 for one sequence's queries and keys."""
        return self._memo(seq, "seq", lambda: self.fn(self._positions(seq.query_positions)[:, None],
                                                      self._positions(seq.key_positions)[None, :]).float())

    def group_prefix(self, group: DecodeGroup) -> torch.Tensor:
        """[H, B, P] float32: each row's query against the shared prefix keys 0 .. P-1."""
        return self._memo(group, "prefix", lambda: self.fn(
            self._positions(group.seq_lens - 1)[:, None],
            torch.arange(group.prefix_tokens, device=self.device)[None, :]).float())

    def group_suffix(self, group: DecodeGroup) -> torch.Tensor:
        """[H, B, S] float32: each row's query against its own (padded) keys."""
        return self._memo(group, "suffix", lambda: self.fn(
            self._positions(group.seq_lens - 1)[:, None], self._positions(group.suffix_positions)).float())

    def group_keys(self, group: DecodeGroup) -> torch.Tensor:
        """[H, B, P + S] float32: the prefix's bias then the own keys', as one row of keys per beam."""
        return self._memo(group, "keys", lambda: torch.cat((self.group_prefix(group),
                                                             self.group_suffix(group)), dim=2).contiguous())
