"""`widebeam serve --replicas 2`: the OpenAI app on Ray Serve with two engine replicas behind the exact-fit
router (server/router_ingress.py, ray_router.py), on a local Ray instance started by the server process.
The official `openai` client gets greedy, streamed and beam-search answers equal to the single-engine
server's; a request no replica can ever hold gets the engine's 400 at the door and never reaches a
replica; /metrics shows each replica and their sum; a replica killed under load fails its own requests
with an error and the rest complete."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
from conftest import SMALL_POOL_ARGS, TINY_KV_BYTES_PER_BLOCK, ServerProcess
from e2e_helpers import free_port

openai = pytest.importorskip("openai")
pytest.importorskip("ray", reason="Ray is installed by `make test` (the widebeam[ray] extra)")

PROMPT = "The quick brown fox"
# Each replica: 2,048 blocks of 16 tokens; widths up to 64 over up to 1,024 tokens, so a W=16 search of
# 900 new tokens holds ~913 blocks (two fit a replica at once) and a W=64 one of 1,000 can never fit.
REPLICA_OPTIONS = {"kv_cache_memory": 2048 * TINY_KV_BYTES_PER_BLOCK, "max_seq_len": 1024,
                   "max_beam_width": 64,
                   "max_num_batched_tokens": 256, "tokens_per_block": 16}
REPLICA_ARGS = [arg for key, value in REPLICA_OPTIONS.items()
                for arg in ("--" + key.replace("_", "-"), str(value))]


@pytest.fixture(scope="module")
def servers(tiny_chat_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("ray-serve")
    replicated = ServerProcess(["--model", str(tiny_chat_model_dir), "--replicas", "2", *REPLICA_ARGS],
                               logs / "ray.log", env={"RAY_USAGE_STATS_ENABLED": "0"})
    single = ServerProcess(["--model", str(tiny_chat_model_dir), *SMALL_POOL_ARGS], logs / "single.log")
    try:
        yield replicated.wait_ready(), single.wait_ready()
    finally:
        replicated.stop()
        single.stop()


def client(server: ServerProcess):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_two_replicas_answer_the_openai_client_as_one_engine_does(servers, tiny_chat_model_dir):
    replicated, single = servers
    model = str(tiny_chat_model_dir)
    answers = []
    for server in (replicated, single):
        c = client(server)
        greedy = [c.completions.create(model=model, prompt=PROMPT, max_tokens=8,
                                       temperature=0).choices[0].text
                  for _ in range(4)]  # several calls: both replicas answer some
        beams = c.completions.create(model=model, prompt=PROMPT, max_tokens=6, n=3,
                                     extra_body={"use_beam_search": True, "beam_width": 3})
        streamed = "".join(chunk.choices[0].text for chunk in
                           c.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                                stream=True))
        chat = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                         max_tokens=5, temperature=0)
        answers.append((greedy, [ch.text for ch in beams.choices], streamed, chat.choices[0].message.content))
        assert len(set(greedy)) == 1 and streamed == greedy[0]
    assert answers[0] == answers[1]


def test_the_replicas_port_is_the_one_asked_for_and_models_are_listed(servers, tiny_chat_model_dir):
    replicated, _ = servers
    assert [m.id for m in client(replicated).models.list().data] == [str(tiny_chat_model_dir)]
    assert free_port() != replicated.port


def test_a_request_no_replica_can_hold_is_refused_at_the_door_with_the_engines_words(servers,
                                                                                      tiny_chat_model_dir):
    from widebeam.engine import LLMEngine
    from widebeam.errors import RequestTooLargeError
    from widebeam.params import BeamSearchParams

    replicated, _ = servers
    body = {"model": str(tiny_chat_model_dir), "prompt": PROMPT, "max_tokens": 1000, "n": 64,
            "use_beam_search": True, "beam_width": 64}
    answer = httpx.post(f"{replicated.url}/v1/completions", json=body, timeout=60)
    engine = LLMEngine(str(tiny_chat_model_dir), **REPLICA_OPTIONS)
    with pytest.raises(RequestTooLargeError) as refused:
        engine.add_request("r", PROMPT, BeamSearchParams(beam_width=64, max_new_tokens=1000))
    assert answer.status_code == 400
    assert answer.json()["error"]["message"] == str(refused.value)
    assert answer.json()["error"]["code"] == "kv_cache_capacity_exceeded"
    deadline = time.monotonic() + 20  # each replica's text comes with its report (Serve polls them)
    while True:
        samples = replicated.metrics()
        replica_labels = {key.split('replica="')[1].split('"')[0] for key in samples if 'replica="' in key}
        if len(replica_labels - {"all"}) == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert len(replica_labels - {"all"}) == 2  # each replica's samples, and their sum
    assert samples['widebeam_requests_rejected_total{replica="all"}'] == 0  # no replica saw it
    assert samples["widebeam_router_refused_never_fit_total"] == 1


def _long_search(url: str, model: str, outcomes: list) -> None:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 900, "n": 16, "use_beam_search": True,
            "beam_width": 16, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
            if response.status_code != 200:
                outcomes.append(("status", response.status_code, response.read().decode()))
                return
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        payloads = [json.loads(e) for e in events if e != "[DONE]"]
        errors = [p["error"] for p in payloads if "error" in p]
        finished = [c["finish_reason"] for p in payloads if "choices" in p for c in p["choices"]
                    if c.get("finish_reason")]
        outcomes.append(("error", errors[0]["code"]) if errors else ("done", len(finished), events[-1]))
    except httpx.HTTPError as exc:  # a cut connection would be a request lost silently: the test fails
        outcomes.append(("cut", repr(exc)))


def _replica_pids() -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if b"ServeReplica:widebeam:widebeam-engine" in cmdline:
                pids.append(int(entry.name))
    return pids


def test_a_killed_replica_fails_its_own_requests_and_the_rest_complete(servers, tiny_chat_model_dir):
    replicated, _ = servers
    model = str(tiny_chat_model_dir)
    pids = _replica_pids()
    assert len(pids) == 2, pids
    outcomes: list = []
    threads = [threading.Thread(target=_long_search, args=(replicated.url, model, outcomes))
               for _ in range(4)]
    for thread in threads:
        thread.start()
    time.sleep(1.5)  # two searches placed on each replica, running
    os.kill(pids[0], signal.SIGKILL)
    for thread in threads:
        thread.join(timeout=180)
    kinds = sorted(outcome[0] for outcome in outcomes)
    assert len(outcomes) == 4 and "cut" not in kinds, outcomes
    assert "done" in kinds and ("error" in kinds or "status" in kinds), outcomes
    for outcome in outcomes:
        if outcome[0] == "done":
            assert outcome[1:] == (16, "[DONE]")  # every beam finished
        elif outcome[0] == "error":
            assert outcome[1] == "replica_failed"
        else:
            assert outcome[1] == 503 and "replica_failed" in outcome[2]
    # the router dropped the dead replica's placements; new requests are served
    c = client(replicated)
    assert c.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0).choices[0].text
    deadline = time.monotonic() + 30
    while replicated.metrics()["widebeam_router_placed_requests"] != 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert replicated.metrics()["widebeam_router_placed_requests"] == 0
