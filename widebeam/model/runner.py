"""The model runner: owns the KV tensors and runs one batched forward over many sequences.

Callers (the engine) decide which tokens run and where their K/V go (slots from `widebeam.kv`); the
runner turns that into tensors, executes queued copy-on-write block copies, runs the model and
returns float32 logits.

The attention backend is chosen once, here (`attention_backend`, else $WIDEBEAM_ATTENTION_BACKEND,
else "sdpa"). Each step, before the forward, the backend builds every pool's metadata: all the
index tensors and masks the layers read, on the device, with the pool's window. The layers then
run without reading anything back to the host.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from widebeam.defaults import FLOAT_DTYPES, KV_CACHE_DTYPES
from widebeam.kv.spec import int8_scale_groups
from widebeam.model import kernels
from widebeam.model.attention.backends import get_attention_backend
from widebeam.model.attention.cross import CrossAttentionMetadata
from widebeam.model.attention.metadata import AttentionMetadata, tree_depths
from widebeam.model.attention.quantized_kv import SCALE_DTYPE, QuantizedKV, int8_read_dtype
from widebeam.model.families.arch import CROSS_POOL


@dataclass
class SequenceInput:
    """One sequence's share of a forward pass."""

    token_ids: list[int]  # the new tokens this step (a prefill chunk, or one decode token)
    num_computed_tokens: int  # tokens of this sequence already in the cache
    block_tables: dict[str, list[int]]  # pool name -> block ids, covering the new tokens too
    slots: dict[str, list[int]]  # pool name -> one slot per new token
    group: str | None = None  # sequences of one group (a request's beams) may share prefix blocks
    # Encoder-decoder models: the request's cross block table (shared by all its beams) and the
    # encoder output tokens it holds, E. `block_tables`/`slots` never name the cross pool.
    cross_block_table: list[int] | None = None
    num_encoder_tokens: int = 0
    # Speculative decoding: the sequence's last len(tree_parents) tokens (earlier levels possibly
    # already in the cache) form a token tree; entry j is node j's parent, -1 for the last token
    # before the tree. Nodes sit in the cache in logical order; a node's position is its depth below
    # that token, and it attends only to the tokens before the tree and its own ancestors.
    tree_parents: list[int] | None = None


