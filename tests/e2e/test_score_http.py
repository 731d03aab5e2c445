"""`POST /v1/score` in process (FastAPI's TestClient over the real engine loop) on the tiny Marian with a
SentencePiece tokenizer: text and token-id continuations, one prompt or one per continuation, values equal
to `LLM.score`'s and transformers' log-softmax of the forced sequence; errors name the field."""

from __future__ import annotations

import shutil

import pytest
import torch
from fastapi.testclient import TestClient
from tiny_models import save_tiny_marian_tokenizer
from transformers import MarianMTModel

from widebeam.llm import LLM
from widebeam.server.api import create_app


@pytest.fixture(scope="module")
def marian(tiny_marian_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-marian-tok")
    shutil.copytree(tiny_marian_dir, path, dirs_exist_ok=True)
    tokenizer = save_tiny_marian_tokenizer(path)
    llm = LLM(str(path), dtype="float32", device="cpu", kv_cache_memory="8MiB", max_beam_width=4)
    hf = MarianMTModel.from_pretrained(str(path), dtype=torch.float32).eval()
    return llm, hf, tokenizer


@pytest.fixture(scope="module")
def client(marian):
    llm, _, _ = marian
    with TestClient(create_app(llm.engine, model_name="tiny")) as test_client:
        yield test_client


def test_score_text_continuations_of_one_source(client, marian):
    _, hf, tokenizer = marian
    continuations = ["the cat", "the dog", "a cat sat", "hello world", "the cat sat"]  # 5 > max_beam_width
    response = client.post("/v1/score", json={"prompt": "the quick brown fox",
                                              "continuations": continuations})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "score" and len(body["data"]) == len(continuations)
    source = tokenizer("the quick brown fox").input_ids
    for entry, text in zip(body["data"], continuations):
        ids = tokenizer(text, add_special_tokens=False).input_ids
        assert entry["token_ids"] == ids
        with torch.no_grad():
            logits = hf(input_ids=torch.tensor([source]),
                        decoder_input_ids=torch.tensor([[hf.config.decoder_start_token_id, *ids]])).logits
        expected = torch.log_softmax(logits[0].float(), -1)[torch.arange(len(ids)), ids].tolist()
        torch.testing.assert_close(entry["token_logprobs"], expected, atol=1e-4, rtol=0)
        torch.testing.assert_close(entry["logprob"], sum(expected), atol=1e-4, rtol=0)
    assert body["usage"]["completion_tokens"] == sum(len(e["token_ids"]) for e in body["data"])


def test_score_pairs_of_token_ids_match_llm_score(client, marian):
    llm, _, _ = marian
    prompts, continuations = [[5, 6, 2], [9, 2], [5, 6, 2]], [[3, 4], [8], [3, 7, 2]]
    body = client.post("/v1/score", json={"prompt": prompts, "continuations": continuations}).json()
    expected = llm.score([{"prompt_token_ids": p} for p in prompts], continuations)
    for entry, want in zip(body["data"], expected):
        assert entry["token_ids"] == want.token_ids
        torch.testing.assert_close(entry["token_logprobs"], want.token_logprobs, atol=1e-6, rtol=0)


@pytest.mark.parametrize("payload, param", [
    ({"prompt": "hi", "continuations": [[3, 10**6]]}, "continuations"),
    ({"prompt": "hi", "continuations": [[]]}, "continuations"),
    ({"prompt": ["a", "b"], "continuations": ["x"]}, "prompt"),
    ({"prompt": "hi", "continuations": ["x"], "max_input_length": 0}, "max_input_length"),
])
def test_score_errors_name_the_field(client, payload, param):
    response = client.post("/v1/score", json=payload)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
