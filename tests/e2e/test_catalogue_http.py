"""Generative retrieval over HTTP: `widebeam serve --catalogue NAME=PATH` and the request fields
`catalogue` / `allowed_sequences` (with `use_beam_search`), through the official `openai` client.
Every choice is one catalogue item (its text), each with its `beam_score`; bad input is a 400 naming
the field; the pools are whole again when the server is idle."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import openai
import pytest
from conftest import SERVE_COMMAND, ServerProcess

ARGS = ["--kv-cache-memory", "16MiB", "--max-beam-width", "16", "--max-num-batched-tokens", "256"]
PROMPT = "The user bought running shoes, socks and a water bottle. Next item:"
TEXTS = ["red running shoes", "blue running shoes", "blue running socks", "a green hat", "a green scarf",
         "water bottle", "yellow umbrella", "tennis racket", "tennis balls", "yoga mat"]


@pytest.fixture(scope="module")
def tokenizer(tiny_chat_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_chat_model_dir))


@pytest.fixture(scope="module")
def catalogue(tmp_path_factory, tokenizer):
    """The items as token ids: TEXTS (written as JSONL strings, encoded by the server) and two
    token-id items, one a prefix of another (written as lists)."""
    path = tmp_path_factory.mktemp("catalogue") / "items.jsonl"
    extra = [[1012, 2047, 3001], [1012, 2047]]
    lines = [json.dumps(text) for text in TEXTS] + [json.dumps({"tokens": ids, "sku": i})
                                                    for i, ids in enumerate(extra)]
    path.write_text("\n".join(lines) + "\n")
    items = [tokenizer.encode(text, add_special_tokens=False) for text in TEXTS] + extra
    return path, items


@pytest.fixture(scope="module")
def server(tiny_chat_model_dir, catalogue, tmp_path_factory):
    path, _ = catalogue
    ids = tmp_path_factory.mktemp("catalogue-npy") / "ids.npy"
    np.save(ids, np.array([[1005, 1006, 1007], [1005, 1006, -1], [1009, 1010, 1011]]))
    proc = ServerProcess(["--model", str(tiny_chat_model_dir), *ARGS, "--catalogue", f"items={path}",
                          "--catalogue", f"ids={ids}"],
                         tmp_path_factory.mktemp("catalogue-server") / "server.log")
    yield proc.wait_ready()
    proc.stop()


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def complete(server, **kwargs):
    c = client(server)
    return c.completions.create(model=c.models.list().data[0].id, prompt=PROMPT, **kwargs)


def item_texts(tokenizer, items) -> set[str]:
    return {tokenizer.decode(ids, skip_special_tokens=True) for ids in items}


def assert_ranked_items(choices, allowed: set[str], n: int):
    assert len(choices) == n
    texts = [c.text if hasattr(c, "text") else c.message.content for c in choices]
    assert set(texts) <= allowed and len(set(texts)) == n, texts
    scores = [c.model_extra["beam_score"] for c in choices]
    assert scores == sorted(scores, reverse=True)
    assert all(c.finish_reason == "stop" for c in choices)


def test_completions_return_catalogue_items(server, catalogue, tokenizer):
    _, items = catalogue
    out = complete(server, n=8, extra_body={"use_beam_search": True, "beam_width": 8, "catalogue": "items"})
    assert_ranked_items(out.choices, item_texts(tokenizer, items), 8)
    # the default max_tokens (16) gives way to the catalogue's: the longest item and its EOS
    assert out.usage.completion_tokens <= 8 * (max(len(i) for i in items) + 1)


def test_chat_completions_return_catalogue_items(server, catalogue, tokenizer):
    _, items = catalogue
    c = client(server)
    out = c.chat.completions.create(model=c.models.list().data[0].id, n=4,
                                    messages=[{"role": "user", "content": PROMPT}],
                                    extra_body={"use_beam_search": True, "beam_width": 8,
                                                "catalogue": "items"})
    assert_ranked_items(out.choices, item_texts(tokenizer, items), 4)


def test_a_second_catalogue_from_npy(server, tokenizer):
    out = complete(server, n=3, extra_body={"use_beam_search": True, "beam_width": 8, "catalogue": "ids"})
    assert_ranked_items(out.choices,
                        item_texts(tokenizer, [[1005, 1006, 1007], [1005, 1006], [1009, 1010, 1011]]), 3)


def test_inline_allowed_sequences_and_an_exhausted_catalogue(server, tokenizer):
    items = [[tokenizer.encode(" apple", add_special_tokens=False)[0]], [1012, 2047], [1012, 2048, 77]]
    # n = 8 asked, 3 items exist: 3 come back, never an invalid one
    out = complete(server, n=8,
                   extra_body={"use_beam_search": True, "beam_width": 8, "allowed_sequences": items})
    assert_ranked_items(out.choices, item_texts(tokenizer, items), 3)


def test_streamed_beams_are_catalogue_items(server, catalogue, tokenizer):
    _, items = catalogue
    chunks = list(complete(server, n=4, stream=True,
                           extra_body={"use_beam_search": True, "beam_width": 8, "catalogue": "items"}))
    texts = [c.text for chunk in chunks for c in chunk.choices if c.finish_reason]
    assert len(texts) == 4 and set(texts) <= item_texts(tokenizer, items)


def bad_request(server, **kwargs) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as exc:
        complete(server, **kwargs)
    return exc.value


BEAM = {"use_beam_search": True, "beam_width": 8}


@pytest.mark.parametrize("body, param, fragments", [
    ({**BEAM, "catalogue": "nope"}, "catalogue", ["'nope' is not registered", "registered: ids, items"]),
    ({**BEAM, "allowed_sequences": [[1, 2], [60000]]}, "allowed_sequences",
     ["allowed_sequences is malformed", "item 1 holds a token id outside the vocabulary [0, 49152)"]),
    ({**BEAM, "allowed_sequences": [[1, 2], []]}, "allowed_sequences", ["item 1 is empty"]),
    ({**BEAM, "allowed_sequences": []}, "allowed_sequences", ["the catalogue is empty"]),
    ({**BEAM, "allowed_sequences": [[1, -2]]}, "allowed_sequences", ["allowed_sequences[0] holds -2"]),
    ({**BEAM, "allowed_sequences": [[1, "a"]]}, "allowed_sequences", ["allowed_sequences.0.1"]),
    ({**BEAM, "allowed_sequences": [[1]] * 10_001}, "allowed_sequences", ["10001 items", "at most 10000"]),
    ({**BEAM, "allowed_sequences": [[1], [2] * 65]}, "allowed_sequences",
     ["allowed_sequences[1] has 65 tokens", "at most 64"]),
    ({**BEAM, "catalogue": "items", "allowed_sequences": [[1]]}, "allowed_sequences", ["exclude each other"]),
    ({"allowed_sequences": [[1, 2]]}, "allowed_sequences", ["add use_beam_search: true"]),
    ({"catalogue": "items"}, "catalogue", ["add use_beam_search: true"]),
    ({**BEAM, "catalogue": "items", "ignore_eos": True}, "ignore_eos", ["must be false with a catalogue"]),
    # the shortest item of "ids" has 2 tokens: 3 with its EOS (once a 200 with "choices": [])
    ({**BEAM, "catalogue": "ids", "max_tokens": 2}, "max_tokens",
     ["max_tokens must be >= 3 with this catalogue", "got 2"]),
    ({**BEAM, "catalogue": "ids", "min_tokens": 4}, "min_tokens",
     ["min_tokens must be <= 3 with this catalogue"]),
    # a stop could end a beam inside an item (once "yoga", "running shoes,")
    ({**BEAM, "catalogue": "items", "stop": [","]}, "stop", ["stop and catalogue exclude each other"]),
    ({**BEAM, "catalogue": "items", "stop_token_ids": [2]}, "stop_token_ids",
     ["stop_token_ids and catalogue exclude each other"]),
])
def test_bad_catalogue_requests_are_400_naming_the_field(server, body, param, fragments):
    error = bad_request(server, extra_body=body)
    detail = error.body
    assert detail["param"] == param, detail
    for fragment in fragments:
        assert fragment in detail["message"], detail


def test_pools_are_whole_after_catalogue_requests(server):
    complete(server, n=2, extra_body={**BEAM, "catalogue": "items"})
    server.wait_idle()
    pools = server.pools()
    assert pools and all(free == total for free, total in pools.values())


def test_a_malformed_catalogue_file_stops_the_server_naming_the_line(tiny_chat_model_dir, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text("[1, 2]\n[3, 4.5]\n")
    proc = subprocess.run([*SERVE_COMMAND, "--model", str(tiny_chat_model_dir), *ARGS, "--port", "0",
                           "--catalogue", f"bad={path}"], check=False, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "error: argument --catalogue: " in proc.stderr and "line 2: token 1 is 4.5" in proc.stderr
