"""The KV cache as the rest of the engine sees it: named pools, their budgets, their stats."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from widebeam.errors import RequestTooLargeError
from widebeam.kv.block_pool import BlockPool
from widebeam.kv.budget import KVRequest
from widebeam.kv.managers import make_manager
from widebeam.kv.pool_manager import PoolManager
from widebeam.kv.prefix import PrefixHit, PrefixKey, prefix_key
from widebeam.kv.request_kv import RequestKV
from widebeam.kv.spec import PoolSpec
from widebeam.kv.tables import DROPPED, BlockCopy


@dataclass(frozen=True)
class PoolBudget:
    """One pool's verdict on one request, in blocks of that pool."""

    pool: str
    required_blocks: int
    capacity_blocks: int
    pinned_hit_blocks: int = 0  # blocks of a pinned prefix the request shares: always there

    @property
    def fits(self) -> bool:
        return self.required_blocks - self.pinned_hit_blocks <= self.capacity_blocks


class KVCache:
    """Block pools, one per pool spec, with their managers. Holds ids only, never tensors."""

    def __init__(self, pools: Sequence[tuple[PoolSpec, int]], tokens_per_block: int,
                 prefill_chunk_tokens: int | None = None, enable_prefix_caching: bool = False):
        """`prefill_chunk_tokens`: the largest prompt chunk one step writes (sliding-window bounds
        depend on it); None means whole prompts. `enable_prefix_caching`: computed prompt blocks
        stay cached for later requests (kv/prefix.py)."""
        if tokens_per_block < 1:
            raise ValueError(f"tokens_per_block must be >= 1, got {tokens_per_block}")
        self.tokens_per_block = tokens_per_block
        self.enable_prefix_caching = enable_prefix_caching
        self.num_queried_tokens = 0  # prompt tokens looked up when requests were admitted
        self.num_hit_tokens = 0  # of those, the ones found cached
        self.managers: dict[str, PoolManager] = {}
        for spec, num_blocks in pools:
            if spec.name in self.managers:
                raise ValueError(f"duplicate pool name {spec.name!r}")
            pool = BlockPool(num_blocks, name=spec.name)
            self.managers[spec.name] = make_manager(spec, pool, tokens_per_block, prefill_chunk_tokens)

    def __getitem__(self, pool_name: str) -> PoolManager:
        return self.managers[pool_name]

    def budgets(self, request: KVRequest,
                pinned_hit_blocks: dict[str, int] | None = None) -> list[PoolBudget]:
        """`(pool, required_blocks, capacity_blocks)` for every pool the request uses, and the
        blocks of pinned prefixes it shares (`pinned_hit(key).credit_blocks`)."""
        pinned = pinned_hit_blocks or {}
        return [
            PoolBudget(name, manager.required_blocks(request), manager.capacity_blocks(), pinned.get(name, 0))
            for name, manager in self.managers.items()
            if manager.uses(request)
        ]

    def check_fits(self, request: KVRequest,
                   pinned_hit_blocks: dict[str, int] | None = None) -> list[PoolBudget]:
        """Return the budgets, or raise `RequestTooLargeError` for the first pool the request can
        never fit: its required blocks, less the pinned prefix blocks it shares, against the pool
        less every pinned block."""
        budgets = self.budgets(request, pinned_hit_blocks)
        for budget in budgets:
            if not budget.fits:
                manager = self.managers[budget.pool]
                raise RequestTooLargeError(
                    pool=budget.pool,
                    required_blocks=budget.required_blocks - budget.pinned_hit_blocks,
                    capacity_blocks=budget.capacity_blocks,
                    prompt_len=request.prompt_tokens,
                    max_new_tokens=request.max_new_tokens,
                    beam_width=request.beam_width,
                    tokens_per_block=self.tokens_per_block,
                    detail=manager.fit_detail(request),
                    **manager.fit_hints(request),
                )
        return budgets

    def new_request(self, key: PrefixKey | None = None, encoder_tokens: int = 0) -> RequestKV:
        """The coordinator that does all of one request's allocation in these pools; with a prefix
        `key`, it names the prompt blocks it computes so later requests find them. `encoder_tokens`:
        the encoder output's length (an encoder-decoder request's source), 0 for none."""
        return RequestKV(self, key if self.enable_prefix_caching else None, encoder_tokens)

    def max_refeed_tokens(self, max_tokens: int) -> int:
        """The most tokens a request resumed after a preemption may re-feed in one step, in all, when
        the step's budget allows `max_tokens`: fewer where a pool's bound assumes fewer writes per
        sequence a step."""
        limits = [m.max_refeed_tokens_per_sequence for m in self.managers.values()]
        return min([max_tokens] + [limit for limit in limits if limit is not None])

    # -- prefix reuse -------------------------------------------------------------------------------
    def prefix_key(self, token_ids: Sequence[int],
                   encoder_token_ids: Sequence[int] | None = None) -> PrefixKey:
        return prefix_key(token_ids, self.tokens_per_block, encoder_token_ids)

    def find_hit(self, key: PrefixKey | None) -> PrefixHit:
        """What is cached of a request's prompt now, in every pool at once (no side effects).

        The per-sequence pools share one length: the longest prefix, in whole blocks and leaving at
        least one prompt token to compute (its logits choose the first token), whose blocks every
        such pool still holds (a sliding pool only those its window still needs). The encoder
        output is found whole or not at all."""
        hit = PrefixHit()
        if key is None or not self.enable_prefix_caching:
            return hit
        hit.block_ids = self._prompt_hit(key, pinned_only=False)
        if hit.block_ids:
            hit.num_tokens = len(next(iter(hit.block_ids.values()))) * self.tokens_per_block
        if key.encoder_block_hashes:
            shared = {name: [m.pool.lookup(h) for h in key.encoder_block_hashes]
                      for name, m in self.managers.items() if not m.spec.per_sequence}
            if shared and all(None not in ids for ids in shared.values()):
                hit.num_encoder_tokens = key.encoder_tokens
                hit.shared_block_ids = shared
        for name, ids in {**hit.block_ids, **hit.shared_block_ids}.items():
            manager = self.managers[name]
            hit.credit_blocks[name] = manager.hit_credit(ids)
            hit.evictable_blocks[name] = sum(1 for b in ids
                                             if b != DROPPED and manager.pool.ref_count(b) == 0)
        return hit

    def _prompt_hit(self, key: PrefixKey, pinned_only: bool) -> dict[str, list[int]]:
        """Per per-sequence pool, the prompt table entries of the longest joint hit (see `find_hit`);
        empty when there is none. `pinned_only`: what pinned blocks alone guarantee."""
        per_sequence = [(name, m) for name, m in self.managers.items() if m.spec.per_sequence]
        found = {}
        for name, m in per_sequence:
            ids = [m.pool.lookup(h) for h in key.block_hashes]
            found[name] = [b if b is None or not pinned_only or m.pool.is_pinned(b) else None for b in ids]
        num_blocks = min((key.prompt_tokens - 1) // self.tokens_per_block, len(key.block_hashes))
        def all_found(num_blocks: int) -> bool:
            return all(all(found[name][i] is not None for i in m.hit_block_range(num_blocks))
                       for name, m in per_sequence)

        while num_blocks > 0 and not all_found(num_blocks):
            num_blocks -= 1
        if not num_blocks:
            return {}
        entries = {}
        for name, m in per_sequence:
            needed = m.hit_block_range(num_blocks)
            entries[name] = [found[name][i] if i in needed else DROPPED for i in range(num_blocks)]
        return entries

    def reset_prefix_cache(self) -> int:
        """Forget every cached block no request holds (pinned prefixes stay); returns how many."""
        return sum(m.pool.evict_all() for m in self.managers.values())

    def record_lookup(self, key: PrefixKey | None, hit: PrefixHit) -> None:
        """Count one admitted request's lookup for the hit rate (prompt tokens, and encoder tokens)."""
        if key is not None and self.enable_prefix_caching:
            self.num_queried_tokens += key.prompt_tokens + key.encoder_tokens
            self.num_hit_tokens += hit.num_cached_tokens

    def prefix_blocks(self, key: PrefixKey) -> dict[str, list[bytes]]:
        """Per per-sequence pool, the names of the blocks a hit on all of `key`'s full blocks needs
        (what pinning it holds)."""
        n = len(key.block_hashes)
        return {name: [key.block_hashes[i] for i in m.hit_block_range(n)]
                for name, m in self.managers.items() if m.spec.per_sequence}

    def pin(self, key: PrefixKey) -> None:
        """Hold the cached blocks of `key`'s whole prompt for good (it was just computed)."""
        for name, hashes in self.prefix_blocks(key).items():
            pool = self.managers[name].pool
            block_ids = [pool.lookup(h) for h in hashes]
            if None in block_ids:
                raise RuntimeError(f"pool '{name}': a prefix to pin is not cached (was it computed?)")
            for block_id in block_ids:
                pool.pin(block_id)

    def hold_pinned_blocks(self, block_hashes_by_pool: dict[str, Sequence[bytes]]) -> None:
        """Hold, under their names, the blocks pins would hold (the start-up layout's count), without
        their K/V: a plan's cache, so every pool's capacity shows them gone as the engine's does."""
        for name, block_hashes in block_hashes_by_pool.items():
            pool = self.managers[name].pool
            for block_hash in block_hashes:
                block_id = pool.allocate()
                pool.register(block_id, block_hash)
                pool.pin(block_id)
                pool.dec_ref(block_id)  # the pin's reference stays

    def counting_copy(self) -> KVCache:
        """The same pools, empty but for the pinned prefixes (held under their names, as here): it bounds
        and refuses requests as this cache does, for a process with no K/V (the router's ingress)."""
        chunk_tokens = next(iter(self.managers.values())).prefill_chunk_tokens if self.managers else None
        copy = KVCache([(m.spec, m.pool.num_blocks) for m in self.managers.values()], self.tokens_per_block,
                       chunk_tokens, self.enable_prefix_caching)
        copy.hold_pinned_blocks({name: m.pool.pinned_hashes() for name, m in self.managers.items()
                                 if m.pool.num_pinned_blocks})
        return copy

    def pinned_hit(self, key: PrefixKey | None) -> PrefixHit:
        """What pinned prefixes alone guarantee a request with `key`: always cached, so admission
        may count on them (its prefill starts after them; the blocks it shares count as held)."""
        hit = PrefixHit()
        if key is None or not self.enable_prefix_caching or not any(
                m.pool.num_pinned_blocks for m in self.managers.values()):
            return hit
        hit.block_ids = self._prompt_hit(key, pinned_only=True)
        if hit.block_ids:
            hit.num_tokens = len(next(iter(hit.block_ids.values()))) * self.tokens_per_block
        hit.credit_blocks = {name: self.managers[name].hit_credit(ids) for name, ids in hit.block_ids.items()}
        return hit

    def take_copies(self) -> dict[str, list[BlockCopy]]:
        """Queued copy-on-write copies (`BlockCopy`: src, dst, the slots to copy) per pool, handed over once;
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
                "evictable_blocks": m.pool.num_evictable_blocks,
                "pinned_blocks": m.pool.num_pinned_blocks,
                "bytes_per_block": m.spec.bytes_per_block(self.tokens_per_block),
            }
            for name, m in self.managers.items()
        }
