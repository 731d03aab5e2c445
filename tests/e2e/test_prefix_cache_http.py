"""Prefix reuse over HTTP with the official `openai` client: `usage.prompt_tokens_details.cached_tokens`
on a repeated prompt (completions and chat, whole and streamed, sampled and beam search), the /metrics
hit counters (equal to what the responses reported) and block gauges, a server started with
`--no-prefix-caching`, and one with two `--pin-prefix` files (token ids, text) whose first requests
already hit."""

from __future__ import annotations

import json

import pytest
from conftest import ServerProcess

openai = pytest.importorskip("openai")

SYSTEM = ("You are a careful assistant that answers questions about colours, shapes and numbers. "
          "Keep every answer short and polite. ") * 3
TEXT_PIN = ("Examples. Q: What colour is the sky on a clear day? A: Blue. Q: How many sides has a square? "
            "A: Four. Q: What is two plus two? A: Four. ") * 2
OPTIONS = ["--kv-cache-memory", "4MiB", "--tokens-per-block", "16", "--max-seq-len", "1024"]


@pytest.fixture(scope="module")
def tokenizer(tiny_chat_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_chat_model_dir))


def pinned_ids(tokenizer) -> list[int]:
    """SYSTEM's ids with its first block repeated at position 1 (a pin whose blocks recur)."""
    system_ids = tokenizer.encode(SYSTEM)
    return system_ids[:16] * 2 + system_ids


@pytest.fixture(scope="module")
def servers(tiny_chat_model_dir, tokenizer, tmp_path_factory):
    """Every server of this module, started at once so their start-ups overlap; each test waits for its
    own. Five processes, not six: the two tests of a server without prefix caching share one (it never
    caches, whatever ran on it before); each other test has a fresh server of its own, its counters
    at zero."""
    folder = tmp_path_factory.mktemp("prefix-servers")
    (folder / "system.json").write_text(json.dumps(tokenizer.encode(SYSTEM)))
    (folder / "examples.txt").write_text(TEXT_PIN, encoding="utf-8")
    (folder / "repeated.json").write_text(json.dumps(pinned_ids(tokenizer)))
    args = {
        "cached": [],
        "chat": [],
        "uncached": ["--no-prefix-caching"],
        "pinned": ["--pin-prefix", str(folder / "system.json"), "--pin-prefix", str(folder / "examples.txt")],
        "hits": ["--pin-prefix", str(folder / "repeated.json")],
    }
    model = ["--model", str(tiny_chat_model_dir)]
    procs = {name: ServerProcess([*model, *OPTIONS, *extra], folder / f"{name}.log")
             for name, extra in args.items()}
    yield procs
    for proc in procs.values():
        proc.stop()


