"""A fixed set of KV blocks with reference counts and a free list.

A block is shared (ref count > 1) when several beams' block tables point at it; it returns to the
free list when its last reference is dropped. The pool only hands out ids: the K/V tensors indexed
by those ids belong to the model runner.
"""

from __future__ import annotations

from collections.abc import Iterable

from widebeam.errors import BlockStateError, OutOfBlocksError


class BlockPool:
    def __init__(self, num_blocks: int, name: str = "pool"):
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.name = name
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        # Pop from the end; reversed so block 0 is handed out first (easier to read in tests and dumps).
        self._free_block_ids = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free_block_ids)

    def ref_count(self, block_id: int) -> int:
        self._check_id(block_id)
        return self._ref_counts[block_id]

    def allocate(self) -> int:
        """Take one free block; its ref count becomes 1."""
        if not self._free_block_ids:
            raise OutOfBlocksError(f"pool '{self.name}' has no free block (all {self.num_blocks} in use)")
        block_id = self._free_block_ids.pop()
        self._ref_counts[block_id] = 1
        return block_id

    def allocate_many(self, num_blocks: int) -> list[int]:
        if num_blocks > len(self._free_block_ids):
            raise OutOfBlocksError(
                f"pool '{self.name}' has {len(self._free_block_ids)} free blocks, {num_blocks} requested"
            )
        return [self.allocate() for _ in range(num_blocks)]

    def inc_ref(self, block_id: int) -> None:
        """Add a reference to a block in use (a fork shares it)."""
        self._check_live(block_id, "inc_ref")
        self._ref_counts[block_id] += 1

    def dec_ref(self, block_id: int) -> bool:
        """Drop one reference; return True when this freed the block."""
        self._check_live(block_id, "dec_ref")
        self._ref_counts[block_id] -= 1
        if self._ref_counts[block_id] == 0:
            self._free_block_ids.append(block_id)
            return True
        return False

    def free(self, block_ids: Iterable[int]) -> int:
        """Drop one reference from each block; return how many blocks went back to the free list."""
        return sum(self.dec_ref(block_id) for block_id in block_ids)

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise BlockStateError(f"pool '{self.name}': block id {block_id} out of range [0, {self.num_blocks})")

    def _check_live(self, block_id: int, op: str) -> None:
        self._check_id(block_id)
        if self._ref_counts[block_id] <= 0:
            raise BlockStateError(f"pool '{self.name}': {op} on block {block_id}, which is free")
