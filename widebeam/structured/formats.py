"""`response_format` (OpenAI's) checked and turned into the JSON schema its grammar enforces; no
xgrammar here, so parameters can be checked where it is not installed."""

from __future__ import annotations

import json

from widebeam.errors import InvalidParameterError

FORMAT_TYPES = ("text", "json_object", "json_schema")


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
    return json.dumps(schema)
