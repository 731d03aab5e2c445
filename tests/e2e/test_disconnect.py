"""A client that goes away mid-generation aborts its request: its KV blocks come back at once and the
request is counted as aborted, not finished."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

LONG = {"prompt": "Tell me a very long story", "max_tokens": 2000, "ignore_eos": True, "temperature": 0}
LONG_BEAM = {"prompt": "Tell me a very long story", "max_tokens": 2000, "ignore_eos": True,
             "use_beam_search": True, "beam_width": 8}


def finished_total(samples: dict[str, float]) -> float:
    return sum(v for k, v in samples.items() if k.startswith("widebeam_requests_finished_total"))


def wait_for_blocks_in_use(server, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(free < total for free, total in server.pools().values()):
            return
        time.sleep(0.02)
    raise AssertionError("the request never held KV blocks")


def check_aborted(server, before: dict[str, float]) -> None:
    after = server.wait_idle(timeout_s=10)
    assert after["widebeam_requests_running"] == 0 and after["widebeam_requests_waiting"] == 0
    assert all(free == total for free, total in server.pools().values()), server.pools()
    assert after["widebeam_requests_aborted_total"] == before["widebeam_requests_aborted_total"] + 1
    assert finished_total(after) == finished_total(before), \
        "the request ran to the end instead of being aborted"


@pytest.mark.parametrize("body", [LONG, LONG_BEAM], ids=["sampled", "beam"])
def test_non_streaming_client_disconnect_frees_blocks(server, body):
    server.wait_idle()
    before = server.metrics()
    outcome = {}

    def call():
        try:
            httpx.post(f"{server.url}/v1/completions", json=body, headers=server.headers,
                       timeout=httpx.Timeout(30, read=0.6))
            outcome["error"] = None
        except httpx.ReadTimeout as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=call)
    thread.start()
    wait_for_blocks_in_use(server)
    thread.join(timeout=30)
    assert isinstance(outcome.get("error"), httpx.ReadTimeout), "the request should still have been running"
    check_aborted(server, before)


@pytest.mark.parametrize("body", [LONG, LONG_BEAM], ids=["sampled", "beam"])
def test_streaming_client_disconnect_frees_blocks(server, body):
    server.wait_idle()
    before = server.metrics()
    with httpx.Client(timeout=30, headers=server.headers) as client, \
            client.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        lines = response.iter_lines()  # kept alive: dropping it would close the connection already
        if not body.get("use_beam_search"):  # beams arrive at the end; a sampled stream shows text now
            events = [line for line in (next(lines) for _ in range(6)) if line.startswith("data: ")]
            assert len(events) == 3 and "[DONE]" not in events[-1], events
        wait_for_blocks_in_use(server)
        time.sleep(0.3)
        assert any(free < total for free, total in server.pools().values()), "still running while connected"
    # leaving the block closes the connection mid-stream
    check_aborted(server, before)
