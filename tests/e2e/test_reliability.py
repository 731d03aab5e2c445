"""Issue #14's reproductions over HTTP, each beside greedy, sampled and beam calls running at the same
time, which must get exactly the answers they get alone:

- bad parameters the engine rejects at the edge (length_penalty outside [-10, 10], stop_token_ids
  outside [0, vocab) in sampling and beam mode, a lone UTF-16 surrogate in a prompt or a chat message)
  are a 400 naming the field, never a 500 or a stuck call;
- a request whose own processing raises in the engine (a per-request logits processor that fails)
  fails alone: a 500 or an SSE error event then [DONE], every block comes back, the server goes on.
"""

from __future__ import annotations

import json
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from e2e_helpers import ThreadServer, stream_post, stream_text

GOOD = {
    "greedy": {"prompt": "The weather today", "max_tokens": 12, "temperature": 0},
    "sampled": {"prompt": "In a galaxy far away", "max_tokens": 12, "temperature": 0.9, "top_p": 0.95,
                "seed": 7},
    "beam": {"prompt": "Lists of numbers: 1, 2,", "max_tokens": 8, "use_beam_search": True, "beam_width": 4,
             "n": 2},
}


def answer(body: dict) -> list[tuple]:
    return [(c["index"], c.get("text", c.get("message", {}).get("content")), c["finish_reason"],
             c.get("beam_score")) for c in body["choices"]]


def assert_same(got: list[tuple], expected: list[tuple], name: str) -> None:
    assert [a[:3] for a in got] == [a[:3] for a in expected], name
    for (*_, score), (*_, expected_score) in zip(got, expected):
        if expected_score is not None:
            assert score == pytest.approx(expected_score, abs=1e-4), name


@pytest.fixture(scope="module")
def references(server):
    with server.client() as client:
        out = {}
        for name, body in GOOD.items():
            response = client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            out[name] = answer(response.json())
        return out


def alongside_good_calls(server, references, path: str, content: bytes) -> httpx.Response:
    """Send `content` to `path` while each good call runs twice; check the good answers; return the
    response."""
    barrier = threading.Barrier(2 * len(GOOD) + 1)

    def good(name: str):
        with server.client() as client:
            barrier.wait()
            response = client.post("/v1/completions", json=GOOD[name])
        assert response.status_code == 200, (name, response.text)
        assert_same(answer(response.json()), references[name], name)

    with ThreadPoolExecutor(2 * len(GOOD)) as pool:
        futures = [pool.submit(good, name) for name in [*GOOD, *GOOD]]
        with server.client() as client:
            barrier.wait()
            response = client.post(path, content=content, headers={"Content-Type": "application/json"})
        for future in futures:
            future.result()
    return response


def assert_400(response: httpx.Response, param: str) -> dict:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert param in error["message"], error
    return error


VOCAB = 49152  # the tiny model carries SmolLM2's vocabulary


def test_huge_length_penalty_is_a_400(server, references):
    body = {"prompt": "Hi", "use_beam_search": True, "beam_width": 2, "max_tokens": 4, "length_penalty": 1000}
    response = alongside_good_calls(server, references, "/v1/completions", json.dumps(body).encode())
    assert "[-10" in assert_400(response, "length_penalty")["message"]


@pytest.mark.parametrize("length_penalty", [-20, -10.5, -10, 10])
def test_large_negative_length_penalty_is_a_400_or_a_whole_answer(server, references, length_penalty):
    body = {"prompt": "Hi", "use_beam_search": True, "beam_width": 2, "n": 2, "max_tokens": 4,
            "length_penalty": length_penalty}
    response = alongside_good_calls(server, references, "/v1/completions", json.dumps(body).encode())
    if abs(length_penalty) > 10:  # outside the engine's documented range
        assert_400(response, "length_penalty")
        return
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert len(choices) == 2 and all(c["text"] for c in choices)
    assert all(math.isfinite(c["beam_score"]) for c in choices)


@pytest.mark.parametrize("token_id", [VOCAB, 10**12, -10**12, 2**64, -1])
@pytest.mark.parametrize("mode", ["greedy", "sampled", "beam"])
def test_stop_token_ids_outside_the_vocabulary_are_a_400(server, references, token_id, mode):
    body = {"prompt": "Hi", "max_tokens": 4, "min_tokens": 2, "stop_token_ids": [token_id]}
    body.update({"greedy": {"temperature": 0}, "sampled": {"temperature": 0.8, "seed": 1},
                 "beam": {"use_beam_search": True, "beam_width": 2}}[mode])
    response = alongside_good_calls(server, references, "/v1/completions", json.dumps(body).encode())
    assert_400(response, "stop_token_ids")


@pytest.mark.parametrize("path,content,param", [
    ("/v1/completions", b'{"prompt": "abc\\ud800def", "max_tokens": 4}', "prompt"),
    ("/v1/completions", b'{"prompt": ["ok", "x\\udfffy"], "max_tokens": 4}', "prompt"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "abc\\ud800def"}], "max_tokens": 4}',
     "messages"),
    ("/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}', "messages"),
])
def test_lone_surrogates_are_a_400(server, references, path, content, param):
    response = alongside_good_calls(server, references, path, content)
    error = assert_400(response, param)
    assert "surrogate" in error["message"]


# -- a request that fails alone in the engine --------------------------------------------------------
FAULT_MARKER = "Fault injected here:"
FAULT_AT_TOKENS = 3

