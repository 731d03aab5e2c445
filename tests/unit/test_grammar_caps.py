"""`response_format` caps, references and refused combinations, checked torch-free at the edge
(response_format.py, params.py): each refusal names the field; what is under the caps passes. And the
server's bounded compile (structured/compile_worker.py): a compile in a worker process is the compile
done here, a compile past its bound kills its worker, and a dead worker is replaced."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

from widebeam.errors import InvalidParameterError
from widebeam.params import BeamSearchParams, SamplingParams
from widebeam.response_format import (
    MAX_ENUM_VALUES,
    MAX_NESTING_DEPTH,
    MAX_PROPERTIES,
    MAX_REPEAT_COUNT,
    MAX_SCHEMA_BYTES,
    schema_of,
)


def fmt(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def arrays(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth - 1):
        schema = {"type": "array", "items": schema}
    return schema


def refused(schema, needle: str) -> None:
    with pytest.raises(InvalidParameterError) as info:
        schema_of(fmt(schema))
    assert info.value.param == "response_format" and needle in str(info.value), str(info.value)


def test_each_cap_is_exact():
    schema_of(fmt({"enum": list(range(MAX_ENUM_VALUES))}))
    refused({"enum": list(range(MAX_ENUM_VALUES + 1))}, "enum values")
    # enum values are counted over the whole schema, consts included
    half = MAX_ENUM_VALUES // 2
    refused({"anyOf": [{"enum": list(range(half))}, {"enum": list(range(half))}, {"const": 1}]},
            "enum values")
    schema_of(fmt(arrays(MAX_NESTING_DEPTH)))
    refused(arrays(MAX_NESTING_DEPTH + 1), f"deeper than {MAX_NESTING_DEPTH}")
    schema_of(fmt({"type": "object", "properties": {f"p{i}": {} for i in range(MAX_PROPERTIES)}}))
    refused({"type": "object", "properties": {f"p{i}": {} for i in range(MAX_PROPERTIES + 1)}}, "properties")
    schema_of(fmt({"type": "string", "maxLength": MAX_REPEAT_COUNT}))
    refused({"type": "array", "minItems": MAX_REPEAT_COUNT + 1}, "minItems")
    refused({"description": "x" * MAX_SCHEMA_BYTES}, "bytes; at most")


def test_only_local_references_are_accepted():
    schema_of(fmt({"$defs": {"a": {"type": "integer"}}, "type": "object",
                   "properties": {"a": {"$ref": "#/$defs/a"}}}))
    for ref in ("https://example.com/s.json", "other.json#/a", "s.json"):
        refused({"type": "object", "properties": {"a": {"$ref": ref}}}, "only local references")


@pytest.mark.parametrize("make", [SamplingParams, lambda **kw: BeamSearchParams(beam_width=2, **kw)])
def test_a_grammar_refuses_ignore_eos_and_min_new_tokens(make):
    grammar = fmt({"type": "integer"})
    make(response_format=grammar, max_new_tokens=8)
    with pytest.raises(InvalidParameterError) as info:
        make(response_format=grammar, max_new_tokens=8, ignore_eos=True)
    assert info.value.param == "ignore_eos" and "response_format" in str(info.value)
    with pytest.raises(InvalidParameterError) as info:
        make(response_format=grammar, max_new_tokens=8, min_new_tokens=3)
    assert info.value.param == "min_new_tokens" and "response_format" in str(info.value)
    make(max_new_tokens=8, ignore_eos=True, min_new_tokens=3)  # without a grammar both are fine


def test_xgrammar_errors_are_one_line_without_a_source_path():
    """A compile error reaches the client as one line naming `response_format`, without xgrammar's
    C++ source location (the QA pass saw `.../grammar_compiler.cc:123:` in a 500)."""
    pytest.importorskip("xgrammar")
    from widebeam.structured.grammars import Grammars

    class Refusing:
        def compile_grammar(self, grammar):
            raise RuntimeError("[12:00:00] /workspace/cpp/grammar_compiler.cc:123: Check failed: bad rule\n"
                               "Stack trace:\n  [bt] (0) /usr/lib/libxgrammar.so(+0x1234)")

    grammars = Grammars(tokenizer=None, vocab_size=8, eos_token_ids=[0])
    grammars._compiler = Refusing()
    with pytest.raises(InvalidParameterError) as info:
        grammars.compile(fmt({"type": "integer"}))
    message = str(info.value)
    assert info.value.param == "response_format" and "bad rule" in message, message
    assert "\n" not in message and ".cc" not in message and "Stack trace" not in message, message


# -- compiles in worker processes (the server's path) -------------------------------------------------
# A vocabulary of a few JSON pieces: the workers' cost is xgrammar's import, not the tokenizer.
TINY_VOCAB = ["<eos>", "{", "}", '"', ":", ",", " ", "a", "b", "1", "2", "[", "]", "ab", '": ']
SMALL = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
# A fresh bounded-repeat regex: tens of seconds of xgrammar's schema-to-grammar conversion here.
HEAVY = json.dumps({"type": "string", "pattern": "[a-zA-Z0-9 ]{1000,20000}"})


def tiny_info():
    xgrammar = pytest.importorskip("xgrammar")
    return xgrammar.TokenizerInfo(TINY_VOCAB, stop_token_ids=[0])


def live_pids(workers) -> list[int]:
    """The process ids of a `CompileWorkers`' live children, read under its lock."""
    with workers._lock:
        return sorted(worker.pid for worker in workers._workers if worker.alive)


