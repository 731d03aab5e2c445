"""Prefix reuse over HTTP with the official `openai` client: `usage.prompt_tokens_details.cached_tokens`
on a repeated prompt (sampled and beam search), the /metrics hit counters and block gauges, a server
started with `--no-prefix-caching`, and one with `--pin-prefix` whose first request already hits."""

from __future__ import annotations

import json

import pytest
from conftest import ServerProcess

openai = pytest.importorskip("openai")

SYSTEM = ("You are a careful assistant that answers questions about colours, shapes and numbers. "
          "Keep every answer short and polite. ") * 3
OPTIONS = ["--kv-cache-memory", "4MiB", "--tokens-per-block", "16", "--max-seq-len", "1024"]


def start(model_dir, tmp_path, name, *args) -> ServerProcess:
    return ServerProcess(["--model", str(model_dir), *OPTIONS, *args], tmp_path / f"{name}.log").wait_ready()


def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_a_repeated_prompt_reports_cached_tokens_and_the_metrics_count_them(tiny_chat_model_dir, tmp_path):
    server = start(tiny_chat_model_dir, tmp_path, "cached")
    try:
        c, model = client(server), str(tiny_chat_model_dir)
        first = c.completions.create(model=model, prompt=SYSTEM + "Name a colour.", max_tokens=6, temperature=0)
        second = c.completions.create(model=model, prompt=SYSTEM + "Name a shape.", max_tokens=6, temperature=0)
        again = c.completions.create(model=model, prompt=SYSTEM + "Name a colour.", max_tokens=6, temperature=0)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert cached > 0 and cached % 16 == 0 and cached < second.usage.prompt_tokens
        assert again.choices[0].text == first.choices[0].text  # reuse changes nothing but the work
        beams = c.completions.create(model=model, prompt=SYSTEM + "Name a number.", max_tokens=5, n=3,
                                     extra_body={"use_beam_search": True, "beam_width": 3})
        assert beams.usage.prompt_tokens_details.cached_tokens >= cached and len(beams.choices) == 3
        metrics = server.wait_idle()
        assert metrics["widebeam_prefix_cache_hit_tokens_total"] > 0
        assert 0 < metrics["widebeam_prefix_cache_hit_rate"] < 1
        assert metrics['widebeam_kv_blocks_evictable{pool="self"}'] > 0
        assert metrics['widebeam_kv_blocks_pinned{pool="self"}'] == 0
    finally:
        server.stop()


def test_no_prefix_caching_recomputes_every_prompt(tiny_chat_model_dir, tmp_path):
    server = start(tiny_chat_model_dir, tmp_path, "plain", "--no-prefix-caching")
    try:
        c, model = client(server), str(tiny_chat_model_dir)
        for _ in range(2):
            out = c.completions.create(model=model, prompt=SYSTEM + "Hi.", max_tokens=4, temperature=0)
            assert out.usage.prompt_tokens_details.cached_tokens == 0
        assert server.metrics()['widebeam_kv_blocks_evictable{pool="self"}'] == 0
    finally:
        server.stop()


def test_a_pinned_prefix_is_there_before_the_first_request(tiny_chat_model_dir, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_chat_model_dir))
    system_ids = tokenizer.encode(SYSTEM)
    pin = tmp_path / "system.json"
    pin.write_text(json.dumps(system_ids))
    server = start(tiny_chat_model_dir, tmp_path, "pinned", "--pin-prefix", str(pin))
    try:
        pinned = server.metrics()['widebeam_kv_blocks_pinned{pool="self"}']
        assert pinned == len(system_ids) // 16
        out = client(server).completions.create(model=str(tiny_chat_model_dir), prompt=system_ids + [42, 43],
                                                max_tokens=4, temperature=0)
        assert out.usage.prompt_tokens_details.cached_tokens == pinned * 16
        assert server.metrics()['widebeam_kv_blocks_pinned{pool="self"}'] == pinned
    finally:
        server.stop()
