"""A grammar can no longer stall the server (issue 30, items 1, 2, 6; issue 41, item 3), through the
official `openai` client on loopback: the QA pass's hostile schemas (an enum of 100k strings, arrays
nested 900 deep), an external `$ref`, and a grammar with `ignore_eos` or `min_tokens` are each a 400
naming the field, while a concurrent greedy stream is unaffected and the pools end whole; a greedy stream
keeps going while grammars compile; and a schema refused at the compile bound stops compiling (its
worker process is killed), so another client's `json_object` request is not held up behind it."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
import uuid

import openai
import pytest
from conftest import SMALL_POOL_ARGS, ServerProcess
from e2e_helpers import QA_PROMPT as PROMPT
from e2e_helpers import assert_pools_whole, client_of, streamed_text

from widebeam.response_format import MAX_ENUM_VALUES, MAX_NESTING_DEPTH, MAX_PROPERTIES
from widebeam.structured.grammars import NUM_COMPILE_WORKERS


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
    assert_pools_whole(server)


# A bounded-repeat regex: tens of seconds of xgrammar's schema-to-grammar work here (36 s measured), far
# past the compile bound (formats.GRAMMAR_COMPILE_TIMEOUT_S) on any host.
HEAVY_PATTERN = "[a-zA-Z0-9 ]{1000,20000}"
JSON_OBJECT = {"type": "json_object"}
# Issue 41: another client's compiles may hold up a json_object request by at most a second; the margin
# leaves a loaded 2-core host a second more (before the fix the request waited 18.5 s).
ALLOWED_DELAY_S = 2.0
KILLED = re.compile(r"its worker process \(pid (\d+)\) was killed")


def heavy_regex() -> dict:
    """A fresh (never compiled) heavy regex schema."""
    return json_schema({"type": "string", "pattern": uuid.uuid4().hex[:8] + HEAVY_PATTERN})


def small_schema() -> dict:
    """A fresh small schema: milliseconds of compile."""
    return json_schema({"type": "object", "properties": {f"k{uuid.uuid4().hex[:8]}": {"type": "integer"}}})


def chat_s(client, response_format) -> float:
    """Seconds a grammar request takes, end to end."""
    began = time.monotonic()
    out = client.chat.completions.create(model="tiny-chat", max_tokens=8, response_format=response_format,
                                         messages=[{"role": "user", "content": "JSON please"}])
    assert out.choices[0].finish_reason in ("stop", "length")
    return time.monotonic() - began


def killed_worker_pids(server) -> list[int]:
    """The grammar worker processes the server killed at the compile bound (its log's warnings)."""
    return [int(pid) for pid in KILLED.findall(server.log_path.read_text(errors="replace"))]


def process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def refused_at_the_bound(client, refusals: list) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        chat_s(client, heavy_regex())
    refusals.append((time.monotonic(), info.value.body))


def test_refused_compiles_stop_and_do_not_hold_up_json_object(server, client):
    """Issue 41, item 3 (the QA pass: three fresh heavy regex schemas, each a 400 after the 5 s bound,
    then a `json_object` request that waited 18.5 s behind their compiles). Each heavy schema is a 400
    naming `response_format`, and its worker process no longer exists when the 400 comes; a
    `json_object` request and a small fresh schema sent while one compiles, and a `json_object` request
    sent right after all three, take what they take alone plus at most ALLOWED_DELAY_S, and the first two
    are answered before the heavy one is refused."""
    chat_s(client, JSON_OBJECT)  # compiled once, in the server's own process
    json_alone_s = chat_s(client, JSON_OBJECT)
    chat_s(client, small_schema())  # the workers are up: their start is no schema's cost
    small_alone_s = chat_s(client, small_schema())
    num_killed_before = len(killed_worker_pids(server))

    refusals: list = []
    first = threading.Thread(target=refused_at_the_bound, args=(client, refusals))
    first.start()
    time.sleep(0.5)  # its compile is under way in one worker
    json_during_s = chat_s(client, JSON_OBJECT)
    small_during_s = chat_s(client, small_schema())  # the other worker
    served_at = time.monotonic()
    first.join(timeout=120)
    assert refusals and served_at < refusals[0][0], "served only after the heavy compile was refused"
    assert json_during_s < json_alone_s + ALLOWED_DELAY_S, (json_during_s, json_alone_s)
    assert small_during_s < small_alone_s + ALLOWED_DELAY_S, (small_during_s, small_alone_s)

    others = [threading.Thread(target=refused_at_the_bound, args=(client, refusals)) for _ in range(2)]
    for thread in others:
        thread.start()
    for thread in others:
        thread.join(timeout=120)
    json_after_s = chat_s(client, JSON_OBJECT)
    assert json_after_s < json_alone_s + ALLOWED_DELAY_S, (json_after_s, json_alone_s)

    assert len(refusals) == 3
    for _, error in refusals:
        assert error["param"] == "response_format" and "took longer than 5" in error["message"], error
    # the refused compiles were stopped, not left running: each one's process is gone
    killed = killed_worker_pids(server)[num_killed_before:]
    assert len(killed) == 3 and not any(process_exists(pid) for pid in killed), killed
    assert_pools_whole(server)


def test_compiles_do_not_stall_a_concurrent_stream(server, client):
    """A greedy stream keeps going while grammars compile: of its chunks, many arrive between a heavy
    schema's request and its 400 five seconds later (a compile that held the engine or the event loop
    would let through none), while eight fresh grammars near the caps compile beside it and each answers.
    (It counts chunks, not the time between them, which a loaded host stretches.)"""
    chat_s(client, near_the_caps())  # the workers are up: the heavy compile starts once it is sent
    chunk_times: list[float] = []
    started, stop = threading.Event(), threading.Event()

    def stream():
        with client.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=1500, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True}) as chunks:
            for _ in chunks:
                chunk_times.append(time.monotonic())
                started.set()
                if stop.is_set():
                    break  # closing the stream aborts the rest

    streamer = threading.Thread(target=stream)
    streamer.start()
    assert started.wait(60)
    answers: list[float] = []
    senders = [threading.Thread(target=lambda: answers.append(chat_s(client, near_the_caps())))
               for _ in range(8)]
    sent_at = time.monotonic()
    refusals: list = []
    heavy = threading.Thread(target=refused_at_the_bound, args=(client, refusals))
    heavy.start()
    for sender in senders:
        sender.start()
    heavy.join(timeout=120)
    for sender in senders:
        sender.join(timeout=120)
    stop.set()
    streamer.join(timeout=120)
    assert len(refusals) == 1 and refusals[0][1]["param"] == "response_format", refusals
    assert len(answers) == 8
    during = [t for t in chunk_times if sent_at < t < refusals[0][0]]
    assert len(during) >= 20, (len(during), len(chunk_times))
    assert_pools_whole(server)


