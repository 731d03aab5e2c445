"""Translation over HTTP with the official `openai` client: `widebeam serve` on a tiny NLLB-shaped model
(M2M100 + NLLB's tokenizer), a text source, beam search, and the target language as `decoder_prefix`
(or as `forced_bos_token_id`), held to transformers' `generate` on the same weights."""

from __future__ import annotations

import openai
import pytest
import torch

SOURCES = ["hello world", "beam search at any width"]
WIDTH, N, MAX_TOKENS = 4, 3, 8


@pytest.fixture(scope="module")
def nllb(tiny_nllb):
    return tiny_nllb


@pytest.fixture(scope="module")
def server(nllb_server):
    """The session's tiny NLLB server (e2e/conftest.py: --kv-cache-memory 8MiB --max-beam-width 8)."""
    return nllb_server


def hf_beams(hf, tokenizer, source: str, **extra) -> list[tuple[str, float]]:
    ids = tokenizer(source, return_tensors="pt").input_ids
    with torch.no_grad():
        out = hf.generate(ids, num_beams=WIDTH, num_return_sequences=N, max_new_tokens=MAX_TOKENS,
                          do_sample=False, length_penalty=1.0, early_stopping=False,
                          output_scores=True, return_dict_in_generate=True, **extra)
    start = 1 + (extra["decoder_input_ids"].shape[1] - 1 if "decoder_input_ids" in extra else 0)
    texts = tokenizer.batch_decode(out.sequences[:, start:], skip_special_tokens=True)
    return [(text, round(float(score), 4)) for text, score in zip(texts, out.sequences_scores)]


@pytest.mark.parametrize("how", ["decoder_prefix", "forced_bos_token_id"])
def test_beam_translation_with_a_target_language(nllb, server, how):
    _, hf, tokenizer = nllb
    target = tokenizer.convert_tokens_to_ids("fra_Latn")
    start = hf.generation_config.decoder_start_token_id
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    for source in SOURCES:
        if how == "decoder_prefix":
            extra_body = {"decoder_prefix": "fra_Latn"}  # text: one special token
            expected = hf_beams(hf, tokenizer, source, decoder_input_ids=torch.tensor([[start, target]]))
        else:
            extra_body = {"forced_bos_token_id": target}
            expected = hf_beams(hf, tokenizer, source, forced_bos_token_id=target)
        out = client.completions.create(model="tiny-nllb", prompt=source, max_tokens=MAX_TOKENS, n=N,
                                        extra_body={"use_beam_search": True, "beam_width": WIDTH,
                                                    **extra_body})
        got = [(c.text, round(c.model_extra["beam_score"], 4)) for c in out.choices]
        assert [text for text, _ in got] == [text for text, _ in expected], source
        for (_, score), (_, hf_score) in zip(got, expected):
            assert score == pytest.approx(hf_score, abs=1e-3)
    pools = server.wait_idle()
    assert pools["widebeam_requests_running"] == 0
    assert all(free == total for free, total in server.pools().values())


def test_an_out_of_vocabulary_target_is_a_400_naming_the_field(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.completions.create(model="tiny-nllb", prompt="hello world", max_tokens=4,
                                  extra_body={"use_beam_search": True, "decoder_prefix": [10**6]})
    assert excinfo.value.body["param"] == "decoder_prefix"
