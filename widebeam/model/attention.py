"""Paged attention: K/V written through a slot mapping, read back through block tables.

Slot `block_id * T + offset` of a layer's cache holds one token's K (or V): `[num_slots, kv_heads,
head_dim]`. A forward pass carries the new tokens of many sequences flattened into one batch;
`AttentionMetadata` says where each sequence's queries are and which blocks hold its keys.

`paged_attention_reference` is the definition of correct: one sequence at a time, plain matmuls.
`paged_attention` is the path the model runs: sequences with one query (decoding beams) in one
padded batch, longer ones (prefill chunks) one by one. Tests hold the two together.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    """Where each sequence's tokens sit, for one pool, in one forward pass."""

    query_start_loc: list[int]  # [num_seqs + 1] offsets into the flattened tokens
    seq_lens: list[int]  # tokens each sequence has in the cache once this step's are written
    block_tables: list[list[int]]
    slot_mapping: torch.Tensor  # [num_tokens] where each new token's K/V go
    tokens_per_block: int
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    def query_lens(self) -> list[int]:
        return [self.query_start_loc[i + 1] - self.query_start_loc[i] for i in range(self.num_seqs)]

    def key_slots(self, seq_index: int, device: torch.device) -> torch.Tensor:
        """Slots of positions 0 .. seq_len-1 of one sequence, in order."""
        t = self.tokens_per_block
        positions = torch.arange(self.seq_lens[seq_index], device=device)
        table = torch.tensor(self.block_tables[seq_index], dtype=torch.long, device=device)
        return table[positions // t] * t + positions % t

    def decode_batch(self, device: torch.device) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """For the one-query sequences: their indices, padded key slots [B, S] and key positions valid [B, S].

        Built once per forward and shared by every layer of the pool.
        """
        key = ("decode", device)
        if key not in self._cache:
            lens = self.query_lens()
            indices = [i for i in range(self.num_seqs) if lens[i] == 1]
            max_len = max((self.seq_lens[i] for i in indices), default=0)
            slots = torch.zeros(len(indices), max_len, dtype=torch.long, device=device)
            valid = torch.zeros(len(indices), max_len, dtype=torch.bool, device=device)
            for row, i in enumerate(indices):
                n = self.seq_lens[i]
                row_slots = self.key_slots(i, device)
                slots[row, :n] = row_slots
                # Pad with a slot of the same sequence: the cache is never zeroed, and a masked key
                # must still hold finite numbers (0 x NaN is NaN).
                slots[row, n:] = row_slots[0]
                valid[row, :n] = True
            self._cache[key] = (indices, slots, valid)
        return self._cache[key]


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' K/V ([num_tokens, kv_heads, head_dim]) at their slots."""
    k_cache.index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
            softcap: float | None) -> torch.Tensor:
    """q [B, Q, H, d], k/v [B, S, KV, d], mask [B, Q, S] (True = may attend) -> [B, Q, H, d]."""
    batch, num_queries, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    group = num_heads // num_kv_heads
    q = q.reshape(batch, num_queries, num_kv_heads, group, head_dim)  # heads grouped by their KV head
    scores = torch.einsum("bqkgd,bskd->bkgqs", q.float(), k.float()) * scale  # [B, KV, G, Q, S]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask[:, None, None, :, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bkgqs,bskd->bqkgd", probs, v.float())  # [B, Q, KV, G, d]
    return out.reshape(batch, num_queries, num_heads, head_dim).to(q.dtype)


def _causal_mask(query_positions: torch.Tensor, key_positions: torch.Tensor,
                 sliding_window: int | None) -> torch.Tensor:
    """[..., Q, S]: a query sees keys at or before its position, and within the window if any."""
    diff = query_positions[..., :, None] - key_positions[..., None, :]
    mask = diff >= 0
    if sliding_window is not None:
        mask &= diff < sliding_window
    return mask


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              meta: AttentionMetadata, scale: float, sliding_window: int | None = None,
                              softcap: float | None = None) -> torch.Tensor:
    """q: [num_tokens, heads, head_dim] -> [num_tokens, heads, head_dim], one sequence at a time.

    The K/V of this step must already be in the cache. Query j of a sequence with Q new tokens and
    S cached tokens sits at position S - Q + j.
    """
    out = torch.empty_like(q)
    for i in range(meta.num_seqs):
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        seq_len = meta.seq_lens[i]
        slots = meta.key_slots(i, q.device)
        k = k_cache[slots]  # [S, KV, d]
        v = v_cache[slots]
        group = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(group, dim=1).float()  # [S, H, d]
        v = v.repeat_interleave(group, dim=1).float()
        query_positions = torch.arange(seq_len - (end - start), seq_len, device=q.device)
        key_positions = torch.arange(seq_len, device=q.device)
        scores = torch.einsum("qhd,shd->hqs", q[start:end].float(), k) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        mask = _causal_mask(query_positions, key_positions, sliding_window)
        scores = scores.masked_fill(~mask[None], float("-inf"))
        out[start:end] = torch.einsum("hqs,shd->qhd", torch.softmax(scores, dim=-1), v).to(q.dtype)
    return out


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Same contract as `paged_attention_reference`; decoding sequences go through in one batch."""
    out = torch.empty_like(q)
    decode_indices, key_slots, key_valid = meta.decode_batch(q.device)
    if decode_indices:
        token_index = torch.tensor([meta.query_start_loc[i] for i in decode_indices], device=q.device)
        k = k_cache[key_slots]  # [B, S, KV, d]
        v = v_cache[key_slots]
        seq_lens = torch.tensor([meta.seq_lens[i] for i in decode_indices], device=q.device)
        key_positions = torch.arange(key_slots.shape[1], device=q.device)
        mask = key_valid
        if sliding_window is not None:
            mask = mask & (key_positions[None, :] > seq_lens[:, None] - 1 - sliding_window)
        result = _attend(q[token_index][:, None], k, v, mask[:, None, :], scale, softcap)
        out[token_index] = result[:, 0]
    decode_set = set(decode_indices)
    for i in range(meta.num_seqs):
        if i in decode_set:
            continue
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        seq_len = meta.seq_lens[i]
        slots = meta.key_slots(i, q.device)
        query_positions = torch.arange(seq_len - (end - start), seq_len, device=q.device)
        mask = _causal_mask(query_positions, torch.arange(seq_len, device=q.device), sliding_window)
        out[start:end] = _attend(q[None, start:end], k_cache[slots][None], v_cache[slots][None], mask[None],
                                 scale, softcap)[0]
    return out
