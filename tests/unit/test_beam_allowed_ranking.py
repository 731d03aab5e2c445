"""The catalogue's fast path in the beam search (`step(..., allowed=(rows, tokens))`, which ranks only
the allowed (beam, token) pairs) against its reference: the same step on scores masked to -inf outside
those pairs. Same next beams, same finished hypotheses, same final answer, over random steps (the
`top_allowed` (beam/ranking.py) mutants had no unit test reaching them in #22's mutation check)."""

from __future__ import annotations

import pytest
import torch
from helpers import live_cumulative_logprobs

from widebeam.beam import BeamSearchState
from widebeam.params import BeamSearchParams

EOS, VOCAB = 0, 12


def random_allowed(generator: torch.Generator, num_rows: int,
                   min_pairs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random set of (row, token) pairs, EOS often among them, at least `min_pairs` of them."""
    while True:
        keep = torch.rand(num_rows, VOCAB, generator=generator) < 0.5
        if int(keep.sum()) >= min_pairs:
            rows, tokens = keep.nonzero(as_tuple=True)
            return rows, tokens


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize(("width", "length_penalty", "early_stopping"), [
    (1, 1.0, False), (3, 1.0, False), (4, 0.5, True), (4, 2.0, "never"), (6, 1.0, False)])
def test_ranking_the_allowed_pairs_equals_masking_the_rest(seed, width, length_penalty, early_stopping):
    generator = torch.Generator().manual_seed(seed)
    params = BeamSearchParams(beam_width=width, max_new_tokens=7, length_penalty=length_penalty,
                              early_stopping=early_stopping, min_new_tokens=seed % 3)
    fast, reference = BeamSearchState(params, 7, {EOS}), BeamSearchState(params, 7, {EOS})
    while not fast.done:
        assert not reference.done and len(fast.live_token_ids) == len(reference.live_token_ids)
        logits = torch.randn(len(fast.live_token_ids), VOCAB, generator=generator) * 3
        logits[:, EOS] += 4.0 * (seed % 2)  # odd seeds: EOS near the top of every row, so up to W of the
        # 2W candidates finish and the last one decides a live beam
        logprobs = torch.log_softmax(logits, dim=-1)
        rows, tokens = random_allowed(generator, len(fast.live_token_ids), 2 * width)
        masked = torch.full_like(logprobs, float("-inf"))
        masked[rows, tokens] = logprobs[rows, tokens]
        got = fast.step(logprobs, allowed=(rows, tokens))
        expected = reference.step(masked)
        assert (got.parent_indices, got.token_ids) == (expected.parent_indices, expected.token_ids)
        assert live_cumulative_logprobs(fast) == live_cumulative_logprobs(reference)
    assert reference.done
    assert [(h.token_ids, h.score, h.finish_reason) for h in fast.finalize()] == \
           [(h.token_ids, h.score, h.finish_reason) for h in reference.finalize()]