class ModelRunner:
    def __init__(self, model: torch.nn.Module, pool_num_blocks: dict[str, int], tokens_per_block: int,
                 device: torch.device, dtype: torch.dtype, attention_backend: str | None = None,
                 kv_cache_dtype: str | None = None):
        """`kv_cache_dtype`: what the pools store (a float type, or "int8" with scales, read back in
        `dtype`: model/attention/quantized_kv.py); None or "auto": `dtype`."""
        self.model = model
        self.attention_backend = get_attention_backend(attention_backend)
        self.tokens_per_block = tokens_per_block
        self.device = device
        self.dtype = dtype
        arch = model.arch
        layer_pools = model.layer_pool_names
        # One tensor per pool: [layers_in_pool, K/V, num_slots, kv_heads, head_dim]; an int8 pool has a
        # second, its scales [layers_in_pool, K/V, num_slots, kv_heads, groups]. Left uninitialised: only
        # slots a sequence has written are ever read.
        quantized = kv_cache_dtype == "int8"
        if quantized:
            storage_dtype = torch.int8
        elif kv_cache_dtype in (None, "auto"):
            storage_dtype = dtype
        elif kv_cache_dtype in FLOAT_DTYPES:
            storage_dtype = getattr(torch, kv_cache_dtype)
        else:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got "
                             f"{kv_cache_dtype!r}")
        self.kv_tensors: dict[str, torch.Tensor] = {}
        self.kv_scales: dict[str, torch.Tensor] = {}
        for pool_name, num_blocks in pool_num_blocks.items():
            num_layers = layer_pools.count(pool_name)
            shape = (num_layers, 2, num_blocks * tokens_per_block, arch.num_kv_heads)
            self.kv_tensors[pool_name] = torch.empty(*shape, arch.head_dim, dtype=storage_dtype,
                                                     device=device)
            if quantized:
                self.kv_scales[pool_name] = torch.empty(*shape, int8_scale_groups(arch.head_dim),
                                                        dtype=SCALE_DTYPE, device=device)
        # Windowed pools release blocks behind the window; their metadata says so.
        self.pool_windows = {name: window for name, window in zip(layer_pools, arch.layer_windows)}
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor] | tuple[QuantizedKV, QuantizedKV]] = []
        index_in_pool = {name: 0 for name in pool_num_blocks}
        for pool_name in layer_pools:
            tensor = self.kv_tensors[pool_name]
            j = index_in_pool[pool_name]
            if quantized:
                scales = self.kv_scales[pool_name]
                read_dtype = int8_read_dtype(dtype, device)
                self.kv_caches.append(QuantizedKV.pair(tensor[j], scales[j], read_dtype))
            else:
                self.kv_caches.append((tensor[j, 0], tensor[j, 1]))
            index_in_pool[pool_name] += 1

    def copy_blocks(self, pool_name: str, copies: Sequence[tuple[int, int, int]]) -> None:
        """Run queued copy-on-write copies (src block, dst block, the leading slots to copy: a
        `kv.BlockCopy`) in every layer of the pool, as one gather and one scatter over the pool's
        slots (layers and K/V flattened: one index for all of them)."""
        if not copies:
            return
        t = self.tokens_per_block
        src_blocks, dst_blocks, num_tokens = torch.tensor(copies, dtype=torch.long).unbind(1)
        offsets = torch.arange(t)
        written = offsets < num_tokens[:, None]  # [copies, t]: the slots each copy carries
        src = (src_blocks[:, None] * t + offsets)[written].to(self.device)
        dst = (dst_blocks[:, None] * t + offsets)[written].to(self.device)
        # copied straight across (no gathered copy of every row first) unless a block both gives and takes
        direct = (self.device.type == "cpu" and kernels.copy_rows_enabled()
                  and not set(src_blocks.tolist()) & set(dst_blocks.tolist()))
        # an int8 pool's scales move with their values
        for tensor in (self.kv_tensors[pool_name], self.kv_scales.get(pool_name)):
            if tensor is None:
                continue
            # [layers x K/V, slots, kv_heads x d]
            flat = tensor.view(tensor.shape[0] * 2, tensor.shape[2], -1)
            if direct:
                torch.ops.widebeam.copy_rows(flat, dst, flat, src)
            else:
                flat.index_copy_(1, dst, flat.index_select(1, src))

    @torch.inference_mode()
    def execute(self, seqs: list[SequenceInput], all_logits: bool = False,
                num_logits: Sequence[int] | None = None) -> torch.Tensor:
        """Forward the new tokens of `seqs`; logits of each sequence's last token [num_seqs, vocab],
        of every token [num_tokens, vocab] when `all_logits`, or of each sequence's last
        `num_logits[i]` tokens, in order [sum(num_logits), vocab] (a speculative step: one row per
        prompt chunk, the last pending token and every drafted one per verified sequence)."""
        input_ids: list[int] = []
        positions: list[int] = []
        query_start_loc = [0]
        for seq in seqs:
            input_ids.extend(seq.token_ids)
            if seq.tree_parents:
                positions.extend(_tree_token_positions(seq))
            else:
                positions.extend(range(seq.num_computed_tokens, seq.num_computed_tokens + len(seq.token_ids)))
            query_start_loc.append(len(input_ids))
        seq_lens = [seq.num_computed_tokens + len(seq.token_ids) for seq in seqs]
        groups = [seq.group for seq in seqs]
        trees = [seq.tree_parents for seq in seqs]
        metadata: dict[str, AttentionMetadata | CrossAttentionMetadata] = {
            pool_name: self.attention_backend.build_metadata(
                query_start_loc=query_start_loc,
                seq_lens=seq_lens,
                block_tables=[seq.block_tables[pool_name] for seq in seqs],
                slot_mapping=[s for seq in seqs for s in seq.slots[pool_name]],
                tokens_per_block=self.tokens_per_block,
                device=self.device,
                groups=groups,
                sliding_window=self.pool_windows.get(pool_name),
                trees=trees,
            )
            for pool_name in self.kv_tensors if pool_name != CROSS_POOL
        }
        if CROSS_POOL in self.kv_tensors:
            metadata[CROSS_POOL] = self._cross_metadata(seqs, query_start_loc)
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.long, device=self.device),
            torch.tensor(positions, dtype=torch.long, device=self.device),
            self.kv_caches,
            metadata,
        )
        if num_logits is not None:
            rows = [r for end, n in zip(query_start_loc[1:], num_logits) for r in range(end - n, end)]
            hidden = hidden[torch.tensor(rows, device=self.device)]
        elif not all_logits:
            last = torch.tensor([end - 1 for end in query_start_loc[1:]], device=self.device)
            hidden = hidden[last]
        return self.model.compute_logits(hidden)

    def _cross_metadata(self, seqs: list[SequenceInput],
                        query_start_loc: list[int]) -> CrossAttentionMetadata:
        missing = [i for i, seq in enumerate(seqs)
                   if seq.cross_block_table is None or seq.num_encoder_tokens < 1]
        if missing:
            raise ValueError(f"sequences {missing[:5]} of an encoder-decoder model have no encoder output")
        meta = CrossAttentionMetadata(query_start_loc=query_start_loc,
                                      block_tables=[seq.cross_block_table for seq in seqs],
                                      encoder_lens=[seq.num_encoder_tokens for seq in seqs],
                                      tokens_per_block=self.tokens_per_block)
        meta.groups(self.device)  # built here, once per step, not in the first layer
        return meta

    @torch.inference_mode()
    def encode(self, sources: list[list[int]], cross_slots: list[list[int]]) -> None:
        """Run the encoder once over each source (one padding-free batch) and write every decoder
        layer's cross-attention K/V at `cross_slots` (one slot per source token, from
        `CrossAttentionManager.slots`). Must run before the first `execute` that reads them."""
        if not sources:
            return
        input_ids = [t for source in sources for t in source]
        positions = [p for source in sources for p in range(len(source))]
        query_start_loc = [0]
        for source, slots in zip(sources, cross_slots):
            if len(slots) != len(source):
                raise ValueError(f"{len(source)} source tokens but {len(slots)} cross slots")
            query_start_loc.append(query_start_loc[-1] + len(source))
        cross_caches = [kv for kv, name in zip(self.kv_caches, self.model.layer_pool_names)
                        if name == CROSS_POOL]
        self.model.encode(
            torch.tensor(input_ids, dtype=torch.long, device=self.device),
            torch.tensor(positions, dtype=torch.long, device=self.device),
            query_start_loc,
            cross_caches,
            torch.tensor([s for slots in cross_slots for s in slots], dtype=torch.long, device=self.device),
        )


def _tree_token_positions(seq: SequenceInput) -> list[int]:
    """Positions of a tree sequence's new tokens: a linear token's is its logical index, a tree
    node's is tree_start - 1 + its depth (siblings share one)."""
    seq_len = seq.num_computed_tokens + len(seq.token_ids)
    tree_start = seq_len - len(seq.tree_parents)
    if tree_start < 0:
        raise ValueError(f"a tree of {len(seq.tree_parents)} nodes in a sequence of {seq_len} tokens")
    tree_positions = [tree_start - 1 + depth for depth in tree_depths(seq.tree_parents)]
    return [i if i < tree_start else tree_positions[i - tree_start]
            for i in range(seq.num_computed_tokens, seq_len)]
