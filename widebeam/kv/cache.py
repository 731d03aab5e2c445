"""The KV cache as the rest of the engine sees it: named pools, their budgets, their stats."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from widebeam.errors import RequestTooLargeError
from widebeam.kv.block_pool import BlockPool
from widebeam.kv.budget import KVRequest
from widebeam.kv.managers import PoolManager, make_manager
from widebeam.kv.request_kv import RequestKV
from widebeam.kv.spec import PoolSpec


@dataclass(frozen=True)
class PoolBudget:
    """One pool's verdict on one request, in blocks of that pool."""

    pool: str
    required_blocks: int
    capacity_blocks: int

    @property
    def fits(self) -> bool:
        return self.required_blocks <= self.capacity_blocks


class KVCache:
    """Block pools, one per pool spec, with their managers. Holds ids only, never tensors."""

    def __init__(self, pools: Sequence[tuple[PoolSpec, int]], tokens_per_block: int,
                 prefill_chunk_tokens: int | None = None):
        """`prefill_chunk_tokens`: the largest prompt chunk one step writes (sliding-window bounds
        depend on it); None means whole prompts."""
        if tokens_per_block < 1:
            raise ValueError(f"tokens_per_block must be >= 1, got {tokens_per_block}")
        self.tokens_per_block = tokens_per_block
        self.managers: dict[str, PoolManager] = {}
        for spec, num_blocks in pools:
            if spec.name in self.managers:
                raise ValueError(f"duplicate pool name {spec.name!r}")
            pool = BlockPool(num_blocks, name=spec.name)
            self.managers[spec.name] = make_manager(spec, pool, tokens_per_block, prefill_chunk_tokens)

    def __getitem__(self, pool_name: str) -> PoolManager:
        return self.managers[pool_name]

    def budgets(self, request: KVRequest) -> list[PoolBudget]:
        """`(pool, required_blocks, capacity_blocks)` for every pool the request uses."""
        return [
            PoolBudget(name, manager.required_blocks(request), manager.capacity_blocks())
            for name, manager in self.managers.items()
            if manager.uses(request)
        ]

    def check_fits(self, request: KVRequest) -> list[PoolBudget]:
        """Return the budgets, or raise `RequestTooLargeError` for the first pool the request can never fit."""
        budgets = self.budgets(request)
        for budget in budgets:
            if not budget.fits:
                manager = self.managers[budget.pool]
                raise RequestTooLargeError(
                    pool=budget.pool,
                    required_blocks=budget.required_blocks,
                    capacity_blocks=budget.capacity_blocks,
                    prompt_len=request.prompt_tokens,
                    max_new_tokens=request.max_new_tokens,
                    beam_width=request.beam_width,
                    tokens_per_block=self.tokens_per_block,
                    detail=manager.fit_detail(request),
                    **manager.fit_hints(request),
                )
        return budgets

    def new_request(self) -> RequestKV:
        """The coordinator that does all of one request's allocation in these pools."""
        return RequestKV(self)

    def take_copies(self) -> dict[str, list[tuple[int, int]]]:
        """Queued copy-on-write copies (src_block_id, dst_block_id) per pool, handed over once;
        the runner must run them before the forward pass that writes the copies."""
        return {name: copies for name, m in self.managers.items() if (copies := m.take_copies())}

    def num_free_blocks(self) -> dict[str, int]:
        return {name: m.pool.num_free_blocks for name, m in self.managers.items()}

    def stats(self) -> dict[str, dict[str, int | str]]:
        return {
            name: {
                "kind": m.spec.kind,
                "total_blocks": m.pool.num_blocks,
                "free_blocks": m.pool.num_free_blocks,
                "bytes_per_block": m.spec.bytes_per_block(self.tokens_per_block),
            }
            for name, m in self.managers.items()
        }
