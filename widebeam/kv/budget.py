"""Pure block math: the most blocks a request can ever hold in a pool, and its inverses.

Notation (see DESIGN.md): P prompt tokens, N max_new_tokens, W beam width, T tokens per block,
D extra (draft) tokens reserved per sequence, E encoder output tokens. All results are in blocks of
the pool in question.
"""

from __future__ import annotations

from dataclasses import dataclass


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _check(**values: int) -> None:
    for name, value in values.items():
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")


def full_attention_blocks(
    prompt_tokens: int, max_new_tokens: int, beam_width: int, tokens_per_block: int, extra_tokens: int = 0
) -> int:
    """`floor(P/T) + ceil((P mod T + N + D)/T) * W`.

    The full prompt blocks are stored once and shared by every beam. What a beam can make its own is
    the partial last prompt block (copied on first write) plus every block of generated tokens.
    For W = 1 this is `ceil((P + N + D)/T)`.
    """
    _check(prompt_tokens=prompt_tokens, max_new_tokens=max_new_tokens, extra_tokens=extra_tokens)
    if beam_width < 1 or tokens_per_block < 1:
        raise ValueError("beam_width and tokens_per_block must be >= 1")
    shared_blocks = prompt_tokens // tokens_per_block
    per_beam_blocks = _ceil_div(prompt_tokens % tokens_per_block + max_new_tokens + extra_tokens, tokens_per_block)
    return shared_blocks + per_beam_blocks * beam_width


def cross_attention_blocks(encoder_tokens: int, tokens_per_block: int) -> int:
    """`ceil(E/T)`: computed once per request and shared by all its beams; never grows."""
    _check(encoder_tokens=encoder_tokens)
    return _ceil_div(encoder_tokens, tokens_per_block)


def max_new_tokens_that_fit(
    capacity_blocks: int, prompt_tokens: int, beam_width: int, tokens_per_block: int, extra_tokens: int = 0
) -> int:
    """Largest N with `full_attention_blocks(P, N, W, T, D) <= capacity`; 0 or less when none fits."""
    per_beam_blocks = (capacity_blocks - prompt_tokens // tokens_per_block) // beam_width
    return per_beam_blocks * tokens_per_block - prompt_tokens % tokens_per_block - extra_tokens


def beam_width_that_fits(
    capacity_blocks: int, prompt_tokens: int, max_new_tokens: int, tokens_per_block: int, extra_tokens: int = 0
) -> int:
    """Largest W with `full_attention_blocks(P, N, W, T, D) <= capacity`; 0 when none fits."""
    per_beam_blocks = _ceil_div(prompt_tokens % tokens_per_block + max_new_tokens + extra_tokens, tokens_per_block)
    spare_blocks = capacity_blocks - prompt_tokens // tokens_per_block
    if per_beam_blocks == 0:
        return 0 if spare_blocks < 0 else 2**31 - 1
    return max(0, spare_blocks // per_beam_blocks)


def naive_full_attention_blocks(
    prompt_tokens: int, max_new_tokens: int, beam_width: int, tokens_per_block: int
) -> int:
    """What an engine that copies the prompt into every beam reserves: `ceil((P + N)/T) * W`."""
    return _ceil_div(prompt_tokens + max_new_tokens, tokens_per_block) * beam_width


def naive_max_seq_len(capacity_blocks: int, beam_width: int, tokens_per_block: int) -> int:
    """The start-up bound of engines that divide the pool by the beam width: `floor(capacity/W) * T`."""
    return (capacity_blocks // beam_width) * tokens_per_block


@dataclass(frozen=True)
class KVRequest:
    """What the cache needs to know about a request to bound its blocks: lengths and beam width."""

    prompt_tokens: int
    max_new_tokens: int
    beam_width: int = 1
    extra_tokens: int = 0
    encoder_tokens: int = 0

    def __post_init__(self) -> None:
        _check(
            prompt_tokens=self.prompt_tokens,
            max_new_tokens=self.max_new_tokens,
            extra_tokens=self.extra_tokens,
            encoder_tokens=self.encoder_tokens,
        )
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be >= 1, got {self.beam_width}")
