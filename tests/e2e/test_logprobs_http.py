"""Log-probs over HTTP with the official `openai` client, in OpenAI's shapes: completions `logprobs: k`
(and `echo`), chat `logprobs: true, top_logprobs: k`, greedy, sampled and beam search, streamed and not.
Values are checked against transformers' log-softmax on the same tiny model (teacher-forced)."""

from __future__ import annotations

import math

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

PROMPT_IDS = [504, 3458, 282, 4649, 314, 253]
ATOL = 2e-4


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def hf(tiny_chat_model_dir):
    return AutoModelForCausalLM.from_pretrained(str(tiny_chat_model_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(tiny_chat_model_dir):
    return AutoTokenizer.from_pretrained(str(tiny_chat_model_dir))


def _log_softmax(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), dim=-1)


def _greedy_reference(hf, prompt: list[int], num_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    ids, rows = list(prompt), []
    for _ in range(num_tokens):
        row = _log_softmax(hf, ids)[-1]
        rows.append(row)
        ids.append(int(row.argmax()))
    return ids[len(prompt):], rows


def test_completion_logprobs_are_the_models(client, hf, tokenizer):
    out = client.completions.create(model="tiny-chat", prompt=PROMPT_IDS, max_tokens=6, temperature=0,
                                    logprobs=3)
    logprobs = out.choices[0].logprobs
    tokens, rows = _greedy_reference(hf, PROMPT_IDS, 6)
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 6
    for i, (token, row) in enumerate(zip(tokens, rows)):
        assert logprobs.tokens[i] == tokenizer.convert_tokens_to_string(
            [tokenizer.convert_ids_to_tokens(token)])
        assert logprobs.token_logprobs[i] == pytest.approx(float(row[token]), abs=ATOL)
        top = logprobs.top_logprobs[i]
        assert 3 <= len(top) <= 4 and logprobs.tokens[i] in top  # the top 3 and the chosen token
        assert sorted(top.values(), reverse=True)[:3] == pytest.approx(torch.topk(row, 3).values.tolist(),
                                                                       abs=ATOL)
    offsets = logprobs.text_offset
    assert offsets[0] == 0 and all(b - a == len(t) for a, b, t in zip(offsets, offsets[1:], logprobs.tokens))


def test_chat_logprobs_whole_and_streamed(client):
    kwargs = {"model": "tiny-chat", "messages": [{"role": "user", "content": "Count to three."}],
              "max_tokens": 8, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    whole = client.chat.completions.create(**kwargs).choices[0]
    content = whole.logprobs.content
    assert len(content) == 8
    for entry in content:
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs),
                                                                 reverse=True)
        assert len(entry.top_logprobs) == 2 and entry.logprob <= entry.top_logprobs[0].logprob + 1e-6
        assert entry.bytes == list(entry.token.encode("utf-8"))
    # sampled: the chosen token is often not the most likely; top_logprobs are still the k most likely
    sampled = client.chat.completions.create(**{**kwargs, "temperature": 2.0, "seed": 3,
                                                "max_tokens": 16}).choices[0]
    assert any(e.logprob < e.top_logprobs[0].logprob - 1e-3 for e in sampled.logprobs.content)
    for entry in sampled.logprobs.content:
        logprobs = [t.logprob for t in entry.top_logprobs]
        assert len(logprobs) == 2 and logprobs == sorted(logprobs, reverse=True)
        assert entry.token in [t.token for t in entry.top_logprobs] or entry.logprob <= logprobs[-1] + 1e-6
    streamed = [entry for chunk in client.chat.completions.create(stream=True, **kwargs)
                if chunk.choices and chunk.choices[0].logprobs for entry in chunk.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    # (float noise only: the second call's prompt comes from the prefix cache)
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=ATOL)
    plain = client.chat.completions.create(**{**kwargs, "logprobs": None, "top_logprobs": None}).choices[0]
    assert plain.logprobs is None and plain.message.content == whole.message.content


def test_sampled_stream_logprobs_cover_every_token(client):
    chunks = list(client.completions.create(model="tiny-chat", prompt="Once", max_tokens=12, temperature=1.0,
                                            seed=5, logprobs=1, stream=True,
                                            stream_options={"include_usage": True}))
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert len(tokens) == chunks[-1].usage.completion_tokens
    offsets = [o for c in chunks if c.choices and c.choices[0].logprobs
               for o in c.choices[0].logprobs.text_offset]
    assert offsets == sorted(offsets) and offsets[0] == 0


@pytest.mark.parametrize("stream", [False, True])
def test_each_beam_has_its_own_logprobs(client, stream):
    response = client.completions.create(model="tiny-chat", prompt=PROMPT_IDS, max_tokens=7, logprobs=2, n=4,
                                         stream=stream, extra_body={"use_beam_search": True, "beam_width": 4})
    choices = [c for chunk in response for c in chunk.choices] if stream else response.choices
    assert len(choices) == 4
    scores = []
    for choice in choices:
        logprobs = choice.logprobs
        # length_penalty 1: the beam score is the mean of its tokens' log-probs (EOS included)
        score = choice.model_extra["beam_score"]
        assert sum(logprobs.token_logprobs) / len(logprobs.token_logprobs) == pytest.approx(score, abs=1e-4)
        scores.append(score)
    assert scores == sorted(scores, reverse=True) and len({tuple(c.logprobs.tokens) for c in choices}) == 4


def test_echo_with_logprobs_scores_the_prompt(client, hf, tokenizer):
    prompt = "The quick brown fox"
    out = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=2, temperature=0, echo=True,
                                    logprobs=1)
    choice = out.choices[0]
    ids = tokenizer.encode(prompt)
    assert choice.text.startswith(prompt) and len(choice.text) > len(prompt)
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(ids) + 2 and logprobs.token_logprobs[0] is None
    assert logprobs.top_logprobs[0] is None
    ref = _log_softmax(hf, ids)
    for i in range(1, len(ids)):
        assert logprobs.token_logprobs[i] == pytest.approx(float(ref[i - 1, ids[i]]), abs=ATOL)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny-chat", prompt=prompt, max_tokens=2, temperature=0, echo=True, stream=True) if c.choices)
    assert streamed == choice.text


