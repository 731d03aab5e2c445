"""`response_format` (OpenAI's) checked and turned into the JSON schema its grammar enforces; no
xgrammar here, so parameters can be checked where it is not installed."""

from __future__ import annotations

import json

from widebeam.errors import InvalidParameterError

FORMAT_TYPES = ("text", "json_object", "json_schema")

# Caps that keep a grammar's compile short (the server compiles before admission, in a worker process killed
# past GRAMMAR_COMPILE_TIMEOUT_S: structured/compile_worker.py). xgrammar compile times measured on this
# project's 2-core CPU machine with SmolLM2's tokenizer: an enum of 1k fresh strings 0.03 s, 5k 0.16 s, 10k
# 1.5 s (the QA pass: 100k froze the engine 151 s); arrays nested 64 deep 0.02 s, 128 0.10 s, 256 0.65 s
# (900: 47 s); an object of 256 properties 0.08 s, 512 0.36 s, 1,000 2.8 s; 256 properties of 16 enum values
# each (52 KB, near every cap at once) 0.3 s. Each cap sits where one dimension alone compiles in ~0.1 s.
# Re-measured through Grammars.compile (tiny-chat tokenizer, caps lifted): enum 1k 0.01 s, 5k 0.06 s, 20k
# 19.6 s; arrays nested 50 deep 0.02 s, 64 0.02 s, 100 0.10 s, 300 1.7 s.
MAX_SCHEMA_BYTES = 64 * 1024
MAX_ENUM_VALUES = 4096  # enum and const values, summed over the schema
MAX_NESTING_DEPTH = 64  # levels of nested objects, arrays and combinators
MAX_PROPERTIES = 256  # object properties, summed over the schema
MAX_REPEAT_COUNT = 4096  # minLength / maxLength / minItems / maxItems / min-/maxProperties
GRAMMAR_COMPILE_TIMEOUT_S = 5.0
_REPEAT_KEYS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")


def bad_format(message: str, **values) -> InvalidParameterError:
    return InvalidParameterError("response_format", "{response_format} " + message, **values)


def schema_of(response_format) -> str | None:
    """The JSON schema (as text) a `response_format` asks for; None for plain text. Checks the shape."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict) or response_format.get("type") not in FORMAT_TYPES:
        raise bad_format("must be an object with type \"text\", \"json_object\" or \"json_schema\", "
                         "got {value!r}", value=response_format)
    kind = response_format["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return json.dumps({"type": "object"})
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
        raise bad_format("of type json_schema needs json_schema: {{\"name\": ..., \"schema\": {{...}}}}, "
                         "got {value!r}", value=spec)
    schema = spec.get("schema", {})  # OpenAI: no schema means any JSON value
    text = json.dumps(schema)
    if len(text.encode()) > MAX_SCHEMA_BYTES:
        raise bad_format("has a schema of {num_bytes} bytes; at most {limit} are accepted",
                         num_bytes=len(text.encode()), limit=MAX_SCHEMA_BYTES)
    _check_schema(schema)
    return text


def _check_schema(schema) -> None:
    """The caps above, and references: only local ones (`#/...`) are resolved, so any other would
    leave its part of the output unconstrained."""
    num_enum_values = num_properties = 0
    stack = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, list):
            stack.extend((item, depth) for item in node)
            continue
        if not isinstance(node, dict):
            continue
        if depth > MAX_NESTING_DEPTH:
            raise bad_format("nests deeper than {limit} levels", limit=MAX_NESTING_DEPTH)
        ref = node.get("$ref")
        if ref is not None and not (isinstance(ref, str) and (ref == "#" or ref.startswith("#/"))):
            raise bad_format("has $ref {value!r}: only local references (\"#/...\") are resolved",
                             value=ref)
        if isinstance(node.get("enum"), list):
            num_enum_values += len(node["enum"])
        num_enum_values += "const" in node
        if isinstance(node.get("properties"), dict):
            num_properties += len(node["properties"])
        for key in _REPEAT_KEYS:
            if isinstance(node.get(key), int) and node[key] > MAX_REPEAT_COUNT:
                raise bad_format("has {key} {value}; at most {limit}", key=key, value=node[key],
                                 limit=MAX_REPEAT_COUNT)
        if num_enum_values > MAX_ENUM_VALUES:
            raise bad_format("has more than {limit} enum values", limit=MAX_ENUM_VALUES)
        if num_properties > MAX_PROPERTIES:
            raise bad_format("has more than {limit} object properties", limit=MAX_PROPERTIES)
        for key, value in node.items():
            if key not in ("enum", "const", "default", "examples") and isinstance(value, (dict, list)):
                stack.append((value, depth + 1))
