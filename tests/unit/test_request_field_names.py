"""Refusals name the field the caller sent (issue 41, items 7 and 9) through `LLM`, the engine's public
path: a decoder prefix on a decoder-only model, a decoder prefix too long for the decoder, and a scored
continuation too long for `max_seq_len` (scoring has no `max_new_tokens`); the lengths one short of each
limit run."""

from __future__ import annotations

import pytest

from widebeam.errors import InvalidParameterError
from widebeam.llm import LLM
from widebeam.params import BeamSearchParams, SamplingParams

ENGINE = {"dtype": "float32", "device": "cpu", "tokens_per_block": 4, "kv_cache_memory": "4MiB",
          "max_beam_width": 4}
PROMPT = {"prompt_token_ids": [5, 17, 33, 9, 100, 3, 8]}


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), **ENGINE)


@pytest.fixture(scope="module")
def marian(tiny_marian_dir):
    return LLM(str(tiny_marian_dir), **ENGINE)


def refused(call) -> InvalidParameterError:
    with pytest.raises(InvalidParameterError) as info:
        call()
    return info.value


@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_new_tokens=2, decoder_prefix=[40]),
                                    BeamSearchParams(beam_width=2, max_new_tokens=2, decoder_prefix=[40])])
def test_a_decoder_prefix_on_a_decoder_only_model_is_refused(llama, params):
    error = refused(lambda: llama.generate([PROMPT], params, use_tqdm=False))
    assert error.param == "decoder_prefix" and "encoder-decoder" in str(error)
    assert llama.stats()["pools"]["self"]["free_blocks"] == llama.stats()["pools"]["self"]["total_blocks"]
    error = refused(lambda: llama.score(PROMPT, [[4, 5]], decoder_prefix=[40]))
    assert error.param == "decoder_prefix"


def test_a_soft_prefix_on_a_decoder_only_model_still_runs(llama):
    """prefix_bias_beta does not append the prefix: it biases what is generated, so it stays."""
    params = BeamSearchParams(beam_width=2, max_new_tokens=3, decoder_prefix=[40, 41], prefix_bias_beta=0.5)
    (output,) = llama.generate([PROMPT], params, use_tqdm=False)
    assert output.outputs and output.prompt_token_ids == PROMPT["prompt_token_ids"]


def test_a_decoder_prefix_too_long_for_the_decoder_is_named(marian):
    most = marian.max_seq_len - 2  # the start token, the prefix, and one generated token
    params = BeamSearchParams(beam_width=2, max_new_tokens=1, decoder_prefix=[7] * (most + 1))
    error = refused(lambda: marian.generate([{"prompt_token_ids": [5, 6, 2]}], params, use_tqdm=False))
    assert error.param == "decoder_prefix", error
    assert f"give at most {most} tokens" in str(error)
    (output,) = marian.generate([{"prompt_token_ids": [5, 6, 2]}], params.replace(decoder_prefix=[7] * most),
                                use_tqdm=False)
    assert output.outputs


def test_a_continuation_too_long_is_named(llama):
    room = llama.max_seq_len - len(PROMPT["prompt_token_ids"])
    error = refused(lambda: llama.score(PROMPT, [[4, 5], [6] * (room + 1)]))
    assert error.param == "continuations", error
    assert f"at most {room} fit within max_seq_len ({llama.max_seq_len})" in str(error)
    assert "max_new_tokens" not in str(error)
    (_, fits) = llama.score(PROMPT, [[4, 5], [6] * room])
    assert len(fits.token_ids) == room


def test_a_prompt_too_long_is_still_the_prompts_fault(llama):
    error = refused(lambda: llama.score({"prompt_token_ids": [5] * llama.max_seq_len}, [[4]]))
    assert error.param == "prompt"
