"""Cross-attention: decoder queries attend an encoder output whose K/V live in the 'cross' pool.

The encoder runs once per request; `write_kv` (model/attention/paged.py) stores every decoder layer's
K/V of its E output tokens in the request's cross block table, which never grows and which all its
beams share. Decoder queries attend all E positions: no causal mask, no window.

The definition of correct, one sequence at a time, is `cross_attention_reference` in
tests/unit/test_encoder_decoder.py. `cross_attention` is the path the model runs: the sequences that
share one cross block table (the beams of a request, with their prefill or decode queries) form a
group, their K/V are gathered once and every query of the group is scored against them in one
matrix-matrix product, instead of one read and one matrix-vector product per beam. The runner builds
the groups (`groups(device)`) once per step, before the forward; every layer then reads the same index
tensors, with no host reads. Where the C++ kernels serve (kernel_reads.kernel_shared_keys) a group is one op:
its encoder K/V read in place (a run of slots) or by index, nothing gathered.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from widebeam.model.attention.backends import fused_attention
from widebeam.model.attention.kernel_reads import kernel_shared_keys


@dataclass
class CrossAttentionMetadata:
    """Where each sequence's queries are and which cross blocks hold its encoder output."""

    query_start_loc: list[int]  # [num_seqs + 1] offsets into the flattened tokens
    block_tables: list[list[int]]  # per sequence: its request's cross block table
    encoder_lens: list[int]  # per sequence: E, the encoder output tokens in that table
    tokens_per_block: int
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def num_seqs(self) -> int:
        return len(self.encoder_lens)

    def key_slots(self, seq_index: int, device: torch.device) -> torch.Tensor:
        """Slots of encoder positions 0 .. E-1 of one sequence, in order."""
        t = self.tokens_per_block
        positions = torch.arange(self.encoder_lens[seq_index])
        table = torch.tensor(self.block_tables[seq_index], dtype=torch.long)
        return (table[positions // t] * t + positions % t).to(device)

    def groups(self, device: torch.device) -> list[CrossGroup]:
        """Sequences grouped by their cross block table; built on the first call (the runner's, once
        per step), shared by all layers."""
        key = ("groups", device)
        if key not in self._cache:
            by_table: dict[tuple[int, ...], list[int]] = {}
            for i in range(self.num_seqs):
                by_table.setdefault((self.encoder_lens[i], *self.block_tables[i]), []).append(i)
            groups = []
            for members in by_table.values():
                rows = [r for i in members
                        for r in range(self.query_start_loc[i], self.query_start_loc[i + 1])]
                groups.append(CrossGroup(torch.tensor(rows, dtype=torch.long, device=device),
                                         self.key_slots(members[0], device), self._slot_run(members[0])))
            self._cache[key] = groups
        return self._cache[key]


    def _slot_run(self, seq_index: int) -> tuple[int, int] | None:
        """(first slot, end) when the sequence's E encoder positions fill consecutive slots (its cross
        blocks were allocated in a row), else None; from the host's block table, no device read."""
        table, t = self.block_tables[seq_index], self.tokens_per_block
        if any(b - a != 1 for a, b in itertools.pairwise(table)):
            return None
        return table[0] * t, table[0] * t + self.encoder_lens[seq_index]


@dataclass
class CrossGroup:
    """Query rows (all tokens of all sequences of one request) and the encoder K/V slots they share."""

    token_index: torch.Tensor  # [n] rows of the flattened tokens
    key_slots: torch.Tensor  # [E]
    slot_run: tuple[int, int] | None = None  # (first, end) when key_slots are one run of slots


def _attend_all(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n, H, d], k/v [E, KV, d] -> [n, H, d]: every query sees every key (PyTorch's fused kernel;
    the n queries of all beams are the rows of one product against the one K/V read)."""
    out = fused_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                         v.transpose(0, 1)[None],
                                         scale=scale, enable_gqa=True)  # [1, H, n, d]
    return out[0].transpose(0, 1)


def cross_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: CrossAttentionMetadata, scale: float) -> torch.Tensor:
    """q: [num_tokens, heads, head_dim] -> [num_tokens, heads, head_dim], every query against all E
    keys of its sequence; each request's K/V are read once for all its beams."""
    out = torch.empty_like(q)
    for group in meta.groups(q.device):
        rows = q.index_select(0, group.token_index)
        # the C++ kernel where it serves (no K/V gathered; many rows tiled), else PyTorch's fused kernel
        attended = kernel_shared_keys(rows, k_cache, v_cache, group.key_slots, group.slot_run, scale)
        if attended is None:
            k, v = k_cache.index_select(0, group.key_slots), v_cache.index_select(0, group.key_slots)
            attended = _attend_all(rows, k, v, scale)
        out.index_copy_(0, group.token_index, attended)
    return out
