"""Issue 41, items 2 and 5, through the official `openai` client on loopback: constraints that leave
no token, and item filters that leave no item.

Known at admission, each is a 400 naming the field the client sent (one-token `bad_words_ids` that,
with `min_tokens` withholding the end ids, leave nothing; `stop_token_ids` covering the vocabulary
with `min_tokens`; `allowed_items: []`; `excluded_items` = every item; a `catalogue_subset` disjoint
from `allowed_items`; bans on every item's first token), sent beside a greedy stream that answers as
it does alone, with the pools whole after. Known only while decoding (the n-gram rule with
`ignore_eos` using up the few tokens the bans leave), the answer is a 200 whose choices end with finish
reason "banned", none holding a banned token, greedy, sampled, streamed and with beams."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import ServerProcess
from e2e_helpers import QA_PROMPT, assert_pools_whole, client_of, refused_alongside_a_stream

VOCAB = 49152  # the tiny chat model's (SmolLM2's tokenizer)
BEAM = {"use_beam_search": True, "beam_width": 4}
WORDS = [" red", " blue", " green"]  # the only tokens the decode-time cases leave (and the end id)


@pytest.fixture(scope="module")
def client(server):
    return client_of(server)


@pytest.fixture(scope="module")
def tokenizer(tiny_chat_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_chat_model_dir))


@pytest.fixture(scope="module")
def end_ids(tiny_chat_model_dir, tokenizer) -> set[int]:
    """The engine's end-of-sequence ids: the model config's and the tokenizer's."""
    config = json.loads((tiny_chat_model_dir / "config.json").read_text())
    eos = config["eos_token_id"]
    return {tokenizer.eos_token_id, *(eos if isinstance(eos, list) else [eos])}


@pytest.fixture(scope="module")
def word_ids(tokenizer) -> list[int]:
    ids = [tokenizer.encode(word, add_special_tokens=False) for word in WORDS]
    assert all(len(i) == 1 for i in ids), ids
    return [i[0] for i in ids]


def ban_all_but(kept: set[int]) -> list[list[int]]:
    return [[t] for t in range(VOCAB) if t not in kept]


# -- 2. everything banned, known at admission ---------------------------------------------------------
@pytest.mark.parametrize("mode", [{"temperature": 0}, {"temperature": 0.8, "seed": 1}, BEAM],
                         ids=["greedy", "sampling", "beams"])
def test_bans_leaving_only_the_end_ids_with_min_tokens_are_a_400_naming_bad_words_ids(server, client, end_ids,
                                                                                     mode):
    """The QA's request: sampling answered 500, greedy a banned token (id 0), beams `choices: []`."""
    sampling = {k: v for k, v in mode.items() if k == "temperature"}
    extra = {"bad_words_ids": ban_all_but(end_ids), "min_tokens": 4,
             **{k: v for k, v in mode.items() if k != "temperature"}}
    error = refused_alongside_a_stream(server, client, "bad_words_ids", max_tokens=8, extra_body=extra,
                                       **sampling)
    assert "bad_words_ids bans every token but the end ids" in error["message"], error
    assert "min_tokens (4) withholds" in error["message"] and "lower min_tokens to 0" in error["message"]


def test_stop_token_ids_covering_the_vocabulary_with_min_tokens_are_a_400(server, client):
    error = refused_alongside_a_stream(server, client, "stop_token_ids", max_tokens=8, temperature=0,
                                       extra_body={"stop_token_ids": list(range(VOCAB)), "min_tokens": 2})
    assert "stop_token_ids with the end-of-sequence ids cover all 49152 tokens" in error["message"], error


# -- 2. everything banned, known only while decoding: finish reason "banned" --------------------------
def run_out(word_ids: list[int], end_ids: set[int]) -> dict:
    """Bans leaving three words and the end ids; every token may come once (`no_repeat_ngram_size: 1`)
    and the end id does not end (`ignore_eos`): after at most four tokens nothing is left."""
    return {"bad_words_ids": ban_all_but(set(word_ids) | end_ids), "no_repeat_ngram_size": 1,
            "ignore_eos": True}


def assert_only_the_words(text: str) -> None:
    """The text is some of the three words, each at most once: no banned token came out."""
    rest, seen = text, []
    while rest:
        word = next((w for w in WORDS if rest.startswith(w)), None)
        assert word is not None and word not in seen, text
        seen.append(word)
        rest = rest[len(word):]


@pytest.mark.parametrize("mode", [{"temperature": 0}, {"temperature": 0.9, "seed": 7}],
                         ids=["greedy", "sampling"])
def test_running_out_of_tokens_ends_the_sample_with_banned(server, client, word_ids, end_ids, mode):
    out = client.completions.create(model="tiny-chat", prompt=QA_PROMPT, max_tokens=16,
                                    logprobs=0, extra_body=run_out(word_ids, end_ids), **mode)
    (choice,) = out.choices
    assert choice.finish_reason == "banned", choice
    assert_only_the_words(choice.text)
    # every token the sample took is an allowed one, once; then none was left before max_tokens
    tokens = choice.logprobs.tokens
    assert 1 <= len(tokens) == out.usage.completion_tokens <= len(WORDS) + len(end_ids) < 16
    assert len(set(tokens)) == len(tokens)
    assert_pools_whole(server)