FAULT_SPECS = {  # 10 calls: greedy, seeded samples, beams; some streamed
    "greedy": {"prompt": "The weather today", "max_tokens": 16, "temperature": 0},
    "greedy-2": {"prompt": "Once upon a time", "max_tokens": 20, "temperature": 0},
    "greedy-stream": {"prompt": "The weather today", "max_tokens": 16, "temperature": 0, "stream": True},
    "greedy-stream-2": {"prompt": "My favourite food", "max_tokens": 10, "temperature": 0, "stream": True},
    "sampled": {"prompt": "In a galaxy far away", "max_tokens": 14, "temperature": 0.9, "seed": 7},
    "sampled-n2": {"prompt": "Random words:", "max_tokens": 12, "temperature": 1.0, "seed": 100, "n": 2},
    "sampled-stream": {"prompt": "A poem:", "max_tokens": 12, "temperature": 0.8, "top_k": 50, "seed": 11,
                       "stream": True},
    "beam-2": {"prompt": "Lists of numbers: 1, 2,", "max_tokens": 8, "use_beam_search": True,
               "beam_width": 2},
    "beam-4": {"prompt": "A list of fruits:", "max_tokens": 10, "use_beam_search": True, "beam_width": 4,
               "n": 3},
    "beam-8": {"prompt": "Hello", "max_tokens": 6, "use_beam_search": True, "beam_width": 8, "n": 2},
}
FAULTY = {
    "faulty-greedy": {"prompt": f"{FAULT_MARKER} greedy", "max_tokens": 30, "temperature": 0},
    "faulty-stream": {"prompt": f"{FAULT_MARKER} stream", "max_tokens": 30, "temperature": 0, "stream": True},
    "faulty-beam": {"prompt": f"{FAULT_MARKER} beam", "max_tokens": 30, "use_beam_search": True,
                    "beam_width": 4},
}


class InjectedFault(RuntimeError):
    pass


def raise_at(num_tokens: int):
    def processor(scores, num_generated_tokens: int) -> None:
        if num_generated_tokens >= num_tokens:
            raise InjectedFault(f"injected fault after {num_generated_tokens} tokens")
    return processor


@pytest.fixture(scope="module")
def faulty_server(tiny_chat_model_dir):
    """An in-process server on the tiny model whose engine adds a raising logits processor to every
    request whose prompt holds FAULT_MARKER."""
    from widebeam.engine import LLMEngine
    from widebeam.server.api import create_app

    class FaultyEngine(LLMEngine):
        def add_request(self, request_id, prompt, params=None, logits_processors=()):
            if isinstance(prompt, str) and FAULT_MARKER in prompt:
                logits_processors = [*logits_processors, raise_at(FAULT_AT_TOKENS)]
            return super().add_request(request_id, prompt, params, logits_processors=logits_processors)

    engine = FaultyEngine(str(tiny_chat_model_dir), device="cpu", kv_cache_memory="16MiB", max_beam_width=16,
                          max_num_batched_tokens=256)
    with ThreadServer(create_app(engine, model_name="tiny-chat")) as server:
        yield server


def call(client: httpx.Client, body: dict) -> tuple[int, object]:
    """(status, answer) for a whole call, (200, (text, finish_reason, events)) for a stream."""
    if body.get("stream"):
        status, events, done_last = stream_post(client, "/v1/completions", body)
        assert done_last or status != 200, events
        finishes = [c["finish_reason"] for e in events for c in e.get("choices", ()) if c["finish_reason"]]
        return status, (stream_text(events), finishes, events)
    response = client.post("/v1/completions", json=body)
    return response.status_code, (answer(response.json()) if response.status_code == 200 else response.json())


def test_a_failing_request_fails_alone_and_the_others_get_their_own_answers(faulty_server):
    with faulty_server.client() as client:
        alone = {name: call(client, body) for name, body in FAULT_SPECS.items()}
    assert all(status == 200 for status, _ in alone.values()), alone
    barrier = threading.Barrier(len(FAULT_SPECS) + len(FAULTY))

    def run(name: str, body: dict):
        with faulty_server.client() as client:
            barrier.wait()
            return name, call(client, body)

    with ThreadPoolExecutor(len(FAULT_SPECS) + len(FAULTY)) as pool:
        results = dict(pool.map(lambda item: run(*item), [*FAULT_SPECS.items(), *FAULTY.items()]))

    for name, body in FAULT_SPECS.items():
        status, got = results[name]
        assert status == 200, (name, got)
        if body.get("stream"):
            assert got[:2] == alone[name][1][:2], name
            assert not any("error" in e for e in got[2]), name
        else:
            assert_same(got, alone[name][1], name)
    for name in ("faulty-greedy", "faulty-beam"):
        status, body = results[name]
        assert status == 500, (name, body)
        error = body["error"]
        assert error["type"] == "server_error" and "InjectedFault" in error["message"], error
    status, (text, finishes, events) = results["faulty-stream"]
    assert status == 200 and finishes == [] and text, events  # some text went out before the fault
    assert "InjectedFault" in events[-1]["error"]["message"] and events[-1]["error"]["type"] == "server_error"

    with faulty_server.client() as client:
        for _ in range(100):  # the handlers' aborts are applied by the engine loop just after the calls
            health = client.get("/health").json()
            if health["running"] == 0 and health["waiting"] == 0:
                break
            time.sleep(0.05)
        assert health["status"] == "ok" and health["running"] == health["waiting"] == 0, health
        assert all(pool["free_blocks"] == pool["total_blocks"]
                   for pool in health["kv_blocks"].values()), health
        metrics = client.get("/metrics").text
        assert "widebeam_requests_failed_total 3.0" in metrics
        status, again = call(client, FAULT_SPECS["beam-4"])  # still serving, still the same answer
        assert status == 200
        assert_same(again, alone["beam-4"][1], "beam-4 after the faults")
