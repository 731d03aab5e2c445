"""The official `openai` client against `widebeam serve` on loopback."""

from __future__ import annotations

import openai
import pytest
from transformers import AutoTokenizer


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tokenizer(tiny_chat_model_dir):
    return AutoTokenizer.from_pretrained(str(tiny_chat_model_dir))


def test_models_lists_the_served_name(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny-chat"]
    assert models.data[0].model_extra["max_model_len"] == 2048


def test_greedy_completion(client, tokenizer):
    prompt = "The capital of France is"
    out = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=8, temperature=0)
    assert out.object == "text_completion"
    assert len(out.choices) == 1
    choice = out.choices[0]
    assert choice.index == 0 and choice.finish_reason == "length" and choice.text
    assert out.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert out.usage.completion_tokens == 8
    assert out.usage.total_tokens == out.usage.prompt_tokens + 8
    again = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=8, temperature=0)
    assert again.choices[0].text == choice.text


def test_chat_completion_uses_the_chat_template(client, tokenizer):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Name a colour."}]
    out = client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=6, temperature=0)
    assert out.object == "chat.completion"
    message = out.choices[0].message
    assert message.role == "assistant" and isinstance(message.content, str) and message.content
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert out.usage.prompt_tokens == len(tokenizer.encode(rendered))
    # the same prompt through /v1/completions gives the same greedy text
    plain = client.completions.create(model="tiny-chat", prompt=rendered, max_tokens=6, temperature=0)
    assert plain.choices[0].text == message.content


def test_streamed_completion_equals_the_whole_one(client):
    kwargs = {"model": "tiny-chat", "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0}
    whole = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert len(texts) >= 3, "the text arrives in several chunks, not all at the end"
    assert "".join(texts) == whole
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 24


def test_streamed_chat_completion(client):
    kwargs = {"model": "tiny-chat", "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 12,
              "temperature": 0}
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole
    assert chunks[-1].choices[0].finish_reason == "length"


def test_sampling_n_uses_seed_plus_i(client):
    kwargs = {"model": "tiny-chat", "prompt": "Random words:", "max_tokens": 10, "temperature": 1.0}
    many = client.completions.create(n=3, seed=100, **kwargs)
    assert [c.index for c in many.choices] == [0, 1, 2]
    singles = [client.completions.create(n=1, seed=100 + i, **kwargs).choices[0].text for i in range(3)]
    assert [c.text for c in many.choices] == singles
    assert len(set(singles)) > 1, "different seeds should sample different texts"
    assert many.usage.completion_tokens == 30


def test_beam_search_returns_n_beams_best_first(client):
    out = client.completions.create(model="tiny-chat", prompt="A list of fruits:", max_tokens=8, n=3,
                                    extra_body={"use_beam_search": True, "beam_width": 6})
    assert [c.index for c in out.choices] == [0, 1, 2]
    scores = [c.model_extra["beam_score"] for c in out.choices]
    assert scores == sorted(scores, reverse=True)
    assert len({c.text for c in out.choices}) == 3
    assert all(c.finish_reason in ("stop", "length") for c in out.choices)


def test_beam_search_chat_with_best_of(client):
    out = client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "Hello"}],
                                         max_tokens=6, n=2,
                                         extra_body={"use_beam_search": True, "best_of": 4})
    assert len(out.choices) == 2
    assert out.choices[0].model_extra["beam_score"] >= out.choices[1].model_extra["beam_score"]
    assert all(c.message.content for c in out.choices)


def test_client_errors_are_raised_as_openai_errors(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny-chat", prompt="x", max_tokens=4,
                                  extra_body={"use_beam_search": True, "temperature": 0.8})
    assert info.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=4)
    assert info.value.body["code"] == "model_not_found"
    wrong = openai.OpenAI(base_url=client.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model="tiny-chat", prompt="x", max_tokens=4)
