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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from widebeam.errors import InvalidParameterError
from widebeam.params import SamplingParams

if TYPE_CHECKING:
    from widebeam.engine import LLMEngine


def pin_prefixes(engine: LLMEngine, prefixes: Sequence[str | Sequence[int]]) -> dict[str, int]:
    """Compute each prefix and pin its blocks; returns pinned blocks per pool."""
    if not prefixes:
        return {}
    if engine.arch.is_encoder_decoder:
        raise InvalidParameterError("pinned_prefixes", "{pinned_prefixes} need a decoder-only model (an "
                                    "encoder-decoder's source is encoded whole, per request)")
    t = engine.cache.tokens_per_block
    for i, prefix in enumerate(prefixes):
        request_id = f"pinned-prefix-{i}"
        try:
            token_ids = engine.add_request(request_id, list(prefix) if not isinstance(prefix, str) else prefix,
                                           SamplingParams(max_new_tokens=1, temperature=0.0))
        except ValueError as exc:
            raise InvalidParameterError("pinned_prefixes", "{pinned_prefixes}[{index}] cannot be computed: "
                                        "{reason}", index=i, reason=str(exc)) from None
        if len(token_ids) < t:
            engine.abort(request_id)
            raise InvalidParameterError("pinned_prefixes", "{pinned_prefixes}[{index}] has {num_tokens} tokens, "
                                        "fewer than one block ({t}): nothing to pin", index=i,
                                        num_tokens=len(token_ids), t=t)
        while engine.has_unfinished():
            engine.step()
        engine.cache.pin(engine.cache.prefix_key(token_ids))
    engine.cache.num_queried_tokens = engine.cache.num_hit_tokens = 0  # the hit rate counts requests only
    return {name: m.pool.num_pinned_blocks for name, m in engine.cache.managers.items()}
