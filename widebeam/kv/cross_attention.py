"""The cross-attention pool's manager: the encoder output's K/V, one table per request."""

from __future__ import annotations

from widebeam.errors import BlockStateError
from widebeam.kv.budget import KVRequest, cross_attention_blocks
from widebeam.kv.pool_manager import PoolManager
from widebeam.kv.tables import BlockTable


class CrossAttentionManager(PoolManager):
    """Encoder output K/V: allocated once per request, shared by all beams, freed at finish."""

    def required_blocks(self, request: KVRequest) -> int:
        return cross_attention_blocks(request.encoder_tokens, self.tokens_per_block)

    def uses(self, request: KVRequest) -> bool:
        return request.encoder_tokens > 0

    def fit_detail(self, request: KVRequest) -> str:
        return (f"the encoder output has {request.encoder_tokens} tokens and at most "
                f"{self.capacity_blocks() * self.tokens_per_block} fit")

    def append_slots(self, table: BlockTable, num_tokens: int = 1) -> list[int]:
        """All of the encoder output at once: the table never grows after."""
        self._check_live(table)
        if table.block_ids:
            raise BlockStateError("a cross table is written once, by the encoder")
        for _ in range(cross_attention_blocks(num_tokens, self.tokens_per_block)):
            table.block_ids.append(self._allocate(table.holding))
        table.num_tokens = num_tokens
        return self.slots(table)

    def append_blocks(self, tables: list[BlockTable], num_tokens: int) -> int:
        # a table is written once: only the ones still empty take blocks
        num_blocks = cross_attention_blocks(num_tokens, self.tokens_per_block)
        return sum(num_blocks for table in tables if not table.block_ids)

    def slots(self, table: BlockTable) -> list[int]:
        t = self.tokens_per_block
        return [table.block_ids[i // t] * t + i % t for i in range(table.num_tokens)]