def test_prompt_logprobs_extension(client):
    out = client.completions.create(model="tiny-chat", prompt=PROMPT_IDS, max_tokens=1, temperature=0,
                                    extra_body={"prompt_logprobs": 2})
    entries = out.choices[0].model_extra["prompt_logprobs"]
    assert len(entries) == len(PROMPT_IDS) and entries[0] is None
    for token, entry in zip(PROMPT_IDS[1:], entries[1:]):
        assert str(token) in entry and math.isfinite(entry[str(token)]["logprob"])
        assert {v["rank"] for k, v in entry.items() if k != str(token)} <= {1, 2}


def test_seed_is_honoured(client):
    kwargs = {"model": "tiny-chat", "prompt": "Once", "max_tokens": 10, "temperature": 1.0, "n": 3}
    first = [c.text for c in client.completions.create(seed=11, **kwargs).choices]
    assert [c.text for c in client.completions.create(seed=11, **kwargs).choices] == first
    assert [c.text for c in client.completions.create(seed=12, **kwargs).choices] != first
    assert len(set(first)) > 1  # the n choices are n different samples


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"echo": True, "logprobs": 1, "stream": True}, "echo"),
    ({"extra_body": {"prompt_logprobs": 50}}, "prompt_logprobs"),
])
def test_bad_completion_logprobs_are_400(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny-chat", prompt="x", max_tokens=2, **kwargs)
    assert info.value.body["param"] == param


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
])
def test_bad_chat_logprobs_are_400(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "x"}],
                                       max_tokens=2, **kwargs)
    assert info.value.body["param"] == param
