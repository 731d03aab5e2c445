"""Beam scores stay real at the extremes of the length penalty: finite, never dropped as empty slots
by HF's -1e9 sentinel, and the penalty limited to a range where that holds."""

from __future__ import annotations

import math

import pytest
import torch

from widebeam.beam import BeamSearchState
from widebeam.errors import InvalidParameterError
from widebeam.params import BeamSearchParams


def test_strongly_negative_length_penalty_keeps_real_hypotheses_below_hfs_sentinel():
    """With length_penalty=-10 over 32 tokens every real score is far below HF's -1e9 empty-slot value;
    they are still kept, ranked and finite (HF would return none)."""
    torch.manual_seed(0)
    params = BeamSearchParams(beam_width=3, max_new_tokens=32, length_penalty=-10.0, ignore_eos=True)
    state = BeamSearchState(params, 32)
    rows = 1
    while not state.done:
        result = state.step(torch.log_softmax(torch.randn(rows, 50) * 3, dim=-1))
        rows = len(result)
    hypotheses = state.finalize()
    assert len(hypotheses) == 3
    scores = [h.score for h in hypotheses]
    assert all(math.isfinite(s) and s < -1e9 for s in scores) and scores == sorted(scores, reverse=True)
    for h in hypotheses:
        assert h.score == pytest.approx(h.cumulative_logprob * 32**10, rel=1e-6)


def test_length_penalty_is_limited_to_a_range_with_finite_scores():
    with pytest.raises(InvalidParameterError,
                       match=r"length_penalty must be a finite number in \[-10.0, 10.0\]"):
        BeamSearchParams(length_penalty=1000)
    BeamSearchParams(length_penalty=10)
