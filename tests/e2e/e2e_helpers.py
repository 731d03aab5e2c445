"""Helpers for e2e tests that reach inside the server: a scripted engine (the engine's public API, no
model), uvicorn serving an app from `create_app` on loopback from a thread, and an SSE reader."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from typing import Self

import httpx
import openai
import pytest
import uvicorn

from widebeam.outputs import CompletionOutput, RequestDelta, RequestOutput
from widebeam.params import BeamSearchParams

PROMPT_IDS = [7, 8, 9]
TOTAL_BLOCKS = 64


class ScriptedEngine:
    """Each request adds the text "t{n} " on step n until `max_new_tokens`, holding one "block" while it
    runs. A prompt holding `fail@N` makes the engine report the request failed on its step N (a delta
    with `error`, as `LLMEngine.step` does for a request whose own processing raised); `fail@N:K` does
    so only for the call's K-th engine request (ids end in `-K`); `crash@N` makes the whole `step()`
    raise on that request's step N. Every step sleeps `step_s`."""

    tokenizer = None
    max_seq_len = 100_000

    def __init__(self, step_s: float = 0.0):
        self.step_s = step_s
        self.requests: dict[str, dict] = {}
        self.aborted: list[str] = []

    def add_request(self, request_id, prompt, params, logits_processors=()):
        text = prompt if isinstance(prompt, str) else ""
        marks = {kind: int(n) for kind, n, k in re.findall(r"(fail|crash)@(\d+)(?::(\d+))?", text)
                 if not k or request_id.endswith(f"-{k}")}
        self.requests[request_id] = {"params": params, "n": 0, "prompt": text, **marks}
        return list(PROMPT_IDS)

    def abort(self, request_id):
        if self.requests.pop(request_id, None) is not None:
            self.aborted.append(request_id)

    def has_unfinished(self):
        return bool(self.requests)

    def stats(self):
        return {"pools": {"self": {"total_blocks": TOTAL_BLOCKS,
                                   "free_blocks": TOTAL_BLOCKS - len(self.requests)}},
                "running": len(self.requests), "waiting": 0, "rejected": 0}

    def step(self):
        time.sleep(self.step_s)
        deltas = []
        for request_id, state in list(self.requests.items()):
            state["n"] += 1
            n, params = state["n"], state["params"]
            if state.get("crash") == n:
                raise RuntimeError(f"scripted crash of the shared step at {request_id}")
            if state.get("fail") == n:
                del self.requests[request_id]
                deltas.append(RequestDelta(request_id, finished=True, error="ValueError: scripted fault"))
                continue
            beam = isinstance(params, BeamSearchParams)
            delta = RequestDelta(request_id, first_token=n == 1, num_generated_tokens=n)
            if not beam:
                delta.new_token_ids, delta.new_text = [100 + n], f"t{n} "
            if n == params.max_new_tokens:
                text = "".join(f"t{i} " for i in range(1, n + 1))
                ids = [100 + i for i in range(1, n + 1)]
                width = params.beam_width if beam else 1
                outputs = [CompletionOutput(i, text, ids, -1.0 - i, "length", -0.5 - i if beam else None)
                           for i in range(width)]
                delta.finished = True
                delta.output = RequestOutput(request_id, state["prompt"], list(PROMPT_IDS), outputs, True)
                del self.requests[request_id]
            deltas.append(delta)
        return deltas


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ThreadServer:
    """`server_class(uvicorn.Config(app, ...), *server_args)` serving on loopback from a daemon thread."""

    def __init__(self, app, server_class=uvicorn.Server, *server_args):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on",
                                timeout_graceful_shutdown=5)
        self.server = server_class(config, *server_args)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn-test-server", daemon=True)

    def __enter__(self) -> Self:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the in-process server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

    def client(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=kwargs.pop("timeout", 60), **kwargs)


def read_stream(response: httpx.Response) -> tuple[list[dict], bool, bool]:
    """(the JSON events, whether `data: [DONE]` came, whether it came last) of an SSE response."""
    events, done, done_last = [], False, False
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        if done:
            done_last = False
        if line == "data: [DONE]":
            done = done_last = True
            continue
        events.append(json.loads(line[len("data: "):]))
    return events, done, done_last


def stream_post(client: httpx.Client, path: str, body: dict) -> tuple[int, list[dict], bool]:
    """POST a streaming call: (status, events or [the error body], [DONE] came last)."""
    with client.stream("POST", path, json={**body, "stream": True}) as response:
        if response.status_code != 200:
            response.read()
            return response.status_code, [response.json()], False
        events, _, done_last = read_stream(response)
        return 200, events, done_last


def stream_text(events: list[dict]) -> str:
    return "".join(c.get("text", "") for e in events for c in e.get("choices", ()))


def wait_running(client: httpx.Client, num_requests: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while client.get("/health").json()["running"] < num_requests:
        assert time.monotonic() < deadline, "the requests never started"
        time.sleep(0.01)


def start_calls(server: ThreadServer, calls: dict[str, dict]) -> tuple[dict, list[threading.Thread]]:
    """POST each body to /v1/completions from its own thread; outcomes fill in as the calls end:
    (status, json) for a plain call, `stream_post`'s tuple for a stream."""
    outcomes: dict[str, tuple] = {}

    def call(name: str, body: dict) -> None:
        with server.client() as client:
            if body.get("stream"):
                outcomes[name] = stream_post(client, "/v1/completions", body)
            else:
                response = client.post("/v1/completions", json=body)
                outcomes[name] = (response.status_code, response.json())

    threads = [threading.Thread(target=call, args=item) for item in calls.items()]
    for thread in threads:
        thread.start()
    return outcomes, threads


# -- the QA reproductions' shared check: a bad request refused beside a greedy stream ---------------
QA_PROMPT = "The user bought running shoes, socks and a water bottle. Next item:"
QA_GREEDY = {"max_tokens": 12, "temperature": 0}


def client_of(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key or "unused", max_retries=0,
                         timeout=60)


def streamed_text(client, prompt: str = QA_PROMPT) -> str:
    return "".join(c.choices[0].text for c in client.completions.create(
        model="tiny-chat", prompt=prompt, stream=True, **QA_GREEDY) if c.choices)


def refused_alongside_a_stream(server, client, param: str, **kwargs) -> dict:
    """Send the bad request while a greedy stream runs; the stream answers as it does alone, the bad
    request is a 400 naming `param` without a source path or a traceback, and the pools are whole."""
    alone = streamed_text(client)
    got: list[str] = []
    stream = threading.Thread(target=lambda: got.append(streamed_text(client)))
    stream.start()
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny-chat", prompt=QA_PROMPT, **kwargs)
    stream.join(timeout=60)
    assert got == [alone]
    error = info.value.body
    assert error["param"] == param, error
    assert "Traceback" not in error["message"] and ".py" not in error["message"], error
    # the next request is served as before
    next_text = client.completions.create(model="tiny-chat", prompt=QA_PROMPT, **QA_GREEDY).choices[0].text
    assert next_text == alone
    assert_pools_whole(server)
    return error


def assert_pools_whole(server) -> None:
    """Once the server is idle every pool's free blocks are its total again."""
    server.wait_idle()
    pools = server.pools()
    assert pools and all(free == total for free, total in pools.values()), pools
