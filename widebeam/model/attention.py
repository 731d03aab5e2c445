"""Paged attention: K/V written through a slot mapping, read back through block tables.

Slot `block_id * T + offset` of a layer's cache holds one token's K (or V): `[num_slots, kv_heads,
head_dim]`. A forward pass carries the new tokens of many sequences flattened into one batch;
`AttentionMetadata` says where each sequence's queries are and which blocks hold its keys.

`paged_attention_reference` is the definition of correct: one sequence at a time, plain matmuls.
`paged_attention` is the path the model runs. Prefill chunks go one by one through PyTorch's fused
scaled-dot-product attention (einsum only with a logit soft-cap). Decoding sequences (one query
each) go in groups: the beams of one request share their prompt's blocks, so the group's keys split
into a shared prefix, read once for every beam's queries as one matrix-matrix product, and each
beam's own suffix; the two partial attentions are merged exactly by log-sum-exp. Decoding sequences
that share nothing go in one padded batch through the fused kernel. Tests hold every path to the
reference.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.nn import functional as F


@dataclass
class AttentionMetadata:
    """Where each sequence's tokens sit, for one pool, in one forward pass."""

    query_start_loc: list[int]  # [num_seqs + 1] offsets into the flattened tokens
    seq_lens: list[int]  # tokens each sequence has in the cache once this step's are written
    block_tables: list[list[int]]
    slot_mapping: torch.Tensor  # [num_tokens] where each new token's K/V go
    tokens_per_block: int
    groups: list[str | None] | None = None  # per sequence: decoding sequences of one group may share blocks
    # The pool's window: keys before a sequence's first visible position may have been released.
    sliding_window: int | None = None
    _cache: dict = field(default_factory=dict, repr=False)

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

    def key_slots(self, seq_index: int, device: torch.device) -> torch.Tensor:
        """Slots of positions key_start .. seq_len-1 of one sequence, in order."""
        t = self.tokens_per_block
        positions = torch.arange(self.key_start(seq_index), self.seq_lens[seq_index], device=device)
        table = torch.tensor(self.block_tables[seq_index], dtype=torch.long, device=device)
        return table[positions // t] * t + positions % t

    def decode_groups(self, device: torch.device) -> list[DecodeGroup]:
        """The one-query sequences, grouped by shared prefix blocks; built once per forward and
        shared by every layer of the pool."""
        key = ("decode", device)
        if key not in self._cache:
            self._cache[key] = self._build_decode_groups(device)
        return self._cache[key]

    def _build_decode_groups(self, device: torch.device) -> list[DecodeGroup]:
        lens = self.query_lens()
        decoding = [i for i in range(self.num_seqs) if lens[i] == 1]
        by_label: dict[str, list[int]] = {}
        loose: list[int] = []
        for i in decoding:
            # Windowed pools release blocks behind the window, so tables share no usable prefix.
            label = self.groups[i] if self.groups and self.sliding_window is None else None
            if label is None:
                loose.append(i)
            else:
                by_label.setdefault(label, []).append(i)
        groups = []
        for members in by_label.values():
            num_shared_blocks = self._common_full_blocks(members) if len(members) > 1 else 0
            if num_shared_blocks == 0:
                loose.extend(members)
            else:
                groups.append(self._group(members, num_shared_blocks * self.tokens_per_block, device))
        if loose:
            groups.append(self._group(sorted(loose), 0, device))
        return groups

    def _common_full_blocks(self, members: list[int]) -> int:
        """Leading blocks every member's table shares, counting only blocks full for all of them."""
        first = self.block_tables[members[0]]
        limit = min(self.seq_lens[i] for i in members) // self.tokens_per_block
        for i in members[1:]:
            table = self.block_tables[i]
            shared = 0
            while shared < limit and table[shared] == first[shared]:
                shared += 1
            limit = shared
            if limit == 0:
                break
        return limit

    def _group(self, members: list[int], prefix_tokens: int, device: torch.device) -> DecodeGroup:
        t = self.tokens_per_block
        prefix_table = torch.tensor(self.block_tables[members[0]][: prefix_tokens // t], dtype=torch.long)
        prefix_slots = (prefix_table[:, None] * t + torch.arange(t)).reshape(-1)
        starts = [max(prefix_tokens, self.key_start(i)) for i in members]
        ends = [self.seq_lens[i] for i in members]
        # Only the blocks holding each row's own keys, padded with the row's first block.
        own_blocks = [self.block_tables[i][start // t:(end - 1) // t + 1] for i, start, end in zip(members, starts, ends)]
        num_blocks = max(len(blocks) for blocks in own_blocks)
        blocks = torch.tensor([b + [b[0]] * (num_blocks - len(b)) for b in own_blocks], dtype=torch.long)  # [B, nb]
        start_t, end_t = torch.tensor(starts), torch.tensor(ends)
        suffix_len = int((end_t - start_t).max())
        suffix_positions = start_t[:, None] + torch.arange(suffix_len)  # [B, S]
        suffix_valid = suffix_positions < end_t[:, None]
        # A padded key repeats the row's first key: the cache is never zeroed, and a masked key
        # must still hold finite numbers (0 x NaN is NaN).
        suffix_positions = torch.where(suffix_valid, suffix_positions, start_t[:, None])
        offsets = suffix_positions - (start_t // t * t)[:, None]  # from the first own block's slot 0
        suffix_slots = blocks.gather(1, offsets // t) * t + offsets % t
        return DecodeGroup(
            token_index=torch.tensor([self.query_start_loc[i] for i in members], device=device),
            query_positions=torch.tensor([self.seq_lens[i] - 1 for i in members], device=device),
            prefix_slots=prefix_slots.to(device),
            suffix_slots=suffix_slots.to(device),
            suffix_valid=suffix_valid.to(device),
            suffix_positions=suffix_positions.to(device),
            prefix_tokens=prefix_tokens,
        )


@dataclass
class DecodeGroup:
    """Decoding sequences whose first `prefix_tokens` keys are the same physical slots."""

    token_index: torch.Tensor  # [B] rows of the flattened tokens
    query_positions: torch.Tensor  # [B]
    prefix_slots: torch.Tensor  # [prefix_tokens], shared by every row
    suffix_slots: torch.Tensor  # [B, S] each row's own keys (positions prefix_tokens ..), padded
    suffix_valid: torch.Tensor  # [B, S]
    suffix_positions: torch.Tensor  # [B, S] absolute position of each suffix key
    prefix_tokens: int


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
        key_positions = torch.arange(meta.key_start(i), seq_len, device=q.device)
        k = k_cache[slots]  # [S, KV, d]
        v = v_cache[slots]
        group = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(group, dim=1).float()  # [S, H, d]
        v = v.repeat_interleave(group, dim=1).float()
        query_positions = torch.arange(seq_len - (end - start), seq_len, device=q.device)
        scores = torch.einsum("qhd,shd->hqs", q[start:end].float(), k) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        mask = _causal_mask(query_positions, key_positions, sliding_window)
        scores = scores.masked_fill(~mask[None], float("-inf"))
        out[start:end] = torch.einsum("hqs,shd->qhd", torch.softmax(scores, dim=-1), v).to(q.dtype)
    return out


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache[slots] for any shape of `slots`; index_select is about twice as fast on CPU."""
    return cache.index_select(0, slots.reshape(-1)).view(*slots.shape, *cache.shape[1:])


def _attend_group(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: DecodeGroup, scale: float,
                  sliding_window: int | None, softcap: float | None) -> torch.Tensor:
    """One decode group: q [B, H, d] -> [B, H, d]; the prefix is read once for all B queries.

    The prefix's scores for every beam and grouped head are one [KV, B*G, d] x [KV, d, P] product.
    The two parts are merged by log-sum-exp (shared running max, summed exponentials), so no
    [B, P + S] score tensor is concatenated. Products run in the cache dtype; the exponentials and
    the merge in float32.
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group_size = num_heads // num_kv_heads
    rows = batch * group_size
    suffix_mask = group.suffix_valid
    if sliding_window is not None:
        suffix_mask = suffix_mask & (group.suffix_positions > group.query_positions[:, None] - sliding_window)
    if not group.prefix_tokens and softcap is None:
        # Nothing shared: each row attends its own keys, which PyTorch's fused kernel does best.
        k = _gather(k_cache, group.suffix_slots).transpose(1, 2)  # [B, KV, S, d]
        v = _gather(v_cache, group.suffix_slots).transpose(1, 2)
        return F.scaled_dot_product_attention(q[:, :, None, :], k, v, attn_mask=suffix_mask[:, None, None, :],
                                              scale=scale, enable_gqa=True)[:, :, 0, :]
    # [KV, B*G, d]: the heads of one KV head, for every beam, as the rows of one matrix. The scale
    # goes on q (B x H x d numbers), not on the scores (B x H x (P + S)).
    q_rows = (q * scale).to(k_cache.dtype).view(batch, num_kv_heads, group_size, head_dim).transpose(0, 1)
    q_rows = q_rows.reshape(num_kv_heads, rows, head_dim)

    k_suffix = _kv_major(_gather(k_cache, group.suffix_slots))  # [KV, B, S, d]
    suffix_len = k_suffix.shape[2]
    # [KV, B, G, d] x [KV, B, d, S] -> [KV, B, G, S], which is [KV, B*G, S] with no copy
    suffix_scores = torch.matmul(q_rows.view(num_kv_heads, batch, group_size, head_dim), k_suffix.transpose(-1, -2))
    suffix_scores = suffix_scores.view(num_kv_heads, rows, suffix_len)
    parts = [_masked(_capped(suffix_scores, softcap), suffix_mask, group_size)]
    if group.prefix_tokens:
        k_prefix = _gather(k_cache, group.prefix_slots)  # [P, KV, d]
        prefix_scores = torch.bmm(q_rows, k_prefix.permute(1, 2, 0))  # [KV, B*G, P]
        prefix_mask = None
        if sliding_window is not None:
            prefix_positions = torch.arange(group.prefix_tokens, device=q.device)
            prefix_mask = prefix_positions[None, :] > group.query_positions[:, None] - sliding_window
        parts.insert(0, _masked(_capped(prefix_scores, softcap), prefix_mask, group_size))
    row_max = parts[0].amax(dim=-1, keepdim=True)
    for scores in parts[1:]:
        row_max = torch.maximum(row_max, scores.amax(dim=-1, keepdim=True))
    denominator = torch.zeros_like(row_max)
    out = None
    values = [_kv_major(_gather(v_cache, group.suffix_slots))]  # [KV, B, S, d]
    if group.prefix_tokens:
        values.insert(0, _gather(v_cache, group.prefix_slots))  # [P, KV, d]
    for scores, v in zip(parts, values):
        weights = (scores - row_max).exp_()  # float32, [KV, B*G, K]
        denominator += weights.sum(dim=-1, keepdim=True)
        weights = weights.to(v.dtype)
        if v.dim() == 3:  # the shared prefix: [KV, B*G, P] x [KV, P, d]
            part = torch.bmm(weights, v.transpose(0, 1))
        else:  # each beam's own keys: [KV, B, G, S] x [KV, B, S, d]
            part = torch.matmul(weights.view(num_kv_heads, batch, group_size, -1), v).view(num_kv_heads, rows, head_dim)
        out = part.float() if out is None else out + part
    out = out / denominator  # [KV, B*G, d]
    return out.view(num_kv_heads, batch, group_size, head_dim).transpose(0, 1).reshape(batch, num_heads, head_dim).to(q.dtype)


def _kv_major(x: torch.Tensor) -> torch.Tensor:
    """[B, S, KV, d] -> contiguous [KV, B, S, d]: one copy here makes both products copy-free."""
    return x.permute(2, 0, 1, 3).contiguous()


def _capped(raw: torch.Tensor, softcap: float | None) -> torch.Tensor:
    scores = raw.float()
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    return scores


def _masked(scores: torch.Tensor, mask: torch.Tensor | None, group_size: int) -> torch.Tensor:
    """scores [KV, B*G, K] with keys a beam may not see at -inf; mask [B, K] (None: all visible)."""
    if mask is None:
        return scores
    return scores.masked_fill(~mask.repeat_interleave(group_size, dim=0)[None], float("-inf"))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Same contract as `paged_attention_reference`; decoding sequences go through in groups."""
    out = torch.empty_like(q)
    decoding = set()
    for group in meta.decode_groups(q.device):
        out[group.token_index] = _attend_group(q[group.token_index], k_cache, v_cache, group, scale,
                                               sliding_window, softcap)
        decoding.update(group.token_index.tolist())
    for i in range(meta.num_seqs):
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        if end - start == 1 and start in decoding:
            continue
        seq_len = meta.seq_lens[i]
        slots = meta.key_slots(i, q.device)
        query_positions = torch.arange(seq_len - (end - start), seq_len, device=q.device)
        key_positions = torch.arange(meta.key_start(i), seq_len, device=q.device)
        mask = _causal_mask(query_positions, key_positions, sliding_window)
        k, v = _gather(k_cache, slots), _gather(v_cache, slots)  # [S, KV, d]
        if softcap is None:
            # PyTorch's fused kernel (flash attention on CPU): no [H, Q, S] score tensor in memory.
            out[start:end] = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                attn_mask=mask[None, None], scale=scale, enable_gqa=True,
            )[0].transpose(0, 1)
        else:
            out[start:end] = _attend(q[None, start:end], k[None], v[None], mask[None], scale, softcap)[0]
    return out
