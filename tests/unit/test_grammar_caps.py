"""`response_format` caps, references and refused combinations, checked torch-free at the edge
(structured/formats.py, params.py): each refusal names the field; what is under the caps passes."""

from __future__ import annotations

import pytest

from widebeam.errors import InvalidParameterError
from widebeam.params import BeamSearchParams, SamplingParams
from widebeam.structured.formats import (
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
