"""The QA pass's request reproductions of issue 41 (items 4, 6, 7, 8, 9) over HTTP, with the official
`openai` client or httpx: each refusal is a 400 naming the field the client sent, beside a greedy stream
that answers as it does alone, with the pools whole after; each documented success is checked by its
content. Echo on an encoder-decoder runs on the session's tiny NLLB-shaped translation server."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest
from e2e_helpers import (
    QA_GREEDY,
    QA_PROMPT,
    assert_pools_whole,
    client_of,
    refused_alongside_a_stream,
    streamed_text,
)

BEAM = {"use_beam_search": True}
MAX_BEAM_WIDTH = 16  # the session server's --max-beam-width (tests/e2e/conftest.py)
ENGINE_REQUESTS_PER_CALL = 128  # server/protocol.py's MAX_ENGINE_REQUESTS_PER_CALL, as docs/ state it


@pytest.fixture(scope="module")
def client(server):
    return client_of(server)


@pytest.fixture(scope="module")
def http(server):
    with server.client() as test_client:
        yield test_client


@pytest.fixture(scope="module")
def tokenizer(tiny_chat_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_chat_model_dir))


def refused_beside(server, stream_once, send, param: str) -> dict:
    """`refused_alongside_a_stream` for any route and server: `send()` (an httpx response) is a 400
    naming `param` while `stream_once()` runs, which answers as it does alone; pools whole after."""
    alone = stream_once()
    got: list[str] = []
    stream = threading.Thread(target=lambda: got.append(stream_once()))
    stream.start()
    response = send()
    stream.join(timeout=60)
    assert got == [alone]
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert "Traceback" not in error["message"] and ".py" not in error["message"], error
    assert stream_once() == alone
    assert_pools_whole(server)
    return error


# -- 6. a beam_width beside a schedule must be its widest step, 4 (the default's value) included -----
def test_beam_width_4_beside_a_schedule_is_a_400(server, client):
    schedule = {**BEAM, "beam_width_schedule": [2, 8]}
    error = refused_alongside_a_stream(server, client, "beam_width", max_tokens=4, n=2,
                                       extra_body={**schedule, "beam_width": 4})
    assert "widest step (8)" in error["message"], error
    alone = client.completions.create(model="tiny-chat", prompt=QA_PROMPT, max_tokens=4, n=2,
                                      extra_body=schedule)
    given = client.completions.create(model="tiny-chat", prompt=QA_PROMPT, max_tokens=4, n=2,
                                      extra_body={**schedule, "beam_width": 8})
    assert [c.text for c in given.choices] == [c.text for c in alone.choices] and len(alone.choices) == 2


# -- 7. the field the client sent: decoder_prefix, continuations; the documented caps are real -------
def test_a_continuation_too_long_names_continuations(small_server, tokenizer):
    """On the small server (max_seq_len 64): scoring has no max_tokens, the continuation is at fault."""
    client = client_of(small_server)
    card = client.models.list().data[0]
    max_seq_len = card.model_extra["max_model_len"]
    room = max_seq_len - len(tokenizer.encode(QA_PROMPT))
    body = {"prompt": QA_PROMPT, "continuations": [[100], [7] * (room + 1)]}

    def stream_once() -> str:
        return "".join(c.choices[0].text for c in client.completions.create(
            model=card.id, prompt=QA_PROMPT, stream=True, **QA_GREEDY) if c.choices)

    with small_server.client() as http:
        error = refused_beside(small_server, stream_once, lambda: http.post("/v1/score", json=body),
                               "continuations")
        assert f"at most {room} fit within max_seq_len ({max_seq_len})" in error["message"], error
        fits = http.post("/v1/score", json={**body, "continuations": [[100], [7] * room]})
    assert fits.status_code == 200 and len(fits.json()["data"][1]["token_ids"]) == room


def test_the_score_caps_are_the_documented_ones(server, client, http):
    """A call makes at most 128 engine requests, one per prompt per max_beam_width continuations: so
    128 x max_beam_width one-token continuations of one prompt score, one more is refused saying so;
    129 distinct prompts are refused naming `prompt`."""
    most = ENGINE_REQUESTS_PER_CALL * MAX_BEAM_WIDTH
    over = {"prompt": QA_PROMPT, "continuations": [[t] for t in range(most + 1)]}
    error = refused_beside(server, lambda: streamed_text(client), lambda: http.post("/v1/score", json=over),
                           "continuations")
    assert f"at most {most} continuations of one prompt" in error["message"], error
    body = http.post("/v1/score", json={"prompt": QA_PROMPT, "continuations": over["continuations"][:most]})
    assert body.status_code == 200, body.text
    assert [e["token_ids"] for e in body.json()["data"]] == over["continuations"][:most]
    distinct = {"prompt": [f"{QA_PROMPT} {i}" for i in range(ENGINE_REQUESTS_PER_CALL + 1)],
                "continuations": [[100]] * (ENGINE_REQUESTS_PER_CALL + 1)}
    error = http.post("/v1/score", json=distinct).json()["error"]
    assert error["param"] == "prompt" and "or 128 distinct prompts" in error["message"], error
    assert http.post("/v1/score", json={"prompt": QA_PROMPT, "continuations": [[1]] * 10_001}).json()[
        "error"]["param"] == "continuations"
    assert_pools_whole(server)


# -- 8. echo shows the prompt that was used: max_input_length keeps a prompt's last tokens -----------
@pytest.mark.parametrize("beam", [False, True])
def test_echo_with_max_input_length_shows_the_kept_prompt(server, client, tokenizer, beam):
    kept = tokenizer.decode(tokenizer.encode(QA_PROMPT)[-4:])
    extra = {"max_input_length": 4, **(BEAM if beam else {})}
    out = client.completions.create(model="tiny-chat", prompt=QA_PROMPT, echo=True, logprobs=0, max_tokens=4,
                                    temperature=0, extra_body=extra)
    choice = out.choices[0]
    assert choice.text.startswith(kept) and not choice.text.startswith(QA_PROMPT[:10]), choice.text
    assert out.usage.prompt_tokens == 4
    tokens = choice.logprobs.tokens
    assert len(tokens) == 4 + out.usage.completion_tokens
    assert "".join(tokens[:4]) == kept and choice.logprobs.token_logprobs[0] is None
    assert "".join(tokens) == choice.text
    assert_pools_whole(server)


def test_a_streamed_echo_with_max_input_length_starts_with_the_kept_prompt(client, tokenizer):
    kept = tokenizer.decode(tokenizer.encode(QA_PROMPT)[-4:])
    chunks = [c.choices[0].text for c in client.completions.create(
        model="tiny-chat", prompt=QA_PROMPT, echo=True, stream=True, extra_body={"max_input_length": 4},
        **QA_GREEDY) if c.choices]
    assert chunks[0] == kept


# -- 9. decoder_prefix on a decoder-only model; mixed continuations as batch --score takes them -------
def test_a_decoder_prefix_on_a_decoder_only_model_is_a_400(server, client, http):
    error = refused_alongside_a_stream(server, client, "decoder_prefix", extra_body={"decoder_prefix": [40]},
                                       **QA_GREEDY)
    assert "encoder-decoder" in error["message"] and "end of the prompt" in error["message"], error
    refused_beside(server, lambda: streamed_text(client),
                   lambda: http.post("/v1/score", json={"prompt": QA_PROMPT, "continuations": [[5]],
                                                        "decoder_prefix": " shoes"}), "decoder_prefix")


def test_mixed_continuations_score_as_batch_does(server, http, tokenizer, tiny_chat_model_dir, tmp_path):
    from batch_checks import write_jsonl

    from widebeam.batch import read_output, run

    mixed = [" socks", tokenizer.encode(" yoga mat", add_special_tokens=False), " a green scarf"]
    response = http.post("/v1/score", json={"prompt": QA_PROMPT, "continuations": mixed})
    assert response.status_code == 200, response.text
    data = response.json()["data"]
    as_ids = http.post("/v1/score", json={"prompt": QA_PROMPT, "continuations": [
        tokenizer.encode(c, add_special_tokens=False) if isinstance(c, str) else c for c in mixed]}).json()
    assert [e["token_ids"] for e in data] == [e["token_ids"] for e in as_ids["data"]]
    source = write_jsonl(tmp_path / "pairs.jsonl", [{"id": "q", "prompt": QA_PROMPT, "continuations": mixed}])
    run(source, tmp_path / "out.jsonl", str(tiny_chat_model_dir), defaults={"score": True}, progress=False,
        device="cpu", kv_cache_memory="4MiB")
    (record,) = read_output(tmp_path / "out.jsonl")
    assert record["error"] is None
    assert [o["token_ids"] for o in record["outputs"]] == [e["token_ids"] for e in data]
    for output, entry in zip(record["outputs"], data):
        assert output["score"] == pytest.approx(entry["logprob"], abs=1e-4)
    assert_pools_whole(server)


# -- 4. echo on an encoder-decoder: a 400 naming echo -------------------------------------------------
@pytest.fixture(scope="module")
def translation(nllb_server):
    """The session's tiny NLLB server (e2e/conftest.py), shared with test_translation_http.py."""
    return nllb_server


