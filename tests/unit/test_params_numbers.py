"""Numbers at the edges of Python's ints: a huge temperature is a large float (torch cannot divide by
an int past int64: temperature=2**70 once raised OverflowError inside a step), one past float's range
is refused by name, and nothing raises anything but InvalidParameterError. Penalties have a range
where float32 stays finite (repetition_penalty=1e-300 once made a sampled request fail with nan
probabilities)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from widebeam.decoding.penalties import TokenPenalties
from widebeam.engine import LLMEngine
from widebeam.errors import InvalidParameterError
from widebeam.params import (
    GREEDY_TEMPERATURE,
    MAX_ABS_PRESENCE_FREQUENCY_PENALTY,
    MAX_REPETITION_PENALTY,
    MIN_REPETITION_PENALTY,
    BeamSearchParams,
    SamplingParams,
)
from widebeam.sampling import filtered_logits

HUGE = 2**5000  # past float's range


@pytest.mark.parametrize(("cls", "field"), [
    (SamplingParams, "temperature"), (SamplingParams, "top_p"), (SamplingParams, "repetition_penalty"),
    (SamplingParams, "presence_penalty"), (BeamSearchParams, "length_penalty"),
    (BeamSearchParams, "repetition_penalty"),
])
def test_a_number_past_floats_range_is_refused_by_name(cls, field):
    with pytest.raises(InvalidParameterError) as info:
        cls(**{field: HUGE})
    assert info.value.param == field


def test_a_huge_int_temperature_samples(tiny_llama_dir):
    params = SamplingParams(temperature=2**70, max_new_tokens=3, seed=1, ignore_eos=True)
    assert isinstance(params.temperature, float)
    engine = LLMEngine(str(tiny_llama_dir), device="cpu", kv_cache_memory="2MiB", tokens_per_block=4)
    engine.add_request("r", {"prompt_token_ids": [5, 6, 7]}, params)
    deltas = []
    while engine.has_unfinished():
        deltas.extend(engine.step())
    assert deltas[-1].error is None and len(deltas[-1].output.outputs[0].token_ids) == 3


# -- penalties: a range where the float32 arithmetic stays finite ------------------------------------
@pytest.mark.parametrize("cls", [SamplingParams, BeamSearchParams])
@pytest.mark.parametrize("bad", [1e-300, 0.009, 100.5, 1e300, 2**70])
def test_a_repetition_penalty_outside_its_range_is_refused_naming_the_range(cls, bad):
    with pytest.raises(InvalidParameterError) as info:
        cls(repetition_penalty=bad)
    assert info.value.param == "repetition_penalty"
    assert f"[{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY}]" in str(info.value), info.value


def test_why_the_range_1e300_made_every_seen_score_inf():
    """The QA's 1e-300 rounds to 0 in float32: a seen token's positive score divided by it is inf."""
    scores = torch.tensor([[3.0, -1.0, 0.5]])
    TokenPenalties(repetition_penalty=1e-300).process(scores, _context([[0, 1]]))
    assert not torch.isfinite(scores).all()


@pytest.mark.parametrize("penalty", [MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY])
def test_penalties_at_the_edges_keep_sampling_finite_for_huge_logits(penalty):
    """Logits of +-1e20 through the penalty at either edge, then the smallest sampling temperature:
    every probability is finite and they sum to 1."""
    params = SamplingParams(temperature=GREEDY_TEMPERATURE, repetition_penalty=penalty,
                            presence_penalty=MAX_ABS_PRESENCE_FREQUENCY_PENALTY,
                            frequency_penalty=-MAX_ABS_PRESENCE_FREQUENCY_PENALTY)
    scores = torch.tensor([[1e20, -1e20, 5.0, -7.0]])
    context = _context([[0, 1, 2, 3, 0, 1]], prompt_len=2)
    TokenPenalties(params.repetition_penalty, params.presence_penalty, params.frequency_penalty).process(
        scores, context)
    assert torch.isfinite(scores).all(), scores
    probs = torch.softmax(filtered_logits(scores[0], params), dim=-1)
    assert torch.isfinite(probs).all() and abs(float(probs.sum()) - 1) < 1e-5


@pytest.mark.parametrize("penalty", [MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY])
def test_sampling_at_the_penalty_edges_finishes(tiny_llama_dir, penalty):
    params = SamplingParams(temperature=0.7, max_new_tokens=6, seed=2, ignore_eos=True,
                            repetition_penalty=penalty, frequency_penalty=2.0, presence_penalty=-2.0)
    engine = LLMEngine(str(tiny_llama_dir), device="cpu", kv_cache_memory="2MiB", tokens_per_block=4)
    engine.add_request("r", {"prompt_token_ids": [5, 6, 5, 6, 7]}, params)
    deltas = []
    while engine.has_unfinished():
        deltas.extend(engine.step())
    assert deltas[-1].error is None and len(deltas[-1].output.outputs[0].token_ids) == 6


def _context(history: list[list[int]], prompt_len: int | None = None):
    """A step context holding just what the penalties read: the rows' token ids and the prompt's length."""
    ids = torch.tensor(history)
    return SimpleNamespace(history=ids, prompt_len=ids.shape[1] if prompt_len is None else prompt_len)
