"""A grammar can no longer stall the server (issue 30, items 1, 2, 6), through the official `openai`
client on loopback: the QA pass's hostile schemas (an enum of 100k strings, arrays nested 900 deep),
an external `$ref`, and a grammar with `ignore_eos` or `min_tokens` are each a 400 naming the field,
while a concurrent greedy stream is unaffected and the pools end whole; and while many fresh grammars
near the caps compile, a greedy stream's longest gap between chunks stays under a second (compiles run
off the engine's thread)."""

from __future__ import annotations

import threading
import time
import uuid

import openai
import pytest
from test_qa_reproductions import PROMPT, client_of, streamed_text

from widebeam.structured.formats import MAX_ENUM_VALUES, MAX_NESTING_DEPTH, MAX_PROPERTIES


def json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def nested_arrays(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def near_the_caps() -> dict:
    """A fresh schema (no cache hit) near the property and enum caps: ~0.3 s of compile here."""
    per_property = MAX_ENUM_VALUES // MAX_PROPERTIES
    return json_schema({"type": "object", "properties": {
        f"p{i}{uuid.uuid4().hex[:5]}": {"enum": [uuid.uuid4().hex[:8] for _ in range(per_property)]}
        for i in range(MAX_PROPERTIES)}})


@pytest.fixture(scope="module")
def client(server):
    return client_of(server)


HUGE_ENUM = json_schema({"enum": [f"s{i:06d}" for i in range(100_000)]})
ENUM_OVER_THE_CAP = json_schema({"enum": [f"s{i}" for i in range(MAX_ENUM_VALUES + 1)]})
EXTERNAL_REF = json_schema({"type": "object", "properties": {"a": {"$ref": "https://example.com/s.json"}}})
INTEGER = json_schema({"type": "integer"})


@pytest.mark.parametrize(("label", "response_format", "extra_body", "param", "needle"), [
    ("enum of 100k strings", HUGE_ENUM, {}, "response_format", "bytes; at most"),
    ("enum over the cap", ENUM_OVER_THE_CAP, {}, "response_format", "enum values"),
    ("arrays nested 900 deep", json_schema(nested_arrays(900)), {}, "response_format",
     f"deeper than {MAX_NESTING_DEPTH}"),
    ("an external $ref", EXTERNAL_REF, {}, "response_format", "only local references"),
    ("grammar + ignore_eos", INTEGER, {"ignore_eos": True}, "ignore_eos", "response_format"),
    ("grammar + min_tokens", INTEGER, {"min_tokens": 5}, "min_tokens", "response_format"),
])
def test_hostile_formats_are_a_400_naming_the_field(server, client, label, response_format, extra_body, param,
                                                    needle):
    alone = streamed_text(client)
    streamed: list[str] = []
    stream = threading.Thread(target=lambda: streamed.append(streamed_text(client)))
    stream.start()
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny-chat", max_tokens=8, response_format=response_format,
                                       messages=[{"role": "user", "content": PROMPT}], extra_body=extra_body)
    stream.join(timeout=60)
    assert streamed == [alone], label
    error = info.value.body
    assert error["param"] == param and needle in error["message"], (label, error)
    assert "Traceback" not in error["message"] and ".cc" not in error["message"], error
    server.wait_idle()
    assert all(free == total for free, total in server.pools().values())


def test_compiles_do_not_stall_a_concurrent_stream(server, client):
    """Eight fresh grammars near the caps (~0.3 s of compile each, ~2.4 s together) are compiled while a
    greedy stream runs: its longest gap between chunks stays under 1 s, and every grammar request
    answers JSON."""
    gaps: list[float] = []
    started = threading.Event()

    def stream():
        last = None
        for _ in client.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=160, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True}):
            now = time.monotonic()
            if last is not None:
                gaps.append(now - last)
            last = now
            started.set()

    streamer = threading.Thread(target=stream)
    streamer.start()
    assert started.wait(60)
    answers: list[str] = []

    def grammar_request():
        out = client.chat.completions.create(model="tiny-chat", max_tokens=4,
                                             messages=[{"role": "user", "content": "JSON please"}],
                                             response_format=near_the_caps())
        answers.append(out.choices[0].finish_reason)

    senders = [threading.Thread(target=grammar_request) for _ in range(8)]
    for sender in senders:
        sender.start()
    for sender in senders:
        sender.join(timeout=120)
    streamer.join(timeout=120)
    assert len(answers) == 8 and len(gaps) > 100
    assert max(gaps) < 1.0, f"longest gap {max(gaps):.2f} s"
    server.wait_idle()
    assert all(free == total for free, total in server.pools().values())