def compile_workers_of(pid: int) -> set[int]:
    """The grammar worker processes whose parent is `pid` (from /proc)."""
    workers = set()
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as stat, open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])
                command = cmdline.read()
        except (OSError, ValueError, IndexError):
            continue
        if parent == pid and b"widebeam.structured.compile_worker" in command:
            workers.add(int(entry))
    return workers


def has_ended(pid: int) -> bool:
    """Gone, or a zombie (exited; whoever adopted it has not reaped it yet)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in "ZX"
    except FileNotFoundError:
        return True


def cut_short(client, response_format) -> None:
    """A grammar request the server's end cuts short, whatever it then gets (an error, a dropped
    connection)."""
    try:
        chat_s(client, response_format)
    except openai.APIError:
        pass


STOP_SIGNALS = [signal.SIGTERM, signal.SIGKILL]


@pytest.fixture(scope="module")
def servers_to_stop(tiny_chat_model_dir, tmp_path_factory):
    """One server per stop signal (each test ends its own), started at once: start-ups overlap."""
    folder = tmp_path_factory.mktemp("grammar-stop")
    procs = {sig: ServerProcess(["--model", str(tiny_chat_model_dir), "--served-model-name", "tiny-chat",
                                 *SMALL_POOL_ARGS], folder / f"{sig.name}.log")
             for sig in STOP_SIGNALS}
    yield procs
    for proc in procs.values():
        proc.stop()


@pytest.mark.parametrize("stop_signal", STOP_SIGNALS, ids=["sigterm", "sigkill"])
def test_grammar_workers_start_on_the_first_schema_and_end_with_the_server(servers_to_stop, stop_signal):
    """No worker process before the first schema (start-up does not pay for them); the first schema
    starts them; they end with the server, one busy with a heavy schema too: the shutdown kills them
    (SIGTERM), and one whose server was killed (SIGKILL) notices it is orphaned and exits within a
    second or so, not when its compile would have ended."""
    server = servers_to_stop[stop_signal].wait_ready()
    client = client_of(server)
    chat_s(client, JSON_OBJECT)
    assert not compile_workers_of(server.proc.pid)  # json_object compiles in the server's own process
    chat_s(client, small_schema())
    workers = compile_workers_of(server.proc.pid)
    assert len(workers) == NUM_COMPILE_WORKERS
    heavy = threading.Thread(target=cut_short, args=(client, heavy_regex()), daemon=True)
    heavy.start()
    time.sleep(1.0)  # its compile is under way (tens of seconds, were it not stopped)
    server.proc.send_signal(stop_signal)
    server.proc.wait(timeout=60)
    deadline = time.monotonic() + 5
    while not all(has_ended(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(has_ended(pid) for pid in workers), workers
    if stop_signal == signal.SIGTERM:
        assert "Traceback" not in server.log_tail(20000), server.log_tail()