def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_a_repeated_prompt_reports_cached_tokens_and_the_metrics_count_them(tiny_chat_model_dir, servers):
    server = servers["cached"].wait_ready()
    c, model = client(server), str(tiny_chat_model_dir)
    first = c.completions.create(model=model, prompt=SYSTEM + "Name a colour.", max_tokens=6,
                                 temperature=0)
    second = c.completions.create(model=model, prompt=SYSTEM + "Name a shape.", max_tokens=6,
                                  temperature=0)
    again = c.completions.create(model=model, prompt=SYSTEM + "Name a colour.", max_tokens=6,
                                 temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % 16 == 0 and cached < second.usage.prompt_tokens
    # the same prompt again: every whole block but the one holding its last token, same text
    assert again.usage.prompt_tokens_details.cached_tokens == (again.usage.prompt_tokens - 1) // 16 * 16
    assert again.choices[0].text == first.choices[0].text  # reuse changes nothing but the work
    beams = c.completions.create(model=model, prompt=SYSTEM + "Name a number.", max_tokens=5, n=3,
                                 extra_body={"use_beam_search": True, "beam_width": 3})
    assert beams.usage.prompt_tokens_details.cached_tokens >= cached and len(beams.choices) == 3
    responses = [first, second, again, beams]
    metrics = server.wait_idle()
    # the counters are the responses' own figures, summed (one engine request each)
    assert metrics["widebeam_prefix_cache_hit_tokens_total"] == sum(
        r.usage.prompt_tokens_details.cached_tokens for r in responses)
    assert metrics["widebeam_prefix_cache_queried_tokens_total"] == sum(
        r.usage.prompt_tokens for r in responses)
    assert metrics["widebeam_prefix_cache_hit_rate"] == pytest.approx(
        metrics["widebeam_prefix_cache_hit_tokens_total"]
        / metrics["widebeam_prefix_cache_queried_tokens_total"])
    assert 0 < metrics["widebeam_prefix_cache_hit_rate"] < 1
    assert metrics['widebeam_kv_blocks_evictable{pool="self"}'] > 0
    assert metrics['widebeam_kv_blocks_pinned{pool="self"}'] == 0


def test_chat_reports_cached_tokens_whole_and_in_the_streamed_usage_chunk(tiny_chat_model_dir, servers):
    server = servers["chat"].wait_ready()
    c, model = client(server), str(tiny_chat_model_dir)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a colour."}]
    whole = c.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0)
    assert whole.usage.prompt_tokens_details.cached_tokens == 0
    chunks = list(c.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.prompt_tokens_details.cached_tokens == (usage.prompt_tokens - 1) // 16 * 16 > 0
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert streamed == whole.choices[0].message.content
    beams = c.chat.completions.create(model=model, messages=messages, max_tokens=4, n=2,
                                      extra_body={"use_beam_search": True, "beam_width": 2})
    assert beams.usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens_details.cached_tokens


def test_no_prefix_caching_recomputes_every_prompt(tiny_chat_model_dir, servers):
    server = servers["uncached"].wait_ready()
    c, model = client(server), str(tiny_chat_model_dir)
    for _ in range(2):
        out = c.completions.create(model=model, prompt=SYSTEM + "Hi.", max_tokens=4, temperature=0)
        assert out.usage.prompt_tokens_details.cached_tokens == 0
    metrics = server.wait_idle()
    assert metrics['widebeam_kv_blocks_evictable{pool="self"}'] == 0
    assert metrics["widebeam_prefix_cache_hit_tokens_total"] == 0


def test_a_pinned_prefix_is_there_before_the_first_request(tiny_chat_model_dir, tokenizer, servers):
    system_ids = tokenizer.encode(SYSTEM)  # the token-id pin (system.json)
    text_ids = tokenizer.encode(TEXT_PIN)  # the text pin (examples.txt), as the engine encodes it
    server = servers["pinned"].wait_ready()
    pinned = server.metrics()['widebeam_kv_blocks_pinned{pool="self"}']
    assert pinned == len(system_ids) // 16 + len(text_ids) // 16 > 0
    c, model = client(server), str(tiny_chat_model_dir)
    out = c.completions.create(model=model, prompt=system_ids + [42, 43], max_tokens=4, temperature=0)
    assert out.usage.prompt_tokens_details.cached_tokens == len(system_ids) // 16 * 16
    out = c.completions.create(model=model, prompt=text_ids + [42, 43], max_tokens=4, temperature=0)
    assert out.usage.prompt_tokens_details.cached_tokens == len(text_ids) // 16 * 16
    metrics = server.metrics()  # (not wait_idle: pinned blocks are never free)
    assert metrics['widebeam_kv_blocks_pinned{pool="self"}'] == pinned
    # the pins' own computation is not counted as traffic
    assert metrics["widebeam_prefix_cache_queried_tokens_total"] == len(system_ids) + len(text_ids) + 4


def choices_of(response) -> list[dict]:
    """Every choice's text and finish reason, and its beam score where the server reports one."""
    out = []
    for choice in response.choices:
        fields = choice.model_dump()
        text = fields["text"] if "text" in fields else fields["message"]["content"]
        out.append({"text": text, "finish_reason": fields["finish_reason"],
                    "score": fields.get("beam_score")})
    return out


def same_choices(cached: list[dict], plain: list[dict]) -> bool:
    """The same texts and finish reasons, and beam scores equal but for float rounding (the hit's K/V
    came from another chunk shape)."""
    return len(cached) == len(plain) > 0 and all(
        (a["text"], a["finish_reason"]) == (b["text"], b["finish_reason"])
        and (b["score"] is None or a["score"] == pytest.approx(b["score"], abs=1e-4))
        for a, b in zip(cached, plain, strict=True))


def test_beam_and_pinned_hits_answer_as_an_uncached_server(tiny_chat_model_dir, tokenizer, servers):
    """Beam search on a prompt whose prefix another request computed, and greedy and beam search on a
    pinned prefix: the same choices (text, finish reason, beam score) as a server without prefix
    caching, on responses that really hit (`cached_tokens`).

    The prompts repeat their first block at position 1 (a pin or a prefix that recurs, as few-shot
    examples do): a cache that named blocks by their content alone would hand over block 0's K/V
    for position 1 and still report the same `cached_tokens`; only the text tells."""
    pinned = pinned_ids(tokenizer)  # the pin (repeated.json)
    other_ids = tokenizer.encode("Q: Name a colour and a shape. A:" * 4)
    other_ids = other_ids[:16] * 2 + other_ids
    cached_server = servers["hits"].wait_ready()
    plain_server = servers["uncached"].wait_ready()
    model = str(tiny_chat_model_dir)
    beam = {"max_tokens": 6, "n": 3, "extra_body": {"use_beam_search": True, "beam_width": 3}}
    greedy = {"max_tokens": 8, "temperature": 0}
    pinned_blocks = len(pinned) // 16
    calls = [  # (name, kind, arguments, the blocks it must hit on the cached server; None: some)
        ("warm", "completions", {"prompt": other_ids + [42, 43], **greedy}, 0),
        ("beam hit", "completions", {"prompt": other_ids + [44, 45, 46], **beam}, None),
        ("pinned greedy", "completions", {"prompt": pinned + [42, 43, 44], **greedy}, pinned_blocks),
        ("pinned beam", "completions", {"prompt": pinned + [45, 46], **beam}, pinned_blocks),
        ("chat warm", "chat", {"messages": [{"role": "system", "content": SYSTEM},
                                            {"role": "user", "content": "Name a colour."}], **greedy},
         0),
        ("chat beam", "chat", {"messages": [{"role": "system", "content": SYSTEM},
                                            {"role": "user", "content": "Name a shape."}], **beam},
         None),
    ]
    differ = {}  # every call whose answers differ, named
    for name, kind, arguments, hit_blocks in calls:
        answers = []
        for server in (cached_server, plain_server):
            c = client(server)
            create = c.completions.create if kind == "completions" else c.chat.completions.create
            answers.append(create(model=model, **arguments))
        cached, plain = answers
        hit = cached.usage.prompt_tokens_details.cached_tokens
        if hit_blocks is None:
            assert hit > 0, name  # a real hit: the comparison below is of reused K/V
        else:
            assert hit == hit_blocks * 16, name
        assert plain.usage.prompt_tokens_details.cached_tokens == 0
        if not same_choices(choices_of(cached), choices_of(plain)):
            differ[name] = (choices_of(cached), choices_of(plain))
        if kind == "completions" and arguments.get("n") == 3:
            assert len(cached.choices) == 3 and len({c["text"] for c in choices_of(cached)}) == 3, name
        if "n" in arguments:
            assert all(c["score"] is not None for c in choices_of(plain)), name
    assert not differ, f"cached and uncached answers differ for {sorted(differ)}: {differ}"
