"""Beam-search options, stops and streaming over HTTP with the official `openai` client, held to the
engine's own answer (`LLM.generate` on the same model and sizing, in this process).

Each beam option is sent in a case where it changes the engine's answer (checked first, on the
engine), so a server that dropped or misread it would answer differently.
"""

from __future__ import annotations

import itertools

import httpx
import openai
import pytest

from widebeam.llm import LLM
from widebeam.params import BeamSearchParams

MODEL = "tiny-chat"
PROMPT = "A list of fruits:"
BASE = {"beam_width": 6, "max_new_tokens": 12, "num_return_sequences": 6}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def llm(tiny_chat_model_dir):
    # the `server` fixture's sizing (tests/e2e/conftest.py)
    return LLM(str(tiny_chat_model_dir), device="cpu", kv_cache_memory="16MiB", max_beam_width=16,
               max_num_batched_tokens=256)


def engine_beams(llm, **fields):
    (out,) = llm.generate([PROMPT], BeamSearchParams(**{**BASE, **fields}), use_tqdm=False)
    return [(c.text, c.finish_reason, round(c.score, 4)) for c in out.outputs]


HTTP_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "num_return_sequences": "n"}


def http_beams(client, **fields):
    """The same request through the openai client: the engine's names mapped to the API's."""
    body = {HTTP_NAMES.get(k, k): list(v) if isinstance(v, tuple) else v
            for k, v in {**BASE, **fields}.items()}
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=body.pop("max_tokens"),
                                    n=body.pop("n"), extra_body={"use_beam_search": True, **body})
    return [(c.text, c.finish_reason, round(c.model_extra["beam_score"], 4)) for c in out.choices]


