"""The drain behind graceful shutdown, in process (a scripted engine whose steps take 10 ms, served by
`DrainingServer` from a thread; the signal handler is called directly): new calls get 503, calls that
finish within the shutdown timeout get their whole answer, the rest a 503 error object (a stream: an
error event, then `[DONE]`), every engine request is freed, and the server stops. The same through a
real `widebeam serve` process and real signals is in test_shutdown.py."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest
from e2e_helpers import ScriptedEngine, ThreadServer, start_calls, stream_text, wait_running

from widebeam.server.api import create_app
from widebeam.server.engine_loop import EngineLoop
from widebeam.server.shutdown import DrainingServer

STEP_S = 0.01
SHUTDOWN_TIMEOUT_S = 1.5
SHORT_TOKENS = 40  # 0.4 s: finishes within the drain
LONG_TOKENS = 100_000  # never finishes


def assert_shutdown_error(body: dict) -> None:
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "server_error" and error["code"] == "server_shutting_down", error
    assert "shut" in error["message"]


@pytest.mark.parametrize("second_signal", [False, True], ids=["timeout", "second-signal"])
def test_drain_finishes_what_it_can_and_fails_the_rest(second_signal):
    engine = ScriptedEngine(step_s=STEP_S)
    timeout_s = 60.0 if second_signal else SHUTDOWN_TIMEOUT_S
    app = create_app(engine, model_name="scripted")
    server = ThreadServer(app, DrainingServer, app.state.engine_loop, timeout_s)
    with server:
        outcomes, threads = start_calls(server, {
            "long": {"prompt": "a", "max_tokens": LONG_TOKENS},
            "long-stream": {"prompt": "b", "max_tokens": LONG_TOKENS, "stream": True},
            "beam": {"prompt": "c", "max_tokens": LONG_TOKENS, "use_beam_search": True, "beam_width": 2},
            "short": {"prompt": "d", "max_tokens": SHORT_TOKENS},
            "short-stream": {"prompt": "e", "max_tokens": SHORT_TOKENS, "stream": True},
        })
        with server.client() as client:
            wait_running(client, 5)
            signalled = time.monotonic()
            server.server.handle_exit(signal.SIGTERM, None)
            time.sleep(0.3)  # the server notices on its next tick (0.1 s)
            refused = client.post("/v1/completions", json={"prompt": "late", "max_tokens": 2})
            assert refused.status_code == 503, refused.text
            assert_shutdown_error(refused.json())
            health = client.get("/health")
            assert health.status_code == 503 and health.json()["status"] == "shutting_down"
        if second_signal:  # once the short calls are answered: the long ones would wait 60 s
            deadline = time.monotonic() + 10
            while not {"short", "short-stream"} <= set(outcomes) and time.monotonic() < deadline:
                time.sleep(0.01)
            server.server.handle_exit(signal.SIGINT, None)
        server.thread.join(timeout=timeout_s + 10)
        stopped = time.monotonic() - signalled
        assert not server.thread.is_alive(), "the server did not stop"
    for thread in threads:
        thread.join(timeout=10)
    assert stopped < (5.0 if second_signal else SHUTDOWN_TIMEOUT_S + 3.0), stopped

    assert outcomes["short"][0] == 200 and outcomes["short"][1]["choices"][0]["finish_reason"] == "length"
    status, events, done_last = outcomes["short-stream"]
    assert status == 200 and done_last and stream_text(events).count("t") == SHORT_TOKENS
    for name in ("long", "beam"):
        status, body = outcomes[name]
        assert status == 503, (name, body)
        assert_shutdown_error(body)
    status, events, done_last = outcomes["long-stream"]
    assert status == 200 and done_last, events
    assert stream_text(events[:-1]).startswith("t1 t2 ")  # text went out before the error event
    assert_shutdown_error(events[-1])
    assert not engine.has_unfinished() and len(engine.aborted) == 3


def test_an_idle_server_stops_at_once():
    engine = ScriptedEngine()
    app = create_app(engine, model_name="scripted")
    server = ThreadServer(app, DrainingServer, app.state.engine_loop, 30.0)
    with server:
        signalled = time.monotonic()
        server.server.handle_exit(signal.SIGTERM, None)
        server.thread.join(timeout=10)
        assert not server.thread.is_alive() and time.monotonic() - signalled < 2.0


def test_close_without_a_drain_fails_what_is_in_flight():
    """The lifespan's close() alone (no signal path): every call in flight gets a 503 and is freed."""

    async def scenario():
        engine = ScriptedEngine(step_s=STEP_S)
        loop = EngineLoop(engine)
        loop.start()
        groups = [await loop.submit([f"r{i}"], [("x", params)], stream=False)
                  for i, params in enumerate(_params(3))]
        await asyncio.sleep(0.05)
        await loop.close()
        events = [group.queue.get_nowait() for group in groups]
        with pytest.raises(Exception, match="shutting down"):
            await loop.submit(["late"], [("x", _params(1)[0])], stream=False)
        return engine, events

    engine, events = asyncio.run(scenario())
    assert [kind for _, kind, _ in events] == ["error"] * 3
    assert all(error.status_code == 503 for _, _, error in events)
    assert not engine.has_unfinished() and sorted(engine.aborted) == ["r0", "r1", "r2"]


def _params(count: int):
    from widebeam.params import SamplingParams

    return [SamplingParams(max_new_tokens=LONG_TOKENS) for _ in range(count)]
