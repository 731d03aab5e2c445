"""A request that fails alone in the engine (a delta with `error`) fails only its own call: HTTP 500
with an OpenAI error object, or for a stream an SSE error event followed by `data: [DONE]`; the other
calls in flight finish as if nothing happened. Only an exception from `step()` itself (the shared
forward pass) fails every call in flight. A scripted engine makes the faults exact and the tests fast."""

from __future__ import annotations

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from e2e_helpers import (
    TOTAL_BLOCKS,
    ScriptedEngine,
    ThreadServer,
    start_calls,
    stream_post,
    stream_text,
    wait_running,
)

from widebeam.server.api import create_app


def expected_text(num_tokens: int) -> str:
    return "".join(f"t{i} " for i in range(1, num_tokens + 1))


@pytest.fixture()
def served():
    engine = ScriptedEngine(step_s=0.005)
    with ThreadServer(create_app(engine, model_name="scripted")) as server:
        server.engine = engine
        yield server


def metric(client, name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", client.get("/metrics").text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def assert_all_free(client, timeout_s: float = 5.0) -> None:
    """Nothing runs and every block is free (aborts are applied by the engine loop soon after the call)."""
    deadline = time.monotonic() + timeout_s
    while (health := client.get("/health").json())["running"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert health["status"] == "ok" and health["running"] == 0, health
    assert all(pool["free_blocks"] == pool["total_blocks"] == TOTAL_BLOCKS
               for pool in health["kv_blocks"].values()), health


GOOD = [
    ("sampled", {"prompt": "a", "max_tokens": 12}),
    ("sampled-n2", {"prompt": "b", "max_tokens": 9, "n": 2, "seed": 3}),
    ("beam", {"prompt": "c", "max_tokens": 10, "use_beam_search": True, "beam_width": 3, "n": 2}),
    ("stream", {"prompt": "d", "max_tokens": 11, "stream": True}),
]


def run_good(client, name: str, body: dict) -> None:
    if body.get("stream"):
        status, events, done_last = stream_post(client, "/v1/completions", body)
        assert status == 200 and done_last, (name, events)
        assert not any("error" in e for e in events), (name, events)
        assert stream_text(events) == expected_text(body["max_tokens"]), name
        return
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, (name, response.text)
    choices = response.json()["choices"]
    assert len(choices) == body.get("n", 1), name
    assert all(c["text"] == expected_text(body["max_tokens"]) for c in choices), (name, choices)


def test_a_failed_request_fails_only_its_own_call(served):
    barrier = threading.Barrier(len(GOOD) * 2 + 2)
    outcomes = {}

    def failing(stream: bool):
        with served.client() as client:
            barrier.wait()
            body = {"prompt": "boom fail@4", "max_tokens": 50}
            if stream:
                outcomes["stream"] = stream_post(client, "/v1/completions", body)
            else:
                response = client.post("/v1/completions", json=body)
                outcomes["whole"] = (response.status_code, response.json())

    def good(spec):
        with served.client() as client:
            barrier.wait()
            run_good(client, *spec)

    with ThreadPoolExecutor(len(GOOD) * 2 + 2) as pool:
        futures = [pool.submit(failing, True), pool.submit(failing, False)]
        futures += [pool.submit(good, spec) for spec in GOOD * 2]
        for future in futures:
            future.result()

    status, body = outcomes["whole"]
    assert status == 500, body
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "server_error" and body["error"]["code"] == "engine_error"
    assert "ValueError: scripted fault" in body["error"]["message"]

    status, events, done_last = outcomes["stream"]
    assert status == 200 and done_last, events
    assert stream_text(events[:-1]) == expected_text(3)  # the text of the steps before the fault went out
    assert (events[-1]["error"]["type"] == "server_error"
            and "scripted fault" in events[-1]["error"]["message"])

    with served.client() as client:
        assert metric(client, "widebeam_requests_failed_total") == 2
        assert_all_free(client)
        run_good(client, *GOOD[0])  # still serving


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_one_failed_choice_fails_its_call_and_aborts_its_siblings(served, stream):
    body = {"prompt": "siblings fail@2:1", "max_tokens": 40, "n": 3, "seed": 1}
    with served.client() as client:
        if stream:
            status, events, done_last = stream_post(client, "/v1/completions", body)
            assert status == 200 and done_last and "scripted fault" in events[-1]["error"]["message"], events
        else:
            response = client.post("/v1/completions", json=body)
            assert response.status_code == 500 and "scripted fault" in response.json()["error"]["message"]
        assert_all_free(client)
    assert sorted(re.sub(r".*-", "", rid) for rid in served.engine.aborted) == ["0", "2"]


def test_the_openai_client_raises_on_the_error_event(served):
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=30)
    stream = client.completions.create(model="scripted", prompt="fail@3", max_tokens=20, stream=True)
    texts = []
    with pytest.raises(openai.APIError, match="scripted fault"):
        for chunk in stream:
            texts.extend(c.text for c in chunk.choices)
    assert "".join(texts) == expected_text(2)
    with pytest.raises(openai.InternalServerError, match="scripted fault"):
        client.completions.create(model="scripted", prompt="fail@3", max_tokens=20)
    assert client.completions.create(model="scripted", prompt="ok",
                                     max_tokens=3).choices[0].text == expected_text(3)


def test_a_failed_shared_step_fails_every_call_in_flight(served):
    outcomes, threads = start_calls(served, {"bystander": {"prompt": "x", "max_tokens": 5000},
                                             "stream": {"prompt": "y", "max_tokens": 5000, "stream": True}})
    with served.client() as client:
        wait_running(client, 2)
    crasher, crasher_threads = start_calls(served, {"crasher": {"prompt": "crash@3", "max_tokens": 50}})
    for thread in threads + crasher_threads:
        thread.join(timeout=60)
    outcomes.update(crasher)
    for name in ("crasher", "bystander"):
        status, body = outcomes[name]
        assert status == 500 and "scripted crash" in body["error"]["message"], (name, body)
    status, events, done_last = outcomes["stream"]
    assert status == 200 and done_last and "scripted crash" in events[-1]["error"]["message"], events
    with served.client() as client:
        assert_all_free(client)
        run_good(client, *GOOD[2])  # the loop keeps serving


def test_a_bug_while_streaming_still_ends_with_an_error_event_and_done(served, monkeypatch):
    from widebeam.server import schemas

    real_chunk_choice = schemas.chunk_choice

    def breaks_on_the_second_piece(chat, index, text, *args, **kwargs):
        if text == "t2 ":
            raise KeyError("a bug")
        return real_chunk_choice(chat, index, text, *args, **kwargs)

    monkeypatch.setattr(schemas, "chunk_choice", breaks_on_the_second_piece)
    with served.client() as client:
        status, events, done_last = stream_post(client, "/v1/completions",
                                                {"prompt": "x", "max_tokens": 1000})
        assert status == 200 and done_last, events
        assert stream_text(events[:-1]) == expected_text(1)
        assert events[-1]["error"]["type"] == "server_error"
        assert_all_free(client)  # its engine request was aborted
