"""`widebeam serve --speculative-method ngram` and `--speculative-model`: the official client gets
the same completions (greedy and beam search) as from the plain server, `/metrics` counts the
rounds and reports the draft's pool, and every pool is whole when the server is idle."""

from __future__ import annotations

import openai
import pytest
from conftest import ServerProcess

ARGS = ["--kv-cache-memory", "16MiB", "--max-beam-width", "8", "--max-num-batched-tokens", "256"]
PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"


@pytest.fixture(scope="module")
def servers(tiny_chat_model_dir, tmp_path_factory):
    model = ["--model", str(tiny_chat_model_dir)]
    procs = {
        "plain": ServerProcess([*model, *ARGS], tmp_path_factory.mktemp("spec-plain") / "server.log"),
        "ngram": ServerProcess([*model, *ARGS, "--speculative-method", "ngram", "--num-speculative-tokens",
                                "4"],
                               tmp_path_factory.mktemp("spec-ngram") / "server.log"),
        "draft": ServerProcess([*model, *ARGS, "--speculative-model", str(tiny_chat_model_dir),
                                "--num-speculative-tokens", "3"],
                               tmp_path_factory.mktemp("spec-draft") / "server.log"),
    }
    yield {name: proc.wait_ready() for name, proc in procs.items()}
    for proc in procs.values():
        proc.stop()


def complete(server, **kwargs):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    out = client.completions.create(model=client.models.list().data[0].id, prompt=PROMPT, **kwargs)
    return [(c.text, c.model_extra.get("beam_score")) for c in out.choices]


@pytest.mark.parametrize("speculative", ["ngram", "draft"])
def test_speculative_server_answers_as_the_plain_one(servers, speculative):
    greedy = {"max_tokens": 16, "temperature": 0}
    beams = {"max_tokens": 10, "n": 4, "extra_body": {"use_beam_search": True, "beam_width": 4}}
    for kwargs in (greedy, beams):
        expected = complete(servers["plain"], **kwargs)
        got = complete(servers[speculative], **kwargs)
        assert [text for text, _ in got] == [text for text, _ in expected]
        for (_, want), (_, score) in zip(expected, got):
            assert score == pytest.approx(want, rel=1e-5) if want is not None else score is None
    samples = servers[speculative].wait_idle()
    assert samples[f'widebeam_speculative_rounds_total{{method="{speculative}"}}'] > 0
    pools = servers[speculative].pools()
    assert all(free == total for free, total in pools.values())
    assert ("draft" in pools) == (speculative == "draft")