def _translated_stream(client) -> str:
    return "".join(c.choices[0].text for c in client.completions.create(
        model="tiny-nllb", prompt="hello world", stream=True, max_tokens=6, temperature=0) if c.choices)


@pytest.mark.parametrize("body", [
    {"logprobs": 1, "temperature": 0},
    {"logprobs": 1, **BEAM, "n": 2},
    {"logprobs": 1, "temperature": 0, "stream": True},
    {"logprobs": 1, **BEAM, "stream": True},
    {"temperature": 0},
], ids=["greedy", "beams", "greedy-stream", "beams-stream", "no-logprobs"])
def test_echo_on_an_encoder_decoder_is_a_400_naming_echo(translation, body):
    client = client_of(translation)
    with translation.client() as http:
        error = refused_beside(translation, lambda: _translated_stream(client), lambda: http.post(
            "/v1/completions", json={"prompt": "hello world", "max_tokens": 4, "echo": True, **body}), "echo")
    assert "encoder-decoder" in error["message"] and "drop echo" in error["message"], error


def test_a_decoder_prefix_too_long_names_decoder_prefix(translation):
    client = client_of(translation)
    max_seq_len = client.models.list().data[0].model_extra["max_model_len"]
    with translation.client() as http:
        def send(prefix_len: int) -> httpx.Response:
            return http.post("/v1/completions", json={"prompt": "hello world", "max_tokens": 1,
                                                      "temperature": 0, "decoder_prefix": [5] * prefix_len})

        error = refused_beside(translation, lambda: _translated_stream(client), lambda: send(max_seq_len - 1),
                               "decoder_prefix")
        assert f"give at most {max_seq_len - 2} tokens" in error["message"], error
        fits = send(max_seq_len - 2)
        assert fits.status_code == 200 and fits.json()["usage"]["completion_tokens"] == 1
    with pytest.raises(openai.BadRequestError) as info:  # the official client sees the same
        client.completions.create(model="tiny-nllb", prompt="hello world", max_tokens=1,
                                  extra_body={"decoder_prefix": [5] * (max_seq_len - 1)})
    assert info.value.body["param"] == "decoder_prefix"
