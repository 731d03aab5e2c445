"""`widebeam serve --speculative-method ngram` and `--speculative-model`: the official client gets
the same completions (greedy and beam search) as from the plain server, `/metrics` counts the
rounds and reports the draft's pool, and every pool is whole when the server is idle."""

from __future__ import annotations

import openai
import pytest
from conftest import MAIN_ARGS, ServerProcess

PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"


@pytest.fixture(scope="module")
def servers(tiny_chat_model_dir, tmp_path_factory, server, request):
    """The plain server is the session's `server`, the n-gram one the session's `ngram_server` (its
    options plus the speculation flags), the draft-model one this module's own (the same again)."""
    draft = ServerProcess(["--model", str(tiny_chat_model_dir), *MAIN_ARGS, "--speculative-model",
                           str(tiny_chat_model_dir), "--num-speculative-tokens", "3"],
                          tmp_path_factory.mktemp("spec-draft") / "server.log")
    ngram = request.getfixturevalue("ngram_server")  # after the draft's start: their start-ups overlap
    yield {"plain": server, "ngram": ngram, "draft": draft.wait_ready()}
    draft.stop()


def complete(server, **kwargs):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key or "unused", max_retries=0,
                           timeout=60)
    out = client.completions.create(model=client.models.list().data[0].id, prompt=PROMPT, **kwargs)
    return [(c.text, c.model_extra.get("beam_score")) for c in out.choices]


@pytest.mark.parametrize("speculative", ["ngram", "draft"])
def test_speculative_server_answers_as_the_plain_one(servers, speculative):
    rounds = f'widebeam_speculative_rounds_total{{method="{speculative}"}}'
    rounds_before = servers[speculative].metrics().get(rounds, 0.0)  # the n-gram server is shared
    greedy = {"max_tokens": 16, "temperature": 0}
    beams = {"max_tokens": 10, "n": 4, "extra_body": {"use_beam_search": True, "beam_width": 4}}
    for kwargs in (greedy, beams):
        expected = complete(servers["plain"], **kwargs)
        got = complete(servers[speculative], **kwargs)
        assert [text for text, _ in got] == [text for text, _ in expected]
        for (_, want), (_, score) in zip(expected, got):
            assert score == pytest.approx(want, rel=1e-5) if want is not None else score is None
    samples = servers[speculative].wait_idle()
    assert samples[rounds] > rounds_before
    pools = servers[speculative].pools()
    assert all(free == total for free, total in pools.values())
    assert ("draft" in pools) == (speculative == "draft")
