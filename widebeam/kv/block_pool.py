"""A fixed set of KV blocks with reference counts, a free list and a cache of computed blocks.

Every block is in one of three states:
- **in use**: ref count > 0 (beams' block tables point at it; a pinned prefix holds one reference
  for good). A block is shared (ref count > 1) when several tables point at it.
- **cached-evictable**: ref count 0, but its K/V are a computed prompt block registered under a
  hash (`register`); a later request may take it back (`touch`). It is evicted least recently
  released first when a block is needed.
- **free**: ref count 0, no content anyone can find.

Free and evictable blocks together are what can be handed out (`num_free_blocks`): `allocate`
takes a free block first and evicts only when none is left, so no allocation path reports the pool
full while evictable blocks remain. The pool only hands out ids: the K/V tensors indexed by those
ids belong to the model runner.

Memory is O(blocks ever handed out), not O(`num_blocks`): the ids never handed out are a count
(`_num_untouched`), so a pool of 2^40 blocks (what `widebeam plan` builds for a large memory) costs
nothing until it is used. Ids are handed out in the order an explicit free list [0, 1, 2, ...] would
give them, returned blocks first (last returned, first reused).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from widebeam.errors import BlockStateError, OutOfBlocksError


class BlockPool:
    def __init__(self, num_blocks: int, name: str = "pool"):
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.name = name
        self.num_blocks = num_blocks
        # One entry per block ever handed out (ids 0 .. len - 1); ids past it were never used.
        self._ref_counts: list[int] = []
        # Blocks handed out and returned, popped from the end: the last returned is reused first.
        self._free_block_ids: list[int] = []
        # Cached-evictable blocks, least recently released first (the eviction order).
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._hash_to_block: dict[bytes, int] = {}
        self._block_to_hash: dict[int, bytes] = {}
        self._pinned: set[int] = set()
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks not in use: free plus cached-evictable (what `allocate` can hand out)."""
        return len(self._free_block_ids) + self._num_untouched + len(self._evictable)

    @property
    def _num_untouched(self) -> int:
        """Blocks never handed out: the next one is id `len(self._ref_counts)`."""
        return self.num_blocks - len(self._ref_counts)

    @property
    def num_evictable_blocks(self) -> int:
        return len(self._evictable)

    @property
    def num_pinned_blocks(self) -> int:
        return len(self._pinned)

    def ref_count(self, block_id: int) -> int:
        self._check_id(block_id)
        return self._ref_counts[block_id] if block_id < len(self._ref_counts) else 0

    def allocate(self) -> int:
        """Take one block (free first, else evict the least recently released cached one); its ref
        count becomes 1."""
        if self._free_block_ids:
            block_id = self._free_block_ids.pop()
        elif len(self._ref_counts) < self.num_blocks:
            block_id = len(self._ref_counts)
            self._ref_counts.append(1)
            return block_id
        elif self._evictable:
            block_id, _ = self._evictable.popitem(last=False)
            del self._hash_to_block[self._block_to_hash.pop(block_id)]
            self.num_evictions += 1
        else:
            raise OutOfBlocksError(f"pool '{self.name}' has no free block (all {self.num_blocks} in use)")
        self._ref_counts[block_id] = 1
        return block_id

    def inc_ref(self, block_id: int) -> None:
        """Add a reference to a block in use (a fork shares it)."""
        self._check_live(block_id, "inc_ref")
        self._ref_counts[block_id] += 1

    def dec_ref(self, block_id: int) -> bool:
        """Drop one reference; return True when the block left use (free, or cached-evictable)."""
        self._check_live(block_id, "dec_ref")
        self._ref_counts[block_id] -= 1
        if self._ref_counts[block_id] == 0:
            if block_id in self._block_to_hash:
                self._evictable[block_id] = None
            else:
                self._free_block_ids.append(block_id)
            return True
        return False

    def inc_ref_many(self, block_ids: Iterable[int]) -> None:
        """`inc_ref` on each block, in order (a fork shares a whole table): one loop over the ref
        counts, not a checked call per block; a wide beam step forks hundreds of long tables."""
        counts = self._ref_counts
        num_touched = len(counts)
        for block_id in block_ids:
            if not 0 <= block_id < num_touched or counts[block_id] <= 0:
                self._check_live(block_id, "inc_ref")  # raises, naming the block
            counts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> int:
        """Drop one reference from each block, in order (`dec_ref` on each, in one loop); return how
        many blocks left use."""
        counts, cached = self._ref_counts, self._block_to_hash
        num_touched = len(counts)
        num_left = 0
        for block_id in block_ids:
            if not 0 <= block_id < num_touched or counts[block_id] <= 0:
                self._check_live(block_id, "dec_ref")  # raises, naming the block
            count = counts[block_id] - 1
            counts[block_id] = count
            if count == 0:
                if block_id in cached:
                    self._evictable[block_id] = None
                else:
                    self._free_block_ids.append(block_id)
                num_left += 1
        return num_left

    # -- the cache of computed blocks ----------------------------------------------------------------
    def lookup(self, block_hash: bytes) -> int | None:
        """The block registered under `block_hash` (in use or evictable), or None. No side effect."""
        return self._hash_to_block.get(block_hash)

    def register(self, block_id: int, block_hash: bytes) -> bool:
        """Record that an in-use block holds the computed content `block_hash`; False (nothing
        changes) when another block already holds it or this block is registered."""
        self._check_live(block_id, "register")
        if block_hash in self._hash_to_block or block_id in self._block_to_hash:
            return False
        self._hash_to_block[block_hash] = block_id
        self._block_to_hash[block_id] = block_hash
        return True

    def touch(self, block_id: int) -> bool:
        """Take a reference to a cached block (a prefix hit): an evictable block comes back into
        use. Returns True when it was evictable (the hit took it from what could be handed out)."""
        self._check_id(block_id)
        if block_id not in self._block_to_hash:
            raise BlockStateError(f"pool '{self.name}': touch on block {block_id}, which holds no cached "
                                  "content")
        was_evictable = self._ref_counts[block_id] == 0
        if was_evictable:
            del self._evictable[block_id]
        self._ref_counts[block_id] += 1
        return was_evictable

    def pin(self, block_id: int) -> None:
        """Hold a cached block for good (a pinned prefix): one reference that is never dropped."""
        if block_id in self._pinned:
            return
        self.touch(block_id)
        self._pinned.add(block_id)

    def evict_all(self) -> int:
        """Forget every cached-evictable block (they become free); returns how many. Blocks in use
        and pinned ones keep their names."""
        num_evicted = len(self._evictable)
        for block_id in self._evictable:
            del self._hash_to_block[self._block_to_hash.pop(block_id)]
            self._free_block_ids.append(block_id)
        self._evictable.clear()
        return num_evicted

    def pinned_hashes(self) -> list[bytes]:
        """The names of the pinned blocks (a pinned block is always a registered prompt block)."""
        return [self._block_to_hash[b] for b in sorted(self._pinned)]

    def is_pinned(self, block_id: int) -> bool:
        return block_id in self._pinned

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise BlockStateError(f"pool '{self.name}': block id {block_id} out of range "
                                  f"[0, {self.num_blocks})")

    def _check_live(self, block_id: int, op: str) -> None:
        if self.ref_count(block_id) <= 0:
            raise BlockStateError(f"pool '{self.name}': {op} on block {block_id}, which is free")
