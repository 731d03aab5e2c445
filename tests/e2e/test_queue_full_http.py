"""Overload over HTTP (issue #45): a server whose waiting queue holds 2 requests gets a burst of 16 beam
searches on a small pool (a few run at once). The queue never passes its bound; the rest are answered
429 at once with `Retry-After` and a body naming `max_waiting_requests`; no 5xx; every completed
request's text equals the same request alone; afterwards every block is free, and /metrics and
/v1/stats count the refusals. A call whose `n` alone passes the bound is a 400, not a 429."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
from conftest import SMALL_POOL_ARGS

PROMPTS = [f"Item {i}: the weather in city number {i} is" for i in range(16)]


def body(model: str, prompt: str) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": 24, "ignore_eos": True, "use_beam_search": True,
            "beam_width": 8, "n": 1}


def test_overload_is_answered_429_with_retry_after_and_nothing_is_lost(server_factory, small_server,
                                                                       tiny_chat_model_dir):
    model = str(tiny_chat_model_dir)
    server = server_factory(["--model", model, *SMALL_POOL_ARGS, "--max-waiting-requests", "2"]).wait_ready()

    def ask(prompt):
        return httpx.post(f"{server.url}/v1/completions", json=body(model, prompt), timeout=300)

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        responses = dict(zip(PROMPTS, pool.map(ask, PROMPTS)))
    statuses = [r.status_code for r in responses.values()]
    assert set(statuses) <= {200, 429}, statuses  # no 5xx, nothing else
    refused = [r for r in responses.values() if r.status_code == 429]
    assert refused and statuses.count(200) >= 3  # overload refused, the rest served
    for response in refused:
        assert int(response.headers["Retry-After"]) >= 1
        error = response.json()["error"]
        assert error["code"] == "queue_full" and error["param"] == "max_waiting_requests"
        assert "max_waiting_requests=2" in error["message"]
    # n sampled choices are n requests in the queue: past its bound such a call could never be queued, so
    # it is invalid (400 naming n), not a 429 to retry, and holds nothing
    many = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        "model": model, "prompt": PROMPTS[0], "max_tokens": 4, "n": 3, "temperature": 1.0})
    assert many.status_code == 400, many.text
    assert many.json()["error"]["param"] == "n" and "max_waiting_requests" in many.json()["error"]["message"]
    two = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        "model": model, "prompt": PROMPTS[0], "max_tokens": 4, "n": 2, "temperature": 1.0})
    assert two.status_code == 200 and len(two.json()["choices"]) == 2
    metrics = server.wait_idle()
    assert metrics["widebeam_requests_queue_full_total"] == len(refused)
    assert all(free == total for free, total in server.pools().values())
    stats = httpx.get(f"{server.url}/v1/stats", timeout=30).json()
    assert stats["queue"]["refused"] == len(refused) and stats["queue"]["max_waiting_requests"] == 2
    # each completed request answered as it is alone (the reference server: the same pool, no bound)
    for prompt, response in responses.items():
        if response.status_code == 200:
            alone = httpx.post(f"{small_server.url}/v1/completions", json=body(model, prompt), timeout=300)
            assert response.json()["choices"][0]["text"] == alone.json()["choices"][0]["text"]
