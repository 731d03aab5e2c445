"""Numbers at the edges of Python's ints: a huge temperature is a large float (torch cannot divide by
an int past int64: temperature=2**70 once raised OverflowError inside a step), one past float's range
is refused by name, and nothing raises anything but InvalidParameterError."""

from __future__ import annotations

import pytest

from widebeam.engine import LLMEngine
from widebeam.errors import InvalidParameterError
from widebeam.params import BeamSearchParams, SamplingParams

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
