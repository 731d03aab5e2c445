"""The attention backends' reads through the C++ kernels (kernels/attention.cpp): which reads they serve
(`use_kernel`), and the calls: rows against a run or list of slots (`kernel_attention`), a decode group's
shared prefix and own keys in one op (`kernel_group`), a cross-attention group's shared keys
(`kernel_shared_keys`). The torch paths beside them stay in backends.py, the reference they are tested
against.
"""

from __future__ import annotations

import torch

from widebeam.model import kernels
from widebeam.model.attention.metadata import DecodeGroup
from widebeam.model.attention.quantized_kv import is_pair

# An int8 cache's reads with at most this many query rows (a KV head's grouped heads times the beams)
# go through the C++ kernel (kernels/attention.cpp: dequantized on the fly, float32), wider ones through
# the chunked dequantize and PyTorch's flash kernel, which wins at many rows. Measured
# on a shared prefix of 512 tokens, 3 KV heads of 64, 2 threads (kernel / torch path, us a layer): 3 rows
# 62 / 190, 48 rows 262 / 333, 96 rows 423 / 477, 192 rows 823 / 701.
KERNEL_MAX_ROWS = 96
# A decode group's prefix and beams' own keys in one kernel op (`kernel_group`) up to this many rows:
# besides the prefix it saves the suffix's gathers, dequantizing, score tensors and merge. Measured
# (a group with 16 own keys a beam, us a layer, kernel / torch path): 512 prefix tokens, 48 rows 357 /
# 907, 192 rows 1,097 / 1,313, 384 rows 2,302 / 2,288; 2,048 prefix tokens, 96 rows 1,808 / 2,692, 192
# rows 3,909 / 3,883.
KERNEL_GROUP_MAX_ROWS = 192
# A float32 or bfloat16 cache's reads go through the kernel (nothing to dequantize: what it saves is the
# torch path's ops, gathers and score tensors) up to this many rows. Measured (`_attend_group`, 16 own
# keys a beam, 3 KV heads of 64, us a layer, kernel / torch path): float32, 128 prefix tokens, 12 rows 57 /
# 165, 48 rows 130 / 243; 1,024 tokens 12 rows 187 / 282, 48 rows 543 / 589, 96 rows 999 / 883; bfloat16
# 12 rows 62 / 302 (128 tokens), 170 / 444 (1,024), 96 rows 923 / 1,033.
DENSE_KERNEL_MAX_ROWS = 64
# A biased group (T5's decoder self-attention) goes through the group op, each beam reading the shared
# prefix as its own keys, while beams x keys stays at most this: a wider group reads its prefix B times
# over (from cache: T5-small's 8 heads x 64 keys of 64 dims are 128 KB). Measured (t5-small shape, 4
# sources, 64 new tokens, whole run, kernel / torch path, benchmarks/seq2seq_switch_ab.py): float32 W=1
# 0.99x, 4 0.90x, 16 0.92x, 64 (~4,500 keys) 0.96x; int8 0.96x, 0.87x, 0.75x, 0.87x.
BIASED_GROUP_MAX_KEYS = 16384
# biased groups through the group op at all (benchmarks/seq2seq_switch_ab.py switches it; tests too)
BIASED_GROUPS_ENABLED = True


def use_kernel(k_cache, v_cache, rows: int, max_rows: int = KERNEL_MAX_ROWS) -> bool:
    """Whether a read of `rows` query rows goes through the C++ kernel (kernels/attention.cpp): a CPU
    cache, few rows (or any number, tiled, at a head size `kernels.FLASH_HEAD_DIMS` lists), the kernels
    built and on; an int8 pair read in the stored domain (nothing to un-rotate) as float32 or bfloat16
    (which the kernel rounds to as the torch path does), or a float32 or bfloat16 cache laid out as the
    pools allocate it."""
    if k_cache.device.type != "cpu":
        return False
    dense = isinstance(k_cache, torch.Tensor)
    if rows > (min(max_rows, DENSE_KERNEL_MAX_ROWS) if dense else max_rows) and not (
            kernels.flash_rows_enabled() and k_cache.shape[-1] in kernels.FLASH_HEAD_DIMS):
        return False
    if not dense:
        return (is_pair(k_cache, v_cache) and k_cache.unrotate is None and v_cache.unrotate is None
                and kernels.enabled() and k_cache.read_dtype in (torch.float32, torch.bfloat16))
    return (kernels.dense_attention_enabled()
            and k_cache.dtype in (torch.float32, torch.bfloat16) and v_cache.dtype == k_cache.dtype
            and k_cache.is_contiguous() and v_cache.is_contiguous())


