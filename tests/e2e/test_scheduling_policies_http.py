"""The capacity policy over HTTP (issue #21): a server started with `--scheduling-policy
max_utilization --max-preemptions 2` on the small pool (32 blocks of 16 tokens) runs concurrent beam
searches together, preempts when the pool runs short, answers each request as the guaranteed_no_evict
server of the same sizing does, and counts its preemptions and recomputed tokens in /metrics,
labelled by the policy; afterwards every block is free."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
from conftest import SMALL_POOL_ARGS

PROMPTS = ["The weather today", "In a galaxy far away", "Lists of numbers: 1, 2,", "Once upon a time",
           "The quick brown fox", "My favourite colour", "Dear diary,", "Breaking news:"]


def ask_all(server, model) -> list[list[str]]:
    def ask(prompt):
        body = {"model": model, "prompt": prompt, "max_tokens": 40, "ignore_eos": True,
                "use_beam_search": True, "beam_width": 4, "n": 2}
        response = httpx.post(f"{server.url}/v1/completions", json=body, headers=server.headers, timeout=300)
        assert response.status_code == 200, response.text
        return [choice["text"] for choice in response.json()["choices"]]

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(ask, PROMPTS))


def test_max_utilization_preempts_answers_the_same_and_counts_it(small_server, server_factory,
                                                                 tiny_chat_model_dir):
    server = server_factory(["--model", str(tiny_chat_model_dir), *SMALL_POOL_ARGS,
                             "--scheduling-policy", "max_utilization", "--max-preemptions", "2"]).wait_ready()
    got = ask_all(server, str(tiny_chat_model_dir))
    metrics = server.wait_idle()
    assert metrics['widebeam_scheduling_policy{policy="max_utilization"}'] == 1
    assert metrics['widebeam_scheduling_preemptions_total{policy="max_utilization"}'] > 0
    assert metrics['widebeam_scheduling_recomputed_tokens_total{policy="max_utilization"}'] > 0
    assert all(free == total for free, total in server.pools().values())
    assert got == ask_all(small_server, str(tiny_chat_model_dir))
    reference = small_server.wait_idle()
    assert reference['widebeam_scheduling_policy{policy="guaranteed_no_evict"}'] == 1
    assert reference['widebeam_scheduling_preemptions_total{policy="guaranteed_no_evict"}'] == 0
