"""`response_format` -> a compiled grammar (xgrammar), per engine, and the request's constraint.

Formats (OpenAI's): `{"type": "text"}` (no constraint), `{"type": "json_object"}` (any JSON object),
`{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}` (a JSON value
valid against the schema). Both JSON grammars are compiled without free whitespace (xgrammar's
`any_whitespace=False`: `", "` and `": "` separators, as `json.dumps` writes), so a model cannot loop on
blanks; the end-of-sequence token is allowed only once the value is complete. A schema xgrammar cannot
compile is an `InvalidParameterError` naming `response_format` and xgrammar's reason.

Two ways to compile: in this process (`compile(fmt)`: the offline `LLM` and the engine's own
`add_request`), or with a time bound (`compile(fmt, timeout_s)`: the server, before admission), where a
schema not yet compiled goes first to a worker process that is killed past the bound, and is compiled
here only once it compiled there in time (compile_worker.py).
`json_object` is one small fixed grammar and always compiles here. Compiled grammars are kept (the last
64 schemas), so a schema repeated across requests compiles once and never waits for a worker.

xgrammar is imported on first use (`pip install 'widebeam[server]'` installs it).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from widebeam.errors import InvalidParameterError
from widebeam.response_format import bad_format, schema_of
from widebeam.structured.compile_worker import (
    CompileRefused,
    CompileTimeout,
    CompileWorkers,
    grammar_of,
    one_line_reason,
)
from widebeam.structured.constraint import GrammarConstraint

_MAX_CACHED_GRAMMARS = 64
_JSON_OBJECT_SCHEMA = schema_of({"type": "json_object"})
# Two: a client's heavy schema (up to its bound) leaves a worker for everyone else's; each holds ~0.3 GB
# (xgrammar imports torch) and a core while it compiles.
NUM_COMPILE_WORKERS = 2


class Grammars:
    """One engine's grammar compiler (its tokenizer's vocabulary, its end-of-sequence ids), made on
    first use."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._info = None  # xgrammar.TokenizerInfo
        self._compiler = None
        self._workers: CompileWorkers | None = None
        # schema text -> compiled grammar, most recent last: the server compiles before a request reaches
        # the engine, whose `constraint` then finds it here
        self._compiled: OrderedDict[str, object] = OrderedDict()
        self._lock = threading.Lock()

    def _get_compiler(self):
        if self._compiler is None:
            try:
                import xgrammar
            except ImportError:
                raise bad_format("needs xgrammar: pip install 'widebeam[server]'") from None
            if self.tokenizer is None:
                raise bad_format("needs the model's tokenizer, and this model directory has none")
            self._info = xgrammar.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.eos_token_ids or None)
            # one thread: a compile runs beside the engine's steps, and xgrammar's default of 8 threads
            # would take the cores the steps need. No cache of xgrammar's (unbounded by default): the
            # last 64 grammars are kept here.
            self._compiler = xgrammar.GrammarCompiler(self._info, max_threads=1, cache_enabled=False)
        return self._compiler

    def _get_workers(self) -> CompileWorkers:
        if self._workers is None:
            self._get_compiler()
            self._workers = CompileWorkers(self._info.serialize_json().encode(), NUM_COMPILE_WORKERS)
        return self._workers

    def _cached(self, schema: str):
        with self._lock:
            compiled = self._compiled.get(schema)
            if compiled is not None:
                self._compiled.move_to_end(schema)
            return compiled

    def is_quick(self, response_format) -> bool:
        """Whether `compile(response_format, timeout_s)` needs no worker: plain text, `json_object` or a
        schema compiled before (it never waits behind another request's compile)."""
        schema = schema_of(response_format)
        return schema is None or schema == _JSON_OBJECT_SCHEMA or self._cached(schema) is not None

    def compile(self, response_format, timeout_s: float | None = None):
        """The compiled grammar of a `response_format` (cached), or None for plain text. Thread-safe.
        With `timeout_s` (the server: formats.GRAMMAR_COMPILE_TIMEOUT_S), a schema other than
        `json_object` compiles first in a worker process, which is killed past `timeout_s` of its own
        compile time (waiting for a free worker is not counted): an InvalidParameterError naming
        `response_format`. One that compiled there in time is compiled again here."""
        schema = schema_of(response_format)
        if schema is None:
            return None
        compiled = self._cached(schema)
        if compiled is not None:
            return compiled
        with self._lock:
            compiler = self._get_compiler()
        if timeout_s is None or schema == _JSON_OBJECT_SCHEMA:
            compiled = self._compile_here(compiler, schema)
        else:
            compiled = self._compile_in_worker(compiler, schema, timeout_s)
        with self._lock:
            self._compiled[schema] = compiled
            while len(self._compiled) > _MAX_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        return compiled

    @staticmethod
    def _compile_here(compiler, schema: str):
        try:
            return compiler.compile_grammar(grammar_of(schema))
        except (RuntimeError, ValueError, TypeError) as exc:
            raise refused(one_line_reason(exc)) from None

    def _compile_in_worker(self, compiler, schema: str, timeout_s: float):
        with self._lock:
            workers = self._get_workers()
        try:
            grammar = workers.compile(schema, timeout_s)
        except CompileRefused as exc:
            raise refused(str(exc)) from None
        except CompileTimeout:
            raise InvalidParameterError(
                "response_format", "{response_format} took longer than {limit_s} s to compile: simplify the "
                "schema", limit_s=timeout_s) from None
        try:  # the work the worker just did in time (its schema-to-grammar part not repeated)
            return compiler.compile_grammar(grammar)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise refused(one_line_reason(exc)) from None

    def close(self) -> None:
        """Stop the worker processes (the server's shutdown); a later bounded compile fails."""
        with self._lock:
            if self._workers is not None:
                self._workers.close()

    def constraint(self, response_format) -> GrammarConstraint | None:
        """The request's constraint (a fresh matcher), or None for plain text."""
        compiled = self.compile(response_format)
        return None if compiled is None else GrammarConstraint(compiled, self.vocab_size)


def refused(reason: str) -> InvalidParameterError:
    """xgrammar's one-line reason as the client's 400."""
    return bad_format("has a schema that cannot be used: {reason}", reason=reason)
