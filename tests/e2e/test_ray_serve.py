"""`widebeam serve --replicas 2`: the OpenAI app on Ray Serve with two engine replicas, on a local
Ray instance started by the server process; the official `openai` client gets greedy, streamed and
beam-search answers equal to the single-engine server's."""

from __future__ import annotations

import pytest
from conftest import SMALL_POOL_ARGS, ServerProcess
from e2e_helpers import free_port

openai = pytest.importorskip("openai")
pytest.importorskip("ray", reason="Ray is installed by `make test` (the widebeam[ray] extra)")

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def servers(tiny_chat_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("ray-serve")
    replicated = ServerProcess(["--model", str(tiny_chat_model_dir), "--replicas", "2", *SMALL_POOL_ARGS],
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
