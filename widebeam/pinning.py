"""Pinned prefixes: prompts computed once at start-up whose blocks stay cached for good.

A system prompt or few-shot block every request starts with is computed through the engine's own
path (a one-token greedy request, so its blocks are named exactly as any request's), then held by
the cache (`KVCache.pin`): never evicted, taken off every pool's capacity (`capacity_blocks`), and
counted as held by the requests that share it, in the never-fit check too. vLLM cannot do this
(vllm-project/vllm#5176).

A pin covers the prefix's full blocks (`floor(P/T)` of them; a sliding pool keeps only the ones its
window needs at the prefix's end). A request reuses it when its prompt's tokens start with the
pin's full blocks: give token ids, or text whose tokenization starts the same way (a boundary
inside a word can tokenize differently).

How many blocks the pins hold is decided before the pools exist, by the start-up layout
(layout.py), from token ids: text pins are tokenized first (`pin_token_ids`). Their K/V are
computed once the engine is whole (`pin_prefixes`, start-up's last step), and the blocks the
engine then holds must be the layout's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from widebeam.errors import InvalidParameterError
from widebeam.params import SamplingParams

if TYPE_CHECKING:
    from widebeam.kv.cache import KVCache
    from widebeam.layout import StartupLayout


def pin_token_ids(prefixes: Sequence[str | Sequence[int]],
                  tokenize: Callable[[str], list[int]]) -> tuple[tuple[int, ...], ...]:
    """Each pin as token ids: text through `tokenize` (the engine's, as a request's prompt), token
    ids as given (the layout checks them against the vocabulary)."""
    token_ids = []
    for index, prefix in enumerate(prefixes):
        if not isinstance(prefix, str):
            token_ids.append(tuple(prefix))
            continue
        try:
            token_ids.append(tuple(tokenize(prefix)))
        except ValueError as exc:
            raise InvalidParameterError("pinned_prefixes", "prefix {index} cannot be tokenized: {reason}",
                                        index=index, reason=str(exc)) from None
    return tuple(token_ids)


def pin_prefixes(prefixes: Sequence[Sequence[int]], layout: StartupLayout, cache: KVCache,
                 add_request: Callable[[str, list[int], SamplingParams], object],
                 step: Callable[[], object], has_unfinished: Callable[[], bool]) -> dict[str, int]:
    """Compute each prefix through the engine's public path (`add_request`, then `step` while
    `has_unfinished`) and pin its blocks in `cache`; returns pinned blocks per pool (every pool),
    which must be what `layout` counted."""
    if not prefixes:
        return layout.pinned_blocks
    for index, token_ids in enumerate(prefixes):
        request_id = f"pinned-prefix-{index}"
        try:
            add_request(request_id, list(token_ids), SamplingParams(max_new_tokens=1, temperature=0.0))
        except ValueError as exc:
            raise InvalidParameterError("pinned_prefixes", "prefix {index} cannot be computed: {reason}",
                                        index=index, reason=str(exc)) from None
        while has_unfinished():
            step()
        cache.pin(cache.prefix_key(token_ids))
    cache.num_queried_tokens = cache.num_hit_tokens = 0  # the hit rate counts requests only
    pinned_blocks = {name: pool["pinned_blocks"] for name, pool in cache.stats().items()}
    if pinned_blocks != layout.pinned_blocks:  # plan would have promised other capacities than these
        raise RuntimeError(f"the pins hold {pinned_blocks} blocks, the start-up layout counted "
                           f"{layout.pinned_blocks}")
    return pinned_blocks
