"""Graceful shutdown of a real `widebeam serve` process: on SIGTERM or SIGINT new calls get 503, calls in
flight get up to --shutdown-timeout to finish, the rest get a well-formed error (JSON 503, or an SSE
error event then `[DONE]`), and the process exits 0 with no traceback in its log.

The SIGTERM test runs the real default model (SmolLM2-135M, tens of ms a token on this CPU), so its
long requests cannot finish within the timeout while its short one surely does."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import openai
import pytest
from conftest import ServerProcess
from e2e_helpers import read_stream, stream_text

SHUTDOWN_TIMEOUT_S = 10.0
EXIT_SLACK_S = 10.0  # beyond the timeout: the step in progress, closing connections, interpreter exit
# 256 MiB of KV is 364 blocks of 16 tokens for SmolLM2-135M: the long stream reserves 126, the beam search
# 2 x 63, the short stream 4, and the queued call (126) must wait for one of them. On the CPU the long
# calls take minutes; the short one (48 tokens) a few seconds.
REAL_ARGS = ["--device", "cpu", "--kv-cache-memory", "256MiB", "--max-beam-width", "4",
             "--max-num-batched-tokens", "256", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)]
STORY = "Tell me a long story"
LONG_STREAM = {"prompt": STORY, "max_tokens": 2000, "temperature": 0, "ignore_eos": True, "stream": True}
LONG_BEAM = {"prompt": STORY, "max_tokens": 1000, "ignore_eos": True, "use_beam_search": True,
             "beam_width": 2}
SHORT_STREAM = {"prompt": "Hi", "max_tokens": 48, "temperature": 0, "ignore_eos": True, "stream": True}
QUEUED = {"prompt": STORY, "max_tokens": 2000, "temperature": 0, "ignore_eos": True}


def health(server) -> dict:
    return httpx.get(f"{server.url}/health", timeout=10).json()


def wait_for(condition, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def assert_shutdown_error(error: dict) -> None:
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["type"] == "server_error" and error["code"] == "server_shutting_down", error


def assert_clean_log(server) -> None:
    log = server.log_path.read_text(errors="replace")
    for bad in ("Traceback", "Exception in ASGI application", "CancelledError", "timeout graceful shutdown"):
        assert bad not in log, log[-4000:]


class StreamCall(threading.Thread):
    """A streamed call on its own thread: its events, whether [DONE] came last, and when text first came."""

    def __init__(self, server, body: dict):
        super().__init__(daemon=True)
        self.server, self.body = server, body
        self.first_text = threading.Event()
        self.status, self.events, self.done_last = None, [], False

    def run(self) -> None:
        with httpx.Client(timeout=120) as client, \
                client.stream("POST", f"{self.server.url}/v1/completions", json=self.body) as response:
            self.status = response.status_code
            lines = response.iter_lines()
            for line in lines:
                if line.startswith("data: {") and '"text": "' in line and '"text": ""' not in line:
                    self.first_text.set()
                    break
            events, _, self.done_last = read_stream(_Lines(lines))
            self.events = events


class _Lines:
    """Lets read_stream go on with an iterator already started."""

    def __init__(self, lines):
        self._lines = lines

    def iter_lines(self):
        return self._lines


SIGNALS = [signal.SIGINT, signal.SIGTERM]


@pytest.fixture(scope="module")
def tiny_servers_to_signal(tiny_chat_model_dir, tmp_path_factory):
    """One tiny-model server per signal (each test ends its own), started at once: start-ups overlap."""
    folder = tmp_path_factory.mktemp("shutdown-tiny")
    procs = {sig: ServerProcess(["--model", str(tiny_chat_model_dir), "--kv-cache-memory", "16MiB",
                                 "--shutdown-timeout", "1"], folder / f"{sig.name}.log")
             for sig in SIGNALS}
    yield procs
    for proc in procs.values():
        proc.stop()


def test_sigterm_drains_in_flight_calls_then_exits_0(smollm2, server_factory, tiny_servers_to_signal):
    """(`tiny_servers_to_signal` only so that they start while this test's server does.)"""
    cache, _ = smollm2
    server = server_factory(REAL_ARGS, env={"WIDEBEAM_CACHE": str(cache)}).wait_ready()
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    outcomes: dict[str, object] = {}

    def whole(name: str, body: dict) -> None:
        extra = {k: v for k, v in body.items() if k not in ("prompt", "max_tokens")}
        try:
            outcomes[name] = client.completions.create(model="smollm2-135m-instruct", prompt=body["prompt"],
                                                       max_tokens=body["max_tokens"], extra_body=extra)
        except openai.APIStatusError as exc:
            outcomes[name] = exc

    long_stream = StreamCall(server, LONG_STREAM)
    long_stream.start()
    beam = threading.Thread(target=whole, args=("beam", LONG_BEAM), daemon=True)
    beam.start()
    wait_for(lambda: health(server)["running"] == 2, "the two long calls to run")
    short = StreamCall(server, SHORT_STREAM)
    short.start()
    assert short.first_text.wait(timeout=60), "the short stream never started"
    queued = threading.Thread(target=whole, args=("queued", QUEUED), daemon=True)  # after: the queue is FCFS
    queued.start()
    wait_for(lambda: health(server)["waiting"] == 1, "the queued call to wait")
    assert not short.done_last, "the short stream finished before the signal; make it longer"

    server.proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    time.sleep(0.5)
    late = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=30)
    assert late.status_code == 503, late.text
    assert_shutdown_error(late.json()["error"])
    draining = httpx.get(f"{server.url}/health", timeout=10)
    assert draining.status_code == 503 and draining.json()["status"] == "shutting_down"

    returncode = server.proc.wait(timeout=SHUTDOWN_TIMEOUT_S + EXIT_SLACK_S + 20)
    exit_s = time.monotonic() - signalled
    for thread in (long_stream, beam, short, queued):
        thread.join(timeout=30)
    assert returncode == 0, server.log_tail()
    assert exit_s < SHUTDOWN_TIMEOUT_S + EXIT_SLACK_S, exit_s
    assert_clean_log(server)

    # the short stream finished during the drain: its whole text, its finish reason, then [DONE]
    assert short.status == 200 and short.done_last, short.events
    assert short.events[-1]["choices"][0]["finish_reason"] == "length"
    assert not any("error" in e for e in short.events)
    # the long stream was cut at the timeout: text so far, an error event, then [DONE]
    assert long_stream.status == 200 and long_stream.done_last, long_stream.events[-3:]
    assert_shutdown_error(long_stream.events[-1]["error"])
    assert "shut down before this request finished" in long_stream.events[-1]["error"]["message"]
    assert stream_text(long_stream.events[:-1])
    # the long beam search and the queued call: JSON 503 error objects
    for name in ("beam", "queued"):
        error = outcomes[name]
        assert isinstance(error, openai.APIStatusError) and error.status_code == 503, (name, error)
        assert_shutdown_error(error.body)


@pytest.mark.parametrize("sig", SIGNALS, ids=["SIGINT", "SIGTERM"])
def test_signal_with_a_stream_in_flight_exits_0_without_traceback(tiny_servers_to_signal, sig):
    """Tiny model, a 1 s timeout: the stream ends whole or with an error event, [DONE] last either way."""
    server = tiny_servers_to_signal[sig].wait_ready()
    stream = StreamCall(server, {"prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True,
                                 "use_beam_search": False, "temperature": 0, "stream": True})
    stream.start()
    assert stream.first_text.wait(timeout=60), "the stream never started"
    server.proc.send_signal(sig)
    signalled = time.monotonic()
    returncode = server.proc.wait(timeout=30)
    stream.join(timeout=30)
    assert returncode == 0, server.log_tail()
    assert time.monotonic() - signalled < 1 + EXIT_SLACK_S
    assert_clean_log(server)
    assert stream.status == 200 and stream.done_last, stream.events[-3:]
    last = stream.events[-1]
    if "error" in last:
        assert_shutdown_error(last["error"])
    else:
        assert last["choices"][0]["finish_reason"] == "length"