def process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_dead(pid: int) -> None:
    """Until the killed child (ours) has exited, every thread of it, without reaping it: its pool still
    finds it dead."""
    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)


@pytest.fixture()
def workers():
    from widebeam.structured.compile_worker import CompileWorkers

    pool = CompileWorkers(tiny_info().serialize_json().encode(), num_workers=1)
    yield pool
    pool.close()


def test_a_compile_in_a_worker_answers_the_grammar_compiled_here(workers):
    """The worker answers the schema's grammar text (what the server then compiles), or xgrammar's
    reason in one line."""
    import xgrammar

    from widebeam.structured.compile_worker import CompileRefused, grammar_of

    grammar = workers.compile(SMALL, timeout_s=60)
    assert grammar == grammar_of(SMALL)
    matcher = xgrammar.GrammarMatcher(xgrammar.GrammarCompiler(tiny_info()).compile_grammar(grammar))
    assert matcher.accept_string('{"a": 12}') and matcher.accept_token(0) and matcher.is_terminated()
    with pytest.raises(CompileRefused, match="parenthesis is not closed") as info:
        workers.compile(json.dumps({"type": "string", "pattern": "(a"}), timeout_s=60)
    assert "\n" not in str(info.value) and ".cc" not in str(info.value)


def test_a_compile_past_its_bound_kills_its_worker(workers):
    """The refused compile stops: its process is gone when the refusal comes, and the next schema
    compiles in a fresh one."""
    from widebeam.structured.compile_worker import CompileTimeout

    workers.compile(SMALL, timeout_s=60)  # the worker is up: its start is not part of the bound
    (pid,) = live_pids(workers)
    with pytest.raises(CompileTimeout):
        workers.compile(HEAVY, timeout_s=0.5)
    assert not process_exists(pid) and workers.num_killed == 1
    assert workers.compile(SMALL, timeout_s=60) and live_pids(workers) != [pid]


def test_a_dead_worker_is_replaced(workers):
    """A worker killed while idle is replaced on the next compile; one that dies mid-compile (as if
    xgrammar crashed on the schema) refuses that schema and is replaced too."""
    from widebeam.structured.compile_worker import CompileRefused

    workers.compile(SMALL, timeout_s=60)
    (pid,) = live_pids(workers)
    os.kill(pid, signal.SIGKILL)
    wait_dead(pid)
    assert workers.compile(SMALL, timeout_s=60) and live_pids(workers) != [pid]
    (pid,) = live_pids(workers)
    threading.Timer(0.5, os.kill, (pid, signal.SIGKILL)).start()
    with pytest.raises(CompileRefused, match="crashed the grammar compiler"):
        workers.compile(HEAVY, timeout_s=60)
    assert workers.num_killed == 0 and workers.compile(SMALL, timeout_s=60) and live_pids(workers) != [pid]


def test_close_ends_every_worker():
    from widebeam.structured.compile_worker import CompileWorkers

    pool = CompileWorkers(tiny_info().serialize_json().encode(), num_workers=2)
    pids = live_pids(pool)
    assert len(pids) == 2 and all(process_exists(pid) for pid in pids)
    pool.close()
    deadline = time.monotonic() + 10
    while any(process_exists(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(process_exists(pid) for pid in pids)
    with pytest.raises(RuntimeError, match="shut down"):
        pool.compile(SMALL, timeout_s=60)
