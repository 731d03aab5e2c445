"""Speculation and text: stop strings end a speculative request exactly where they end it without
speculation (the draft ran past them), for sampling and for every beam, on a tiny model with
SmolLM2's real tokenizer; and a request that can never fit the draft's pool is rejected naming it."""

from __future__ import annotations

import pytest
from tiny_models import save_tiny_model

from widebeam.engine import LLMEngine
from widebeam.errors import RequestTooLargeError
from widebeam.kv.cache import KVCache
from widebeam.kv.spec import FullAttentionSpec
from widebeam.params import BeamSearchParams, SamplingParams
from widebeam.sched.admission import admit_check

OPTIONS = {"device": "cpu", "kv_cache_memory": "16MiB", "tokens_per_block": 4, "max_beam_width": 4}


@pytest.fixture(scope="module")
def text_model_dir(tmp_path_factory, smollm2):
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tiny-text-llama")
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2[1].path))
    save_tiny_model(path, "llama", vocab_size=49152, hidden_size=32, intermediate_size=64,
                    bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.pad_token_id)
    tokenizer.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def engines(text_model_dir):
    return {"plain": LLMEngine(str(text_model_dir), **OPTIONS),
            "draft": LLMEngine(str(text_model_dir), speculative_model=str(text_model_dir),
                               num_speculative_tokens=5, **OPTIONS),
            "ngram": LLMEngine(str(text_model_dir), speculative_method="ngram", num_speculative_tokens=5,
                               **OPTIONS)}


def generate(engine: LLMEngine, prompt: str, params) -> list[tuple]:
    free = engine.cache.num_free_blocks()
    engine.add_request("r", prompt, params)
    streamed, final = "", None
    while engine.has_unfinished():
        for delta in engine.step():
            assert delta.error is None, delta.error
            streamed += delta.new_text
            final = delta
    assert engine.cache.num_free_blocks() == free
    outputs = final.output.outputs
    if isinstance(params, SamplingParams):
        assert streamed == outputs[0].text  # what was streamed is the final text, no more
    return [(c.text, c.token_ids, c.finish_reason) for c in outputs]


@pytest.mark.parametrize("speculative", ["draft", "ngram"])
@pytest.mark.parametrize("width", [1, 4])
def test_stop_strings_cut_where_plain_cuts(engines, speculative, width):
    prompt = "The quick brown fox jumps over the lazy dog. The quick brown fox"
    make = (lambda **kw: SamplingParams(temperature=0, **kw)) if width == 1 else (
        lambda **kw: BeamSearchParams(beam_width=width, num_return_sequences=width, **kw))
    free_text = generate(engines["plain"], prompt, make(max_new_tokens=24, ignore_eos=True))[0][0]
    assert len(free_text) > 12
    stop = free_text[len(free_text) // 2:len(free_text) // 2 + 3]
    params = make(max_new_tokens=24, ignore_eos=True, stop=[stop])
    expected = generate(engines["plain"], prompt, params)
    assert any(reason == "stop" for _, _, reason in expected)
    assert generate(engines[speculative], prompt, params) == expected


def test_a_request_that_never_fits_the_draft_pool_is_rejected_naming_it():
    """Admission checks every pool of both workers with D reserved per sequence: the target's pool
    has room, the draft's does not, and the error names the draft's pool and what would fit."""
    t = 4
    shape = {"num_kv_heads": 2, "head_dim": 8}
    cache = KVCache([(FullAttentionSpec(name="self", num_layers=4, **shape), 64),
                     (FullAttentionSpec(name="draft", num_layers=1, **shape), 28)], t)
    free = cache.num_free_blocks()
    with pytest.raises(RequestTooLargeError) as info:
        admit_check(cache, 512, 10, 20, beam_width=4, extra_tokens=4, refeed_tokens=4)
    error = info.value
    assert error.pool == "draft"
    required = 10 // t + -(-(10 % t + 20 - 1 + 4) // t) * 4  # floor(P/T) + ceil((P mod T + N - 1 + D)/T) * W
    assert (error.required_blocks, error.capacity_blocks) == (required, 28)
    assert "draft" in str(error) and "beam_width" in str(error)
    assert cache.num_free_blocks() == free
    # without the D drafted slots per beam the same request fits: D is what tipped it over
    assert admit_check(cache, 512, 10, 20, beam_width=4).required_blocks == {"self": 26, "draft": 26}
