"""The QA pass's reproductions (issue 30, items 3, 4, 5, 8, 9) through the official `openai` client on
loopback: each request that once answered a 500, an empty `choices` or text outside a catalogue is now
a 400 naming the field(s) with what would be valid (or, for echo + logprobs with speculation, simply
works); a greedy stream running at the same time is unaffected, and the pools are whole afterwards."""

from __future__ import annotations

import httpx
import openai
import pytest
from e2e_helpers import QA_GREEDY, QA_PROMPT, client_of, refused_alongside_a_stream

PROMPT, GREEDY = QA_PROMPT, QA_GREEDY
BEAM = {"use_beam_search": True, "beam_width": 4}


@pytest.fixture(scope="module")
def client(server):
    return client_of(server)


@pytest.fixture(scope="module")
def items(tiny_chat_model_dir) -> list[list[int]]:
    """An inline catalogue: its shortest item has 2 tokens, its longest 4."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_chat_model_dir))
    texts = ["yoga mat", "running shoes", "a green scarf"]
    return [tokenizer.encode(" " + text, add_special_tokens=False) for text in texts]


# -- 3. penalties: a range where the arithmetic stays finite ----------------------------------------
@pytest.mark.parametrize("penalty", [1e-300, 0.001, 1e300])
def test_a_repetition_penalty_outside_its_range_is_a_400_naming_the_range(server, client, penalty):
    error = refused_alongside_a_stream(server, client, "repetition_penalty", max_tokens=8, temperature=0.8,
                                       seed=1, extra_body={"repetition_penalty": penalty})
    assert "repetition_penalty must be a number in [0.01, 100.0]" in error["message"], error


@pytest.mark.parametrize("penalty", [0.01, 100])
def test_a_repetition_penalty_at_the_edges_samples(client, penalty):
    out = client.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=8, temperature=0.8, seed=1,
                                    frequency_penalty=2, presence_penalty=-2,
                                    extra_body={"repetition_penalty": penalty, "ignore_eos": True})
    assert out.usage.completion_tokens == 8


# -- 4. a catalogue whose items cannot fit max_tokens ------------------------------------------------
def test_max_tokens_below_the_shortest_item_is_a_400_naming_the_least(server, client, items):
    least = min(len(item) for item in items) + 1
    error = refused_alongside_a_stream(server, client, "max_tokens", max_tokens=least - 1, n=2,
                                       extra_body={**BEAM, "allowed_sequences": items})
    assert f"max_tokens must be >= {least} with this catalogue" in error["message"], error
    out = client.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=least, n=2,
                                    extra_body={**BEAM, "allowed_sequences": items})
    assert out.choices, "the least max_tokens returns an item"


def test_chat_names_max_completion_tokens(client, items):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": PROMPT}],
                                       max_completion_tokens=1,
                                       extra_body={**BEAM, "allowed_sequences": items})
    assert info.value.body["param"] == "max_completion_tokens"
    assert "max_completion_tokens must be >= " in info.value.body["message"]


# -- 5. stop / stop_token_ids with a catalogue --------------------------------------------------------
@pytest.mark.parametrize(("field", "value"), [("stop", [" mat", ","]), ("stop_token_ids", [2])])
def test_a_stop_with_a_catalogue_is_a_400_naming_both(server, client, items, field, value):
    """The QA got "yoga" and "running shoes," back: text that is no item."""
    error = refused_alongside_a_stream(server, client, field, max_tokens=8, n=2,
                                       extra_body={**BEAM, "allowed_sequences": items, field: value})
    assert error["message"].startswith(f"{field} and allowed_sequences exclude each other"), error


# -- 9. two Authorization headers -------------------------------------------------------------------
def test_two_authorization_headers_are_refused_whichever_comes_first(server, client):
    good, bad = f"Bearer {server.api_key}", "Bearer wrong"
    for first, second in ((good, bad), (bad, good), (good, good)):
        response = httpx.post(f"{server.url}/v1/completions", timeout=10,
                              headers=[("Authorization", first), ("Authorization", second)],
                              json={"model": "tiny-chat", "prompt": "hi", "max_tokens": 1})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["code"] == "duplicate_authorization_header" and "send exactly one" in error["message"]
    assert client.completions.create(model="tiny-chat", prompt="hi", max_tokens=1).choices


def test_two_authorization_headers_are_refused_without_an_api_key_too(small_server):
    response = httpx.get(f"{small_server.url}/v1/models", timeout=10,
                         headers=[("Authorization", "Bearer a"), ("Authorization", "Bearer b")])
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "duplicate_authorization_header"
    assert httpx.get(f"{small_server.url}/v1/models", timeout=10,
                     headers={"Authorization": "Bearer a"}).status_code == 200


# -- 8. echo + logprobs on a speculative server: it works, as on the plain one ----------------------
# (the speculative server is the session's `ngram_server`: `server` plus n-gram speculation)
def test_echo_with_logprobs_on_a_speculative_server_answers_as_the_plain_one(server, client, ngram_server):
    speculative_server = ngram_server
    prompt = "The quick brown fox jumps over the lazy dog. The quick brown fox"
    kwargs = {"model": "tiny-chat", "prompt": prompt, "max_tokens": 6, "temperature": 0, "echo": True,
              "logprobs": 2}
    plain = client.completions.create(**kwargs).choices[0]
    speculative = client_of(speculative_server).completions.create(**kwargs).choices[0]
    assert speculative.text == plain.text and speculative.text.startswith(prompt)
    assert speculative.logprobs.tokens == plain.logprobs.tokens
    assert speculative.logprobs.token_logprobs[0] is None is plain.logprobs.token_logprobs[0]
    for got, want in zip(speculative.logprobs.token_logprobs[1:], plain.logprobs.token_logprobs[1:],
                         strict=True):
        assert got == pytest.approx(want, abs=1e-4)
    speculative_server.wait_idle()
    pools = speculative_server.pools()
    assert pools and all(free == total for free, total in pools.values()), pools
