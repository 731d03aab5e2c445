"""Admission: decide, before a request is queued, whether it can ever run.

A request that can never fit is rejected at once with a message saying what would fit; one that
fits the pools but not the free blocks right now waits. Nothing is allocated here.
"""

from __future__ import annotations

from dataclasses import dataclass

from widebeam.errors import InvalidParameterError
from widebeam.kv.budget import KVRequest
from widebeam.kv.cache import KVCache, PoolBudget
from widebeam.kv.prefix import PrefixKey


@dataclass(frozen=True)
class Admission:
    max_new_tokens: int
    kv_request: KVRequest
    budgets: list[PoolBudget]

    @property
    def required_blocks(self) -> dict[str, int]:
        return {b.pool: b.required_blocks for b in self.budgets}


def admit_check(cache: KVCache, max_seq_len: int, prompt_len: int, max_new_tokens: int | None,
                beam_width: int = 1, encoder_tokens: int = 0, max_encoder_tokens: int = 0,
                extra_tokens: int = 0, refeed_tokens: int = 0, key: PrefixKey | None = None,
                beam_width_schedule: tuple[int, ...] = (),
                refeeds_after_preemption: bool = False) -> Admission:
    """Validate lengths against `max_seq_len` (and an encoder-decoder request's source, of
    `encoder_tokens`, against the model's `max_encoder_tokens`), then every pool's budget, the
    cross pool's `ceil(E/T)` included; raise if it can never run. `extra_tokens` (D) and
    `refeed_tokens` are what speculative decoding adds per sequence (see kv/budget.py). With the
    prompt's prefix `key`, pinned prefix blocks it shares count as held and its prefill starts after
    them (they are always there). A `beam_width_schedule` (per-step widths, `beam_width` its widest)
    is counted by its own worst case (kv/schedule_budget.py: `scheduled_blocks`); `refeeds_after_preemption`
    when a preemption may resume it by re-feeding every beam."""
    if prompt_len < 1:
        raise InvalidParameterError("prompt", "prompt is empty: give at least one token")
    if max_encoder_tokens and encoder_tokens > max_encoder_tokens:
        raise InvalidParameterError(
            "prompt",
            f"source has {encoder_tokens} tokens but the encoder takes at most {max_encoder_tokens}: "
            f"shorten the source to at most {max_encoder_tokens} tokens",
        )
    if prompt_len >= max_seq_len:
        raise InvalidParameterError(
            "prompt",
            f"prompt has {prompt_len} tokens but max_seq_len is {max_seq_len}: "
            f"shorten the prompt to at most {max_seq_len - 1} tokens",
        )
    if max_new_tokens is None:
        max_new_tokens = max_seq_len - prompt_len
    elif prompt_len + max_new_tokens > max_seq_len:
        raise InvalidParameterError(
            "max_new_tokens",
            f"prompt ({prompt_len} tokens) + {{max_new_tokens}} ({max_new_tokens}) exceeds max_seq_len "
            f"({max_seq_len}); use {{max_new_tokens}} <= {max_seq_len - prompt_len}",
        )
    pinned = cache.pinned_hit(key)
    kv_request = KVRequest(prompt_len, max_new_tokens, beam_width, extra_tokens=extra_tokens,
                           refeed_tokens=refeed_tokens, encoder_tokens=encoder_tokens,
                           cached_prompt_tokens=pinned.num_tokens,
                           beam_width_schedule=tuple(beam_width_schedule),
                           refeeds_after_preemption=refeeds_after_preemption)
    return Admission(max_new_tokens, kv_request, cache.check_fits(kv_request, pinned.credit_blocks))
