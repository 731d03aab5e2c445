"""The router's sizer is the engine's: a replica's `sizer.for_router()`, pickled as Ray sends it to the
ingress, gives every request the per-pool blocks the engine admits it with, and refuses a request that
can never fit with the engine's message word for word; on full attention, sliding-window and
encoder-decoder (cross) pools, with pinned prefixes and width schedules."""

from __future__ import annotations

import pickle

import pytest

from widebeam.engine import LLMEngine
from widebeam.errors import RequestTooLargeError
from widebeam.params import BeamSearchParams, SamplingParams
from widebeam.request_sizer import UnsizedRequestError

REQUESTS = [  # (prompt, params)
    ([3, 9, 27, 4, 5], SamplingParams(max_new_tokens=5)),
    ([3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], BeamSearchParams(beam_width=4, max_new_tokens=9)),
    (list(range(3, 40)), BeamSearchParams(beam_width=16, max_new_tokens=6)),
    ([5] * 30, BeamSearchParams(beam_width=8, max_new_tokens=7, beam_width_schedule=(2, 4, 8, 8))),
    ({"prompt_token_ids": [7, 8, 9]}, SamplingParams(max_new_tokens=None)),  # up to max_seq_len
]


def engine_for(model_dir, **kwargs) -> LLMEngine:
    return LLMEngine(str(model_dir), dtype="float32", device="cpu", tokens_per_block=4,
                     kv_cache_memory="1MiB", max_beam_width=64, **kwargs)


def check_agreement(engine: LLMEngine, requests) -> None:
    sizer = pickle.loads(pickle.dumps(engine.sizer.for_router()))
    assert set(sizer.cache.managers) == set(engine.cache.managers)
    for k, (prompt, params) in enumerate(requests):
        need = sizer.size("routed", prompt, params).required_blocks
        engine.add_request(f"r{k}", prompt, params)
        assert need == engine._requests[f"r{k}"].admission.required_blocks, (prompt, params)
        engine.abort(f"r{k}")
    # past the pools: the same refusal, word for word
    huge = BeamSearchParams(beam_width=64, max_new_tokens=engine.max_seq_len - 40)
    with pytest.raises(RequestTooLargeError) as at_router:
        sizer.size("routed", [1] * 30, huge)
    with pytest.raises(RequestTooLargeError) as at_engine:
        engine.add_request("huge", [1] * 30, huge)
    assert str(at_router.value) == str(at_engine.value)


def test_full_attention_pools(tiny_llama_dir):
    check_agreement(engine_for(tiny_llama_dir), REQUESTS)


def test_with_a_pinned_prefix_and_the_prefix_cache(tiny_llama_dir):
    pinned = list(range(3, 19))
    engine = engine_for(tiny_llama_dir, enable_prefix_caching=True,
                        pinned_prefixes=[tuple(pinned)])
    check_agreement(engine, [(pinned + [40, 41], BeamSearchParams(beam_width=4, max_new_tokens=5)),
                             *REQUESTS[:2]])


def test_sliding_window_pools(tiny_gemma3_dir):
    check_agreement(engine_for(tiny_gemma3_dir), REQUESTS[:3])


def test_cross_attention_pools(tiny_marian_dir):
    engine = engine_for(tiny_marian_dir)
    assert "cross" in engine.cache.managers
    check_agreement(engine, [([5, 6, 7, 8, 9, 10], BeamSearchParams(beam_width=4, max_new_tokens=6)),
                             ([5, 6, 7], SamplingParams(max_new_tokens=3))])


def test_a_catalogue_request_is_left_to_the_replica(tiny_llama_dir):
    sizer = engine_for(tiny_llama_dir).sizer.for_router()
    with pytest.raises(UnsizedRequestError):
        sizer.size("routed", [3, 4], BeamSearchParams(beam_width=2, allowed_sequences=[[5, 6], [7, 8]]))
