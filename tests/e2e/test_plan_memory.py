"""Issue 41 item 1: one `/v1/plan` body once made the server build a block list per block (2^50 bytes of
`memory`: 20 GB of RSS, then the kernel killed it). A plan's cost no longer grows with the memory: the
largest accepted memory is answered in well under a second with the server's RSS, sampled while it
computes, within 50 MB of where it started; past what any machine has is a 400 naming `memory`."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest
from e2e_helpers import assert_pools_whole, client_of

from widebeam.plan import MAX_PLAN_MEMORY_BYTES

MAX_RSS_GROWTH_BYTES = 50 * 2**20


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def plan_with_peak_rss(server, body: dict) -> tuple[httpx.Response, float, int]:
    """POST the plan while a thread samples the server's RSS; the answer, its seconds and the RSS growth."""
    pid = server.proc.pid
    start_rss = peak_rss = rss_bytes(pid)
    done = threading.Event()

    def sample():
        nonlocal peak_rss
        while not done.is_set():
            peak_rss = max(peak_rss, rss_bytes(pid))
            time.sleep(0.005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    began = time.perf_counter()
    try:
        response = httpx.post(f"{server.url}/v1/plan", json=body, headers=server.headers, timeout=120)
    finally:
        elapsed_s = time.perf_counter() - began
        done.set()
        sampler.join()
    return response, elapsed_s, max(peak_rss, rss_bytes(pid)) - start_rss


@pytest.mark.parametrize("tokens_per_block", [16, 1])
def test_the_largest_memory_plans_in_under_a_second_without_growing(server, tokens_per_block):
    body = {"model": "llama-3-8b", "memory": MAX_PLAN_MEMORY_BYTES, "beam_width": 64,
            "tokens_per_block": tokens_per_block}
    plan_with_peak_rss(server, body)  # the first call imports the plan's modules
    response, elapsed_s, growth_bytes = plan_with_peak_rss(server, body)
    assert response.status_code == 200, response.text
    plan = response.json()
    # 256 TiB less the weights, in blocks of `tokens_per_block` tokens at 128 KiB a token (llama-3-8b bf16)
    assert plan["capacity_blocks"] > MAX_PLAN_MEMORY_BYTES // 2**17 // tokens_per_block // 2
    assert plan["fits"] and plan["max_concurrent_requests"] > 100_000
    assert elapsed_s < 1.0, elapsed_s
    assert growth_bytes < MAX_RSS_GROWTH_BYTES, growth_bytes


@pytest.mark.parametrize("memory", [2**50, MAX_PLAN_MEMORY_BYTES + 1, "1024TiB"])
def test_memory_past_any_machine_is_a_400_naming_memory(server, memory):
    response, elapsed_s, growth_bytes = plan_with_peak_rss(server, {"model": "llama-3-8b", "memory": memory})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "memory" and f"(0, {MAX_PLAN_MEMORY_BYTES}]" in error["message"], error
    assert elapsed_s < 1.0 and growth_bytes < MAX_RSS_GROWTH_BYTES
    # the server keeps serving
    assert client_of(server).completions.create(model="tiny-chat", prompt="hi", max_tokens=2).choices
    assert_pools_whole(server)