def kernel_attention(q_rows: torch.Tensor, k_cache, v_cache, start: int = 0, end: int = 0,
                     index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`backends.chunk_attention` of q_rows [KV, R, d] (scaled) against the slots start..end (or the slots
    `index`) in one op: (out [KV, R, d], lse [KV, R, 1]), float32; an int8 pair's K/V dequantized as read
    (and rounded to the cache's read dtype)."""
    q_rows = q_rows.float().contiguous()
    if isinstance(k_cache, torch.Tensor):
        return torch.ops.widebeam.dense_attention(q_rows, k_cache, v_cache, start, end, index)
    return torch.ops.widebeam.int8_attention(q_rows, k_cache.pair_values, k_cache.pair_scales, start, end,
                                             index, k_cache.read_dtype == torch.bfloat16)


def kernel_group(q: torch.Tensor, k_cache, v_cache, group: DecodeGroup, scale: float) -> torch.Tensor:
    """`backends._attend_group`'s prefix and suffix parts, merged, in one op of the C++ kernel: q [B, H, d] ->
    [B, H, d], nothing gathered (or dequantized) in between; q scaled and regrouped into the kernel's
    [KV, B*G, d] rows, and the output back into [B, H, d], inside the op."""
    if group.prefix_start is not None:
        start, end, index = group.prefix_start, group.prefix_start + group.prefix_tokens, None
    else:
        start, end, index = 0, 0, group.prefix_slots.contiguous()
    suffix_slots, suffix_mask = group.suffix_slots.contiguous(), group.suffix_mask.contiguous()
    if isinstance(k_cache, torch.Tensor):
        return torch.ops.widebeam.dense_group_attention(q, scale, k_cache, v_cache, start, end, index,
                                                        suffix_slots, suffix_mask)
    return torch.ops.widebeam.int8_group_attention(
        q, scale, k_cache.pair_values, k_cache.pair_scales, start, end, index, suffix_slots, suffix_mask,
        k_cache.read_dtype == torch.bfloat16)


def kernel_biased_group(q: torch.Tensor, k_cache, v_cache, group: DecodeGroup, scale: float,
                        position_bias) -> torch.Tensor:
    """A decode group with a position bias (T5's decoder) in one op, the bias added to every score: each
    beam reads its own keys and the shared prefix (if any) as its own keys too (slots and mask [B, P + S],
    bias `position_bias.group_keys`), since a bias differs per beam and key. With a prefix, worth it only
    while B x (P + S) stays small (BIASED_GROUP_MAX_KEYS): the prefix is read once a beam, not once a
    group."""
    batch, prefix_tokens = group.suffix_slots.shape[0], group.prefix_tokens
    slots = torch.cat((group.prefix_slots[None, :].expand(batch, prefix_tokens), group.suffix_slots), dim=1)
    mask = torch.cat((torch.ones(batch, prefix_tokens, dtype=torch.bool, device=slots.device),
                      group.suffix_mask), dim=1)
    bias = position_bias.group_keys(group).float()  # float32, as the torch path adds it to its scores
    no_keys = torch.empty(0, dtype=torch.long, device=q.device)
    if isinstance(k_cache, torch.Tensor):
        return torch.ops.widebeam.dense_group_attention(q, scale, k_cache, v_cache, 0, 0, no_keys,
                                                        slots.contiguous(), mask.contiguous(), bias)
    return torch.ops.widebeam.int8_group_attention(q, scale, k_cache.pair_values, k_cache.pair_scales, 0, 0,
                                                   no_keys, slots.contiguous(), mask.contiguous(),
                                                   k_cache.read_dtype == torch.bfloat16, bias)


def kernel_shared_keys(q: torch.Tensor, k_cache, v_cache, slots: torch.Tensor,
                       slot_run: tuple[int, int] | None, scale: float) -> torch.Tensor | None:
    """q [n, H, d] against every key at `slots` (a run of slots start..end when `slot_run` says so), no
    mask: a cross-attention group (cross.py), through the kernel's group op with no own keys. None where
    the kernel does not serve (the caller's torch path does)."""
    num_kv_heads = k_cache.shape[1]
    # an int8 pool as the runner hands it is read un-rotated: `use_kernel` leaves that to the torch path
    if not use_kernel(k_cache, v_cache, q.shape[0] * (q.shape[1] // num_kv_heads), KERNEL_GROUP_MAX_ROWS):
        return None
    start, end, index = (*slot_run, None) if slot_run is not None else (0, 0, slots.contiguous())
    no_keys = torch.empty(q.shape[0], 0, dtype=torch.long, device=q.device)
    no_mask = torch.empty(q.shape[0], 0, dtype=torch.bool, device=q.device)
    if isinstance(k_cache, torch.Tensor):
        return torch.ops.widebeam.dense_group_attention(q, scale, k_cache, v_cache, start, end, index,
                                                        no_keys, no_mask)
    return torch.ops.widebeam.int8_group_attention(q, scale, k_cache.pair_values, k_cache.pair_scales, start,
                                                   end, index, no_keys, no_mask,
                                                   k_cache.read_dtype == torch.bfloat16)
