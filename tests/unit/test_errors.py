"""Parameter errors are templates: `str(exc)` names the engine's parameters, `render(names)` the caller's,
and the HTTP API builds its message with `render` (no rewriting of the engine's text)."""

from __future__ import annotations

import pickle

import pytest

from widebeam.errors import InvalidParameterError, RequestTooLargeError, render_template
from widebeam.params import BeamSearchParams, SamplingParams

API = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "num_return_sequences": "n",
       "beam_width": "best_of", "prompt": "messages"}


def test_str_renders_engine_names_and_render_the_callers():
    exc = InvalidParameterError("max_new_tokens", "{max_new_tokens} must be >= 1, got {value!r}", value=0)
    assert str(exc) == "max_new_tokens must be >= 1, got 0"
    assert exc.render(API) == "max_tokens must be >= 1, got 0"
    assert exc.render({}) == exc.render() == str(exc)
    assert exc.param == "max_new_tokens" and isinstance(exc, ValueError)


def test_values_are_never_read_as_names_even_with_braces():
    """User input goes in as a value: braces in it stay as they are, names inside it are not renamed."""
    exc = InvalidParameterError("stop", "{stop} must hold only str values, got {value!r}",
                                value="{max_new_tokens}")
    assert str(exc) == "stop must hold only str values, got '{max_new_tokens}'"
    assert exc.render(API) == str(exc)


@pytest.mark.parametrize("message", ["the source is empty: give at least one token",
                                     "expected SamplingParams, got {'a': 1}", "a lone { brace", "}{",
                                     "{0}", "{}"])
def test_plain_messages_read_as_written(message):
    """A message written as plain text (no template fields) renders as itself under any names."""
    exc = InvalidParameterError("prompt", message)
    assert str(exc) == exc.render(API) == message


def test_doubled_braces_are_literal():
    assert render_template("{{beam_width}} is {beam_width}", API) == "{beam_width} is best_of"
    assert render_template("{n:>4}", values={"n": 7}) == "   7"


@pytest.mark.parametrize("make, engine_text, api_text", [
    (lambda: SamplingParams(max_new_tokens=0), "max_new_tokens must be an integer >= 1 or None, got 0",
     "max_tokens must be an integer >= 1 or None, got 0"),
    (lambda: SamplingParams(max_new_tokens=4, min_new_tokens=10),
     "min_new_tokens must be <= max_new_tokens (4), got 10", "min_tokens must be <= max_tokens (4), got 10"),
    (lambda: BeamSearchParams(beam_width=2, num_return_sequences=3),
     "num_return_sequences must be an integer in [1, beam_width=2] or None, got 3",
     "n must be an integer in [1, best_of=2] or None, got 3"),
    (lambda: BeamSearchParams(beam_width=0),
     "beam_width must be an integer >= 1 (or None: the schedule's widest step, else 4), got 0",
     "best_of must be an integer >= 1 (or None: the schedule's widest step, else 4), got 0"),
    (lambda: BeamSearchParams(early_stopping="sometimes"),
     "early_stopping must be True, False or \"never\", got 'sometimes'",
     "early_stopping must be True, False or \"never\", got 'sometimes'"),
    (lambda: SamplingParams(stop=("{x}", 5)), "stop must hold only str values, got 5",
     "stop must hold only str values, got 5"),
    (lambda: SamplingParams(stop=("",)), "stop must not contain empty strings",
     "stop must not contain empty strings"),
])
def test_params_errors_render_in_both_vocabularies(make, engine_text, api_text):
    with pytest.raises(InvalidParameterError) as info:
        make()
    assert str(info.value) == engine_text
    assert info.value.render(API) == api_text


def test_admission_error_renders_max_tokens():
    from widebeam.kv import FullAttentionSpec, KVCache
    from widebeam.sched.admission import admit_check

    cache = KVCache([(FullAttentionSpec(name="self", num_layers=1, num_kv_heads=1, head_dim=8), 100)],
                    tokens_per_block=16)
    with pytest.raises(InvalidParameterError) as info:
        admit_check(cache, max_seq_len=64, prompt_len=60, max_new_tokens=10)
    assert str(info.value) == ("prompt (60 tokens) + max_new_tokens (10) exceeds max_seq_len (64); "
                               "use max_new_tokens <= 4")
    assert info.value.render({"max_new_tokens": "max_completion_tokens"}) == (
        "prompt (60 tokens) + max_completion_tokens (10) exceeds max_seq_len (64); use "
        "max_completion_tokens <= 4")


def too_large(**changes) -> RequestTooLargeError:
    fields = {"pool": "self", "required_blocks": 48, "capacity_blocks": 32, "prompt_len": 5,
              "max_new_tokens": 40, "beam_width": 16, "tokens_per_block": 16, "max_new_tokens_that_fit": 16,
              "beam_width_that_fits": 10}
    return RequestTooLargeError(**{**fields, **changes})


def test_request_too_large_keeps_its_message_and_renders_names():
    exc = too_large()
    assert str(exc) == ("request can never fit the KV cache: pool 'self' needs 48 blocks but holds 32 "
                        "blocks of 16 tokens (prompt_len=5, max_new_tokens=40, beam_width=16); at "
                        "beam_width=16 it fits with max_new_tokens <= 16; at max_new_tokens=40 it fits with "
                        "beam_width <= 10")
    assert exc.render({"max_new_tokens": "max_tokens"}) == str(exc).replace("max_new_tokens", "max_tokens")
    none_fit = too_large(max_new_tokens_that_fit=0, beam_width_that_fits=0, detail="odd {detail} {text}")
    assert str(none_fit).endswith("; odd {detail} {text}; at beam_width=16 no max_new_tokens fits this "
                                  "prompt; at max_new_tokens=40 no beam_width fits this prompt")
    assert none_fit.pool == "self" and none_fit.max_new_tokens == 40


def test_errors_survive_pickling():
    for exc in (InvalidParameterError("n", "{n} must be >= 1, got {value}", value=0), too_large()):
        copy = pickle.loads(pickle.dumps(exc))
        assert type(copy) is type(exc) and str(copy) == str(exc) and copy.render(API) == exc.render(API)


def test_the_api_builds_its_error_with_render():
    from widebeam.server import protocol as p

    with pytest.raises(InvalidParameterError) as info:
        BeamSearchParams(beam_width=2, max_new_tokens=4, min_new_tokens=9)
    error = p.engine_error(info.value, width_field="beam_width", max_tokens_name="max_completion_tokens")
    assert error.param == "min_tokens"
    assert error.message == "min_tokens must be <= max_completion_tokens (4), got 9"
    capacity = p.engine_error(too_large())
    assert (capacity.code == p.KV_CAPACITY_CODE and capacity.message == str(too_large())
            and capacity.param is None)
    plain = p.engine_error(InvalidParameterError("prompt", "prompt is empty: give at least one token"),
                           prompt_field="messages")
    assert plain.param == "messages" and plain.message == "prompt is empty: give at least one token"