@pytest.fixture(scope="module")
def picks(llm):
    """Stop tokens and a stop string the unconstrained search meets early (from its own beams)."""
    (out,) = llm.generate([PROMPT], BeamSearchParams(**BASE), use_tqdm=False)
    text = out.outputs[1].text
    stop_text = text[len(text) // 3:len(text) // 3 + 2]
    assert stop_text.strip(), text
    return {"tokens": out.outputs[0].token_ids, "stop_text": stop_text}


def beam_cases(picks):
    """(option, engine fields, the same without the option): length_penalty = -1 favours short
    hypotheses, so beams that end on a stop token are returned."""
    toks, text = picks["tokens"], picks["stop_text"]
    short = {"length_penalty": -1.0, "stop_token_ids": (toks[0],)}
    narrow = {"beam_width": 2, "num_return_sequences": 2, "stop_token_ids": (toks[1], toks[3], toks[5])}
    return [
        ("length_penalty", {"length_penalty": 0.3}, {}),
        ("stop_token_ids", short, {"length_penalty": -1.0}),
        ("min_tokens", {**short, "min_new_tokens": 4}, short),
        ("early_stopping", {**narrow, "early_stopping": True}, {**narrow, "early_stopping": False}),
        ("early_stopping never", {**narrow, "early_stopping": "never"}, {**narrow, "early_stopping": True}),
        ("stop", {"stop": (text,)}, {}),
        ("all", {"length_penalty": -0.5, "early_stopping": True, "min_new_tokens": 2, "stop": (text,),
                 "stop_token_ids": (toks[2],)}, {}),
    ]


def test_beam_options_over_http_equal_the_engine(client, llm, picks):
    for name, fields, without in beam_cases(picks):
        expected = engine_beams(llm, **fields)
        assert expected != engine_beams(llm, **without), f"{name}: the case does not exercise the option"
        assert http_beams(client, **fields) == expected, name
    # the stop string did stop beams, cut before it
    stopped = [b for b in engine_beams(llm, stop=(picks["stop_text"],)) if b[1] == "stop"]
    assert stopped and all(picks["stop_text"] not in b[0] for b in stopped)


def test_streamed_beam_search_equals_the_whole_answer(client, picks):
    body = {"use_beam_search": True, "beam_width": 6, "stop": [picks["stop_text"]], "length_penalty": 0.5}
    kwargs = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "n": 3}
    whole = client.completions.create(**kwargs, extra_body=body)
    chunks = list(client.completions.create(stream=True, **kwargs, extra_body=body))
    texts, finishes = {}, {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason is not None:
                finishes[choice.index] = choice.finish_reason
    assert texts == {c.index: c.text for c in whole.choices}
    assert finishes == {c.index: c.finish_reason for c in whole.choices}


@pytest.mark.parametrize("chat", [False, True])
def test_streamed_text_with_a_stop_string_equals_the_whole_answer(client, chat):
    """The stop string starts inside one streamed piece and ends in the next."""
    greedy = {"model": MODEL, "max_tokens": 24, "temperature": 0}
    if chat:
        create, greedy["messages"] = (client.chat.completions.create,
                                      [{"role": "user", "content": "Tell a story."}])
        text_of = lambda choice: choice.message.content
        piece_of = lambda choice: choice.delta.content or ""
    else:
        create, greedy["prompt"] = client.completions.create, "Once upon a time"
        text_of = piece_of = lambda choice: choice.text
    unstopped = text_of(create(**greedy).choices[0])
    pieces = [piece_of(c.choices[0]) for c in create(stream=True, **greedy) if c.choices]
    assert "".join(pieces) == unstopped
    # a stop string across a piece boundary: the stream must hold the first piece's end back
    stop = next(a[-2:] + b[:1] for i, (a, b) in enumerate(itertools.pairwise(pieces))
                if i >= 2 and len(a) >= 2 and b
                and unstopped.find(a[-2:] + b[:1]) == len("".join(pieces[:i + 1])) - 2)
    whole = create(stop=[stop], **greedy).choices[0]
    assert whole.finish_reason == "stop" and text_of(whole) == unstopped[:unstopped.index(stop)]
    chunks = list(create(stop=[stop], stream=True, **greedy))
    assert "".join(piece_of(c.choices[0]) for c in chunks if c.choices) == text_of(whole)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_streamed_sampling_with_n_choices_equals_the_whole_answer(client):
    kwargs = {"model": MODEL, "prompt": "Random words:", "max_tokens": 10, "temperature": 1.0, "n": 3,
              "seed": 7}
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, **kwargs))
    texts, finishes = {}, {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason is not None:
                finishes[choice.index] = choice.finish_reason
    assert texts == {c.index: c.text for c in whole.choices} and len(set(texts.values())) == 3
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert sum(1 for c in chunks for _ in c.choices) > 3, "the choices arrive in pieces"


@pytest.mark.parametrize("stream", [False, True])
def test_infeasible_chat_request_is_400_streamed_or_not(small_server, stream):
    """36 prompt tokens (the chat template's) + 20 at beam width 16 need 34 blocks of the 32."""
    body = {"messages": [{"role": "user", "content": "An infeasible beam search"}], "max_tokens": 20,
            "use_beam_search": True, "beam_width": 16, "stream": stream}
    response = httpx.post(f"{small_server.url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "kv_cache_capacity_exceeded" and "never fit" in error["message"]
    assert "beam_width=16" in error["message"]
    small_server.wait_idle()


def test_advertised_metrics_count_tokens_latency_and_finish_reasons(client, server):
    server.wait_idle()
    before = server.metrics()
    beams = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, n=3,
                                      extra_body={"use_beam_search": True, "beam_width": 4, "min_tokens": 8})
    greedy = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=0)
    after = server.wait_idle()
    assert len(beams.choices) == 3
    assert (after["widebeam_generation_tokens_total"] - before["widebeam_generation_tokens_total"]
            == beams.usage.completion_tokens + greedy.usage.completion_tokens == 3 * 8 + 5)
    assert (after["widebeam_time_per_output_token_seconds_count"]
            - before["widebeam_time_per_output_token_seconds_count"]) == 2
    assert (after["widebeam_time_per_output_token_seconds_sum"]
            > before["widebeam_time_per_output_token_seconds_sum"])
    length = 'widebeam_requests_finished_total{finish_reason="length"}'
    assert after[length] - before.get(length, 0) == 2
    # every pool reports its total, and the engine's free count comes back to it
    assert server.pools() and all(free == total > 0 for free, total in server.pools().values())


@pytest.fixture()
def api_key_server(monkeypatch):
    """`widebeam serve --api-key K` up to uvicorn (engine replaced), then its app served on loopback."""
    from e2e_helpers import ScriptedEngine, ThreadServer

    from widebeam.server import serve_cli
    from widebeam.server.shutdown import DrainingServer

    seen = {}

    def fake_run(self, sockets=None):
        seen["app"] = self.config.app
        self.started = True

    monkeypatch.setattr("widebeam.engine.LLMEngine", lambda model, **kwargs: ScriptedEngine())
    monkeypatch.setattr(DrainingServer, "run", fake_run)
    monkeypatch.delenv(serve_cli.API_KEY_ENV, raising=False)
    assert serve_cli.main(["--port", "0", "--api-key", "flag-key", "--served-model-name", "scripted"]) == 0
    with ThreadServer(seen["app"]) as served:
        yield served


def test_api_key_flag_is_required_by_the_server(api_key_server):
    body = {"model": "scripted", "prompt": "hi", "max_tokens": 2}
    with api_key_server.client() as http:
        assert http.post("/v1/completions", json=body).status_code == 401
        assert http.post("/v1/completions", json=body,
                         headers={"Authorization": "Bearer wrong"}).status_code == 401
        ok = http.post("/v1/completions", json=body, headers={"Authorization": "Bearer flag-key"})
        assert ok.status_code == 200, ok.text
        assert ok.json()["choices"][0]["text"] == "t1 t2 "
