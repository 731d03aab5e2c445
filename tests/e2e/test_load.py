"""32 concurrent clients against a small KV pool (32 blocks of 16 tokens): greedy, seeded sampling (some
streamed), beam search at widths 2 to 16, and requests that can never fit. Every valid request gets the
answer it gets alone, every infeasible one its 400 at once, and afterwards every block is free."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

NUM_CLIENTS = 32
REQUESTS_PER_CLIENT = 4
PROMPTS = ["The weather today", "In a galaxy far away", "Lists of numbers: 1, 2,"]


def specs() -> list[tuple[str, dict]]:
    out = []
    for prompt in PROMPTS:
        out.append(("greedy", {"prompt": prompt, "max_tokens": 12, "temperature": 0}))
        out.append(("sampled",
                    {"prompt": prompt, "max_tokens": 12, "temperature": 0.9, "top_p": 0.95, "seed": 7}))
        out.append(("stream",
                    {"prompt": prompt, "max_tokens": 12, "temperature": 0.8, "top_k": 50, "seed": 11,
                     "stream": True}))
        for width in (2, 4, 8, 16):
            out.append(("beam",
                        {"prompt": prompt, "max_tokens": 8, "use_beam_search": True, "beam_width": width,
                         "n": min(width, 3)}))
        # 16 beams x ceil((P + 40) / 16) = 48 blocks, 12 x 4 = 48: more than the 32 the pool has
        out.append(("infeasible",
                    {"prompt": prompt, "max_tokens": 40, "use_beam_search": True, "beam_width": 16}))
        out.append(("infeasible",
                    {"prompt": prompt, "max_tokens": 50, "use_beam_search": True, "beam_width": 12}))
    return out


def send(client: httpx.Client, body: dict) -> tuple[int, dict, float]:
    start = time.monotonic()
    if not body.get("stream"):
        response = client.post("/v1/completions", json=body)
        return response.status_code, response.json(), time.monotonic() - start
    text, finish, done = "", None, False
    with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            response.read()
            return response.status_code, response.json(), time.monotonic() - start
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            chunk = json.loads(line[len("data: "):])
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                text += choice["text"]
                finish = choice["finish_reason"] or finish
    assert done, "the stream ended without data: [DONE]"
    return 200, {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}, time.monotonic() - start


def answer(result: dict) -> list[tuple]:
    return [(c["index"], c["text"], c["finish_reason"], c.get("beam_score")) for c in result["choices"]]


def assert_same_answer(got: dict, expected: dict, kind: str) -> None:
    got_answer, expected_answer = answer(got), answer(expected)
    assert [a[:3] for a in got_answer] == [a[:3] for a in expected_answer], kind
    if kind == "beam":
        for (*_, score), (*_, expected_score) in zip(got_answer, expected_answer):
            assert score == pytest.approx(expected_score, abs=1e-4)


def test_concurrent_mixed_load_on_a_small_pool(small_server):
    server = small_server
    server.wait_idle()
    before = server.metrics()
    all_specs = specs()
    # What each request gets alone, one at a time.
    reference = {}
    with server.client() as client:
        for i, (kind, body) in enumerate(all_specs):
            if kind != "infeasible":
                status, result, _ = send(client, {**body, "stream": False})
                assert status == 200, result
                reference[i] = result
                if kind == "beam":
                    assert len(result["choices"]) == body["n"]
                    scores = [c["beam_score"] for c in result["choices"]]
                    assert scores == sorted(scores, reverse=True)

    barrier = threading.Barrier(NUM_CLIENTS)

    def client_run(c: int) -> list:
        results = []
        with server.client(timeout=120) as client:
            barrier.wait()
            for j in range(REQUESTS_PER_CLIENT):
                index = (c * REQUESTS_PER_CLIENT + j * 7) % len(all_specs)
                kind, body = all_specs[index]
                results.append((index, kind, *send(client, body)))
        return results

    started = time.monotonic()
    with ThreadPoolExecutor(NUM_CLIENTS) as pool:
        outcomes = [r for rs in pool.map(client_run, range(NUM_CLIENTS)) for r in rs]
    wall = time.monotonic() - started
    assert len(outcomes) == NUM_CLIENTS * REQUESTS_PER_CLIENT
    kinds = {kind for _, kind, *_ in outcomes}
    assert kinds == {"greedy", "sampled", "stream", "beam", "infeasible"}

    infeasible_latencies = []
    for index, kind, status, result, latency in outcomes:
        if kind == "infeasible":
            assert status == 400, result
            assert result["error"]["code"] == "kv_cache_capacity_exceeded"
            assert "never fit" in result["error"]["message"]
            infeasible_latencies.append(latency)
        else:
            assert status == 200, result
            assert_same_answer(result, reference[index], kind)
    # Identical greedy requests got identical answers (each also equals the lone reference above).
    greedy: dict[int, list[str]] = {}
    for index, kind, _, result, _ in outcomes:
        if kind == "greedy":
            greedy.setdefault(index, []).append(result["choices"][0]["text"])
    assert any(len(texts) > 1 for texts in greedy.values())
    assert all(len(set(texts)) == 1 for texts in greedy.values()), greedy
    # Infeasible requests are answered at admission, not after the queue drains.
    assert max(infeasible_latencies) < 3.0, (infeasible_latencies, wall)

    after = server.wait_idle(timeout_s=15)
    pools = server.pools()
    assert pools and all(free == total for free, total in pools.values()), pools
    assert after["widebeam_requests_running"] == 0 and after["widebeam_requests_waiting"] == 0
    assert (after["widebeam_requests_rejected_total"] - before["widebeam_requests_rejected_total"]
            == len(infeasible_latencies))
    assert (after["widebeam_time_to_first_token_seconds_count"]
            > before["widebeam_time_to_first_token_seconds_count"])

