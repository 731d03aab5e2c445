"""Speculative decoding is configured once, at start-up, and a wrong configuration fails there with
a message naming the option: a draft whose token ids mean something else, an encoder-decoder
target, an out-of-range D, a method without (or with a needless) draft model."""

from __future__ import annotations

import pytest
from tiny_models import save_tiny_model

from widebeam.engine import LLMEngine
from widebeam.errors import InvalidParameterError

OPTIONS = {"device": "cpu", "kv_cache_memory": "4MiB", "tokens_per_block": 4}


@pytest.fixture(scope="module")
def other_vocab_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-vocab-256")
    save_tiny_model(path, "llama", vocab_size=256)
    return path


def test_a_draft_with_another_vocabulary_is_refused(tiny_llama_dir, other_vocab_dir):
    with pytest.raises(InvalidParameterError,
                       match="speculative_model .* must share the target's tokenizer") as info:
        LLMEngine(str(tiny_llama_dir), speculative_model=str(other_vocab_dir), **OPTIONS)
    assert info.value.param == "speculative_model"


def test_an_encoder_decoder_target_is_refused(tiny_marian_dir):
    with pytest.raises(InvalidParameterError, match="decoder-only"):
        LLMEngine(str(tiny_marian_dir), speculative_method="ngram", **OPTIONS)


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"speculative_method": "draft"}, "speculative_model"),
    ({"speculative_method": "ngram", "speculative_model": "x"}, "speculative_model"),
    ({"speculative_method": "medusa"}, "speculative_method"),
    ({"speculative_method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"speculative_method": "ngram", "num_speculative_tokens": 65}, "num_speculative_tokens"),
    ({"num_speculative_tokens": 3}, "num_speculative_tokens"),
    ({"speculative_model": "x", "speculative_dtype": "int4"}, "speculative_dtype"),
])
def test_bad_combinations_name_the_option(tiny_llama_dir, kwargs, param):
    with pytest.raises(InvalidParameterError) as info:
        LLMEngine(str(tiny_llama_dir), **OPTIONS, **kwargs)
    assert info.value.param == param


def test_the_draft_pools_are_sized_and_reported(tiny_llama_dir):
    engine = LLMEngine(str(tiny_llama_dir), speculative_model=str(tiny_llama_dir), num_speculative_tokens=3,
                       speculative_dtype="bfloat16", **OPTIONS)
    stats = engine.stats()
    assert set(stats["pools"]) == {"self", "draft"}
    assert stats["pools"]["draft"]["total_blocks"] > 0
    assert stats["speculative"] == {"method": "draft", "model": str(tiny_llama_dir),
                                    "num_speculative_tokens": 3,
                                    "rounds": 0, "steps": 0, "drafted_tokens": 0, "accepted_tokens": 0,
                                    "refed_tokens": 0}
    # Memory is split by need (bytes per token x tokens held): the bfloat16 draft's pool costs half
    # per token and holds as many tokens as the target's, so it gets as many blocks for half the bytes.
    draft_spec, self_spec = engine.cache["draft"].spec, engine.cache["self"].spec
    assert (draft_spec.dtype, self_spec.dtype) == ("bfloat16", "float32")
    assert stats["pools"]["draft"]["total_blocks"] == stats["pools"]["self"]["total_blocks"]
