"""What real clients send besides the fields that matter: bookkeeping (`store`, `metadata`, `user`,
`service_tier`, `parallel_tool_calls`) is accepted and changes nothing; function calling (`tools`,
`tool_choice` other than "none") is a 400 naming the field; the model may be named by its `--model`
value too."""

from __future__ import annotations

import openai
import pytest

from widebeam.server.serve_cli import model_aliases


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0, timeout=60)


def test_bookkeeping_fields_are_accepted_and_change_nothing(client):
    messages = [{"role": "user", "content": "Say hi"}]
    plain = client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=6, temperature=0)
    tolerant = client.chat.completions.create(
        model="tiny-chat", messages=messages, max_tokens=6, temperature=0, store=False,
        metadata={"session": "abc"}, user="u-1", service_tier="auto", parallel_tool_calls=False)
    assert tolerant.choices[0].message.content == plain.choices[0].message.content
    completion = client.completions.create(model="tiny-chat", prompt="Hi", max_tokens=4, temperature=0,
                                           user="u-1", extra_body={"store": True, "metadata": {"k": "v"}})
    assert completion.choices[0].text


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
])
def test_function_calling_is_a_400_naming_the_field(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "x"}],
                                       max_tokens=4, **kwargs)
    assert info.value.body["param"] == param


def test_tool_choice_none_passes(client):
    out = client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "x"}],
                                         max_tokens=3, temperature=0, tool_choice="none")
    assert out.choices[0].finish_reason in ("stop", "length")


def test_the_model_answers_to_its_model_path_too(client, tiny_chat_model_dir):
    names = model_aliases(str(tiny_chat_model_dir))  # the server was started with --model <that path>
    assert names == (str(tiny_chat_model_dir), tiny_chat_model_dir.name)
    for name in names:
        out = client.completions.create(model=name, prompt="Hi", max_tokens=2, temperature=0)
        assert out.model == "tiny-chat"  # answered under the served name
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="tiny-chat-2", prompt="Hi", max_tokens=2)


def test_model_aliases():
    assert model_aliases("models/my-llama/") == ("models/my-llama/", "my-llama")
    assert model_aliases("smollm2-135m-instruct") == ("smollm2-135m-instruct",)


def test_penalties_reach_the_engine(client):
    """presence / frequency / repetition penalties over HTTP are the engine's (sampling and beams):
    negative ones make the tiny random model (which never repeats on its own) repeat what it wrote."""
    kwargs = {"model": "tiny-chat", "prompt": "Hello", "max_tokens": 16, "temperature": 0}
    plain = client.completions.create(**kwargs, extra_body={"ignore_eos": True})
    penalised = client.completions.create(**kwargs, presence_penalty=-2.0, frequency_penalty=-2.0,
                                          extra_body={"ignore_eos": True, "repetition_penalty": 1.0})
    assert penalised.usage.completion_tokens == 16
    assert penalised.choices[0].text != plain.choices[0].text
    beams = client.completions.create(model="tiny-chat", prompt="Hello", max_tokens=8, n=2,
                                      frequency_penalty=1.0,
                                      extra_body={"use_beam_search": True, "beam_width": 4,
                                                  "repetition_penalty": 1.3})
    assert len(beams.choices) == 2


def test_logit_bias_and_suffix_pass_only_at_their_neutral_values(client):
    plain = client.completions.create(model="tiny-chat", prompt="Hi", max_tokens=4, temperature=0)
    neutral = client.completions.create(model="tiny-chat", prompt="Hi", max_tokens=4, temperature=0,
                                        logit_bias={}, suffix="")
    assert neutral.choices[0].text == plain.choices[0].text
    for kwargs, param in (({"logit_bias": {"5": 10.0}}, "logit_bias"), ({"suffix": " end"}, "suffix")):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model="tiny-chat", prompt="Hi", max_tokens=4, **kwargs)
        assert info.value.body["param"] == param
