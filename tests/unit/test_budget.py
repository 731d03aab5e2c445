"""The block math, table by table: what sharing the prompt across beams buys, and its edges.

A beam writes the prompt's K/V (once, shared) and N - 1 generated tokens: the N-th is chosen, never
fed. N = 1 runs no decode step: the prompt alone."""

from __future__ import annotations

import itertools
import math

import pytest

from widebeam.kv.budget import (
    beam_width_that_fits,
    cross_attention_blocks,
    full_attention_blocks,
    max_new_tokens_that_fit,
    naive_full_attention_blocks,
    naive_max_seq_len,
)


@pytest.mark.parametrize("prompt_tokens", [1, 15, 16, 17, 100, 4096])
@pytest.mark.parametrize("max_new_tokens", [1, 16, 33])
@pytest.mark.parametrize("tokens_per_block", [1, 2, 4, 16])
def test_beam_one_is_one_sequence(prompt_tokens, max_new_tokens, tokens_per_block):
    expected = math.ceil((prompt_tokens + max_new_tokens - 1) / tokens_per_block)
    assert full_attention_blocks(prompt_tokens, max_new_tokens, 1, tokens_per_block) == expected


@pytest.mark.parametrize(
    "prompt_tokens, max_new_tokens, beam_width, tokens_per_block, expected",
    [
        # 4096 = 256 full blocks shared; each beam: ceil((0 + 64 - 1)/16) = 4 blocks
        (4096, 64, 256, 16, 256 + 4 * 256),
        # 100 = 6 full blocks + 4 tokens; each beam: ceil((4 + 32 - 1)/16) = 3 blocks
        (100, 32, 8, 16, 6 + 3 * 8),
        # one-token blocks: nothing partial, every written generated token is a block
        (7, 5, 4, 1, 7 + 4 * 4),
        # a prompt shorter than a block is all partial: every beam gets its own copy once it writes
        (3, 2, 5, 4, 0 + 1 * 5),
        # ... and N = 1 writes nothing past the prompt: no beam forks, the prompt is held once
        (3, 1, 5, 4, 1),
        (10, 4, 3, 4, 2 + 2 * 3),
        # the N-th token would open a block of its own, but it is never written
        (10, 3, 3, 4, 2 + 1 * 3),
        # extra (draft) tokens are per beam
    ],
)
def test_full_attention_table(prompt_tokens, max_new_tokens, beam_width, tokens_per_block, expected):
    assert full_attention_blocks(prompt_tokens, max_new_tokens, beam_width, tokens_per_block) == expected


def test_extra_tokens_are_reserved_per_beam():
    assert full_attention_blocks(32, 16, 4, 16, extra_tokens=16) == 2 + 2 * 4
    assert full_attention_blocks(32, 16, 4, 16, extra_tokens=0) == 2 + 1 * 4


@pytest.mark.parametrize("beam_width", [2, 16, 128, 256])
def test_beam_width_multiplies_only_partial_and_generated_blocks(beam_width):
    prompt_tokens, max_new_tokens, t = 1000, 40, 16  # 62 full blocks, 8 tokens partial
    one = full_attention_blocks(prompt_tokens, max_new_tokens, 1, t)
    many = full_attention_blocks(prompt_tokens, max_new_tokens, beam_width, t)
    per_beam = math.ceil((1000 % 16 + 40 - 1) / 16)
    assert many - one == per_beam * (beam_width - 1)
    assert many < naive_full_attention_blocks(prompt_tokens, max_new_tokens, beam_width, t)


def test_block_aligned_prompt_adds_no_partial_block_per_beam():
    aligned = full_attention_blocks(64, 17, 8, 16)
    unaligned = full_attention_blocks(65, 17, 8, 16)
    assert aligned == 4 + 1 * 8
    assert unaligned == 4 + 2 * 8  # the 1-token partial block plus 16 written tokens need 2 blocks per beam


@pytest.mark.parametrize("encoder_tokens, tokens_per_block, expected",
                         [(1, 16, 1), (16, 16, 1), (17, 16, 2), (0, 4, 0)])
def test_cross_attention_has_no_beam_factor(encoder_tokens, tokens_per_block, expected):
    assert cross_attention_blocks(encoder_tokens, tokens_per_block) == expected


@pytest.mark.parametrize("capacity", [0, 5, 63, 64, 65, 300, 1280, 5000])
@pytest.mark.parametrize("prompt_tokens, beam_width, t",
                         [(1000, 8, 16), (4096, 256, 16), (3, 4, 1), (17, 3, 4)])
def test_max_new_tokens_that_fit_is_the_largest(capacity, prompt_tokens, beam_width, t):
    n = max_new_tokens_that_fit(capacity, prompt_tokens, beam_width, t)
    if n >= 1:
        assert full_attention_blocks(prompt_tokens, n, beam_width, t) <= capacity
    assert full_attention_blocks(prompt_tokens, max(n, 0) + 1, beam_width, t) > capacity


@pytest.mark.parametrize("capacity", [0, 5, 63, 64, 65, 300, 1280, 5000])
@pytest.mark.parametrize("prompt_tokens, max_new_tokens, t", [(1000, 8, 16), (4096, 64, 16), (3, 4, 1)])
def test_beam_width_that_fits_is_the_largest(capacity, prompt_tokens, max_new_tokens, t):
    w = beam_width_that_fits(capacity, prompt_tokens, max_new_tokens, t)
    if w >= 1:
        assert full_attention_blocks(prompt_tokens, max_new_tokens, w, t) <= capacity
    assert full_attention_blocks(prompt_tokens, max_new_tokens, w + 1, t) > capacity


def test_the_inverses_are_exact_against_every_value():
    """Both inverses against a brute-force search, with D, N <= 1 (the prompt alone, whatever W) and
    pools too small for even the prompt."""
    for p, t, d, capacity in itertools.product((1, 3, 4, 9), (1, 2, 4), (0, 1, 3), range(14)):
        for w in (1, 2, 5):
            fits = [n for n in range(60) if full_attention_blocks(p, n, w, t, d) <= capacity]
            n = max_new_tokens_that_fit(capacity, p, w, t, d)
            assert (n == max(fits)) if fits and max(fits) >= 1 else n <= 0, (p, t, d, capacity, w)
        for n in (0, 1, 2, 5, 9):
            fits = [w for w in range(1, 40) if full_attention_blocks(p, n, w, t, d) <= capacity]
            w = beam_width_that_fits(capacity, p, n, t, d)
            if n <= 1:  # W does not matter: the prompt alone
                assert w == (2**31 - 1 if fits else 0)
            else:
                assert w == (max(fits) if fits else 0), (p, t, d, capacity, n)


def test_naive_model_divides_the_pool_by_beam_width():
    assert naive_max_seq_len(capacity_blocks=900, beam_width=256, tokens_per_block=16) == 48
    assert naive_full_attention_blocks(4096, 64, 256, 16) == 260 * 256


@pytest.mark.parametrize(
    "args",
    [(-1, 1, 1, 16), (1, -1, 1, 16), (1, 1, 0, 16), (1, 1, 1, 0)],
)
def test_bad_arguments_raise(args):
    with pytest.raises(ValueError):
        full_attention_blocks(*args)
