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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from widebeam.model.attention_backends import AttentionBackend


@dataclass
class SequenceKeys:
    """One sequence attended on its own: its query rows and the keys they may see."""

    start: int  # rows start..end-1 of the flattened tokens
    end: int
    key_slots: torch.Tensor  # [S] slots of positions key_start .. seq_len-1, in order
    mask: torch.Tensor  # [Q, S] True = may attend
    causal: bool  # the mask is exactly lower-triangular and square (a prefill from position 0, no window cut)


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


@dataclass
class AttentionMetadata:
    """One pool's view of one step. Build it with `AttentionBackend.build_metadata`."""

    query_start_loc: list[int]  # [num_seqs + 1] offsets into the flattened tokens
    seq_lens: list[int]  # tokens each sequence has in the cache once this step's are written
    block_tables: list[list[int]]
    slot_mapping: torch.Tensor  # [num_tokens] where each new token's K/V go
    tokens_per_block: int
    backend: AttentionBackend  # the backend that built this metadata; the pool's layers attend through it
    sliding_window: int | None = None  # the pool's window (None: full attention)
    groups: list[str | None] | None = None  # per sequence: decoding sequences of one group may share blocks
    sequences: list[SequenceKeys] = field(default_factory=list)  # attended one at a time
    decode_groups: list[DecodeGroup] = field(default_factory=list)  # one-query sequences attended together

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    def query_lens(self) -> list[int]:
        return [self.query_start_loc[i + 1] - self.query_start_loc[i] for i in range(self.num_seqs)]

    def key_start(self, seq_index: int) -> int:
        """First key position any query of this step can see (0 without a window)."""
        if self.sliding_window is None:
            return 0
        num_queries = self.query_start_loc[seq_index + 1] - self.query_start_loc[seq_index]
        return max(0, self.seq_lens[seq_index] - num_queries - self.sliding_window + 1)


# -- builders: host lists in, device tensors out (run once per step, never per layer) ---------------
def sequence_keys(meta: AttentionMetadata, seq_index: int, device: torch.device) -> SequenceKeys:
    """The slots and the causal (and windowed) mask of one sequence's queries."""
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
    return SequenceKeys(start, end, slots.to(device), mask.to(device), causal)


def build_decode_groups(meta: AttentionMetadata, device: torch.device) -> list[DecodeGroup]:
    """The one-query sequences: one group per label whose members share full prefix blocks, and one
    group of every other decoding sequence."""
    lens = meta.query_lens()
    by_label: dict[str, list[int]] = {}
    loose: list[int] = []
    for i in range(meta.num_seqs):
        if lens[i] != 1:
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
    """Leading blocks every member's table shares, counting only blocks full for all of them."""
    first = meta.block_tables[members[0]]
    limit = min(meta.seq_lens[i] for i in members) // meta.tokens_per_block
    for i in members[1:]:
        table = meta.block_tables[i]
        shared = 0
        while shared < limit and table[shared] == first[shared]:
            shared += 1
        limit = shared
        if limit == 0:
            break
    return limit


def _group(meta: AttentionMetadata, members: list[int], prefix_tokens: int, device: torch.device) -> DecodeGroup:
    t = meta.tokens_per_block
    prefix_table = torch.tensor(meta.block_tables[members[0]][: prefix_tokens // t], dtype=torch.long)
    prefix_slots = (prefix_table[:, None] * t + torch.arange(t)).reshape(-1)
    # A decoding query sees every key from its key_start on, so the window is all in `starts`.
    starts = [max(prefix_tokens, meta.key_start(i)) for i in members]
    ends = [meta.seq_lens[i] for i in members]
    # Only the blocks holding each row's own keys, padded with the row's first block.
    own_blocks = [meta.block_tables[i][start // t:(end - 1) // t + 1] for i, start, end in zip(members, starts, ends)]
    num_blocks = max(len(blocks) for blocks in own_blocks)
    blocks = torch.tensor([b + [b[0]] * (num_blocks - len(b)) for b in own_blocks], dtype=torch.long)  # [B, nb]
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
    )