def test_running_out_of_tokens_ends_a_stream_with_banned(server, client, word_ids, end_ids):
    chunks = list(client.completions.create(model="tiny-chat", prompt=QA_PROMPT, max_tokens=16, temperature=0,
                                            stream=True, extra_body=run_out(word_ids, end_ids)))
    text = "".join(c.text for chunk in chunks for c in chunk.choices)
    reasons = [c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason]
    assert reasons == ["banned"], reasons
    assert_only_the_words(text)
    alone = client.completions.create(model="tiny-chat", prompt=QA_PROMPT, max_tokens=16, temperature=0,
                                      extra_body=run_out(word_ids, end_ids)).choices[0]
    assert (alone.text, alone.finish_reason) == (text, "banned")
    assert_pools_whole(server)


def test_running_out_of_tokens_ends_every_beam_with_banned(server, client, word_ids, end_ids):
    """The QA's beams came back as `choices: []`; now each beam ends where nothing is left."""
    out = client.completions.create(model="tiny-chat", prompt=QA_PROMPT, max_tokens=16, n=2,
                                    extra_body={**BEAM, **run_out(word_ids, end_ids)})
    assert len(out.choices) == 2
    for choice in out.choices:
        assert choice.finish_reason == "banned", choice
        assert_only_the_words(choice.text)
    scores = [c.model_extra["beam_score"] for c in out.choices]
    assert scores == sorted(scores, reverse=True)
    messages = [{"role": "user", "content": QA_PROMPT}]
    chat = client.chat.completions.create(model="tiny-chat", messages=messages, max_completion_tokens=16, n=2,
                                          extra_body={**BEAM, **run_out(word_ids, end_ids)})
    assert [c.finish_reason for c in chat.choices] == ["banned", "banned"]
    assert_pools_whole(server)


# -- 5. filters that leave nothing: a registered catalogue with a named subset -------------------------
ITEM_TEXTS = ["red running shoes", "blue running socks", "a green hat", "water bottle", "yoga mat",
              "tennis balls"]
SUBSET = [0, 1, 2]


@pytest.fixture(scope="module")
def catalogue_server(tiny_chat_model_dir, tmp_path_factory):
    """The tiny chat model with catalogue "items" (ITEM_TEXTS) and its subset "first3" (SUBSET)."""
    folder = tmp_path_factory.mktemp("qa4-catalogue")
    (folder / "items.jsonl").write_text("\n".join(json.dumps(text) for text in ITEM_TEXTS) + "\n")
    np.save(folder / "first3.npy", np.array(SUBSET))
    proc = ServerProcess(["--model", str(tiny_chat_model_dir), "--served-model-name", "tiny-chat",
                          "--kv-cache-memory", "16MiB", "--max-beam-width", "16",
                          "--max-num-batched-tokens", "256",
                          "--catalogue", f"items={folder / 'items.jsonl'}",
                          "--catalogue-subset", f"items:first3={folder / 'first3.npy'}"],
                         folder / "server.log")
    yield proc.wait_ready()
    proc.stop()


@pytest.fixture(scope="module")
def catalogue_client(catalogue_server):
    return client_of(catalogue_server)


def first_tokens(tokenizer, indices) -> list[list[int]]:
    firsts = {tokenizer.encode(ITEM_TEXTS[i], add_special_tokens=False)[0] for i in indices}
    return [[t] for t in sorted(firsts)]


@pytest.mark.parametrize("case", ["allowed empty", "excluded all", "subset disjoint", "first codes banned",
                                  "subset's first codes banned"])
def test_a_filter_that_leaves_no_item_is_a_400_naming_the_field(catalogue_server, catalogue_client, tokenizer,
                                                                case):
    """The QA got 200 with `choices: []` for each."""
    everything = list(range(len(ITEM_TEXTS)))
    fields, param, says = {
        "allowed empty": ({"allowed_items": []}, "allowed_items",
                          f"allowed_items is empty: list at least one item index in [0, {len(ITEM_TEXTS)})"),
        "excluded all": ({"excluded_items": everything}, "excluded_items",
                         "excluded_items excludes every item of the catalogue: leave at least one"),
        "subset disjoint": ({"catalogue_subset": "first3", "allowed_items": [3, 4]}, "allowed_items",
                            "allowed_items and catalogue_subset 'first3' share no item"),
        "first codes banned": ({"bad_words_ids": first_tokens(tokenizer, everything)}, "bad_words_ids",
                               "bad_words_ids bans a token of every item of the catalogue"),
        "subset's first codes banned": ({"catalogue_subset": "first3",
                                         "bad_words_ids": first_tokens(tokenizer, SUBSET)}, "bad_words_ids",
                                        "bans a token of every item that catalogue_subset allow"),
    }[case]
    error = refused_alongside_a_stream(catalogue_server, catalogue_client, param, max_tokens=8, n=2,
                                       extra_body={**BEAM, "catalogue": "items", **fields})
    assert says in error["message"], error


def test_a_subset_and_allowed_items_return_items_of_both(catalogue_server, catalogue_client):
    """Overlapping filters are not refused: the items that both allow come back, and only those."""
    out = catalogue_client.completions.create(model="tiny-chat", prompt=QA_PROMPT, n=4, max_tokens=8,
                                              extra_body={**BEAM, "catalogue": "items",
                                                          "catalogue_subset": "first3",
                                                          "allowed_items": [1, 2, 3, 4]})
    assert sorted(c.text for c in out.choices) == sorted(ITEM_TEXTS[i] for i in (1, 2))
    assert all(c.finish_reason == "stop" for c in out.choices)
    assert_pools_whole(catalogue_server)
