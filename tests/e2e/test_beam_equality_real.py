"""On the real default model: beam search through the openai client over HTTP returns exactly what
`LLM.generate` returns in-process for the same request, beams best first with their scores."""

from __future__ import annotations

import openai
import pytest
import torch

from widebeam.defaults import DEFAULT_MODEL

QUESTION = "Name three colours."
WIDTH = 4
MAX_TOKENS = 16


def test_beam_search_over_http_equals_llm_generate(real_server, smollm2, monkeypatch):
    client = openai.OpenAI(base_url=f"{real_server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    out = client.chat.completions.create(
        model=DEFAULT_MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=MAX_TOKENS, n=WIDTH,
        extra_body={"use_beam_search": True, "beam_width": WIDTH})
    assert [c.index for c in out.choices] == list(range(WIDTH))
    scores = [c.model_extra["beam_score"] for c in out.choices]
    assert scores == sorted(scores, reverse=True)

    from widebeam import LLM, BeamSearchParams

    cache, _ = smollm2
    monkeypatch.setenv("WIDEBEAM_CACHE", str(cache))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the server runs (OMP_NUM_THREADS=1): the same reduction order
    try:
        llm = LLM(DEFAULT_MODEL, device="cpu", **real_server.engine_options)
        prompt = llm.engine.apply_chat_template(QUESTION)
        (expected,) = llm.generate([prompt], BeamSearchParams(beam_width=WIDTH, max_new_tokens=MAX_TOKENS),
                                   use_tqdm=False)
    finally:
        torch.set_num_threads(threads)
    assert len(expected.outputs) == WIDTH
    assert [c.message.content for c in out.choices] == [beam.text for beam in expected.outputs]
    assert [c.finish_reason for c in out.choices] == [beam.finish_reason for beam in expected.outputs]
    assert scores == pytest.approx([beam.score for beam in expected.outputs], rel=1e-5, abs=1e-6)
    assert out.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert out.usage.completion_tokens == sum(len(beam.token_ids) for beam in expected.outputs)
