"""Admission's length limits through the engine's public path (`LLMEngine.add_request`), at their
boundaries: the prompt against `max_seq_len`, prompt + `max_new_tokens` against it, the default
`max_new_tokens` (what is left of `max_seq_len`), an encoder-decoder's source against its positions;
each refusal names its parameter and says what would fit, and nothing is queued."""

from __future__ import annotations

import pytest

from widebeam.errors import InvalidParameterError
from widebeam.llm import LLM
from widebeam.params import BeamSearchParams, SamplingParams

MAX_SEQ_LEN = 24


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), device="cpu", tokens_per_block=4, kv_cache_memory="2MiB",
               max_seq_len=MAX_SEQ_LEN, max_beam_width=8).engine


def run(engine, request_id, prompt_len, params):
    engine.add_request(request_id, {"prompt_token_ids": [5] * prompt_len}, params)
    outputs = {}
    while engine.has_unfinished():
        for delta in engine.step():
            if delta.finished:
                outputs[delta.request_id] = delta.output
    return outputs[request_id]


def greedy(max_new_tokens):
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0, ignore_eos=True)


# (prompt tokens, max_new_tokens, the parameter named, the message) for requests that cannot run
REFUSED = [
    (0, 4, "prompt", "prompt is empty: give at least one token"),
    (MAX_SEQ_LEN, 1, "prompt", (f"prompt has {MAX_SEQ_LEN} tokens but max_seq_len is {MAX_SEQ_LEN}: "
                               f"shorten the prompt to at most {MAX_SEQ_LEN - 1} tokens")),
    (MAX_SEQ_LEN + 5, None, "prompt",
     (f"prompt has {MAX_SEQ_LEN + 5} tokens but max_seq_len is {MAX_SEQ_LEN}: "
                                      f"shorten the prompt to at most {MAX_SEQ_LEN - 1} tokens")),
    (20, 5, "max_new_tokens",
     (f"prompt (20 tokens) + max_new_tokens (5) exceeds max_seq_len ({MAX_SEQ_LEN}); "
                              "use max_new_tokens <= 4")),
    (1, MAX_SEQ_LEN, "max_new_tokens",
     (f"prompt (1 tokens) + max_new_tokens ({MAX_SEQ_LEN}) exceeds max_seq_len "
                                       f"({MAX_SEQ_LEN}); use max_new_tokens <= {MAX_SEQ_LEN - 1}")),
]


@pytest.mark.parametrize("prompt_len,max_new_tokens,param,message", REFUSED)
def test_lengths_past_max_seq_len_are_refused_naming_the_parameter(engine, prompt_len, max_new_tokens, param,
                                                                   message):
    for params in (greedy(max_new_tokens), BeamSearchParams(beam_width=2, max_new_tokens=max_new_tokens)):
        with pytest.raises(InvalidParameterError) as info:
            engine.add_request("refused", {"prompt_token_ids": [5] * prompt_len}, params)
        assert info.value.param == param
        assert str(info.value) == message
        assert not engine.has_unfinished()


# (prompt tokens, max_new_tokens, tokens generated): the largest requests that fit, and the default
ADMITTED = [
    (MAX_SEQ_LEN - 1, 1, 1),
    (20, 4, 4),
    (1, MAX_SEQ_LEN - 1, MAX_SEQ_LEN - 1),
    (20, None, MAX_SEQ_LEN - 20),  # no max_new_tokens: what is left of max_seq_len
    (MAX_SEQ_LEN - 1, None, 1),
]


@pytest.mark.parametrize("prompt_len,max_new_tokens,generated", ADMITTED)
def test_the_longest_requests_that_fit_run_to_their_length(engine, prompt_len, max_new_tokens, generated):
    out = run(engine, f"fits-{prompt_len}-{max_new_tokens}", prompt_len, greedy(max_new_tokens))
    assert len(out.outputs[0].token_ids) == generated
    beams = run(engine, f"beams-{prompt_len}-{max_new_tokens}", prompt_len,
                BeamSearchParams(beam_width=2, max_new_tokens=max_new_tokens, ignore_eos=True))
    assert [len(b.token_ids) for b in beams.outputs] == [generated, generated]


def test_an_encoder_decoder_source_is_bounded_by_the_encoder_positions(tiny_marian_dir):
    engine = LLM(str(tiny_marian_dir), device="cpu", tokens_per_block=4, kv_cache_memory="4MiB").engine
    limit = engine.max_encoder_tokens
    assert limit == 128  # the tiny Marian's max_position_embeddings
    out = run(engine, "longest", limit, greedy(2))
    assert out.prompt_token_ids == [5] * limit and len(out.outputs[0].token_ids) == 2
    with pytest.raises(InvalidParameterError) as info:
        engine.add_request("too-long", {"prompt_token_ids": [5] * (limit + 1)}, greedy(2))
    assert info.value.param == "prompt"
    assert str(info.value) == (f"source has {limit + 1} tokens but the encoder takes at most {limit}: "
                               f"shorten the source to at most {limit} tokens")
    assert not engine.has_unfinished()
