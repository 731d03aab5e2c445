"""`response_format` -> a compiled grammar (xgrammar), per engine, and the request's constraint.

Formats (OpenAI's): `{"type": "text"}` (no constraint), `{"type": "json_object"}` (any JSON object),
`{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}` (a JSON value
valid against the schema). Both JSON grammars are compiled without free whitespace (xgrammar's
`any_whitespace=False`: `", "` and `": "` separators, as `json.dumps` writes), so a model cannot loop on
blanks; the end-of-sequence token is allowed only once the value is complete. A schema xgrammar cannot
compile is an `InvalidParameterError` naming `response_format` and xgrammar's reason.

xgrammar is imported on first use (`pip install 'widebeam[server]'` installs it); compiled grammars are
cached by xgrammar's compiler, so a schema repeated across requests compiles once.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict

from widebeam.structured.constraint import GrammarConstraint
from widebeam.structured.formats import bad_format, schema_of

# xgrammar 0.2.9 writes a string with minLength / maxLength as `"\"" chars{m, n} "\""` whose character
# class lets raw control characters through (invalid JSON: json.loads refuses "a<TAB>b"); its other strings
# exclude them. The class is narrowed to JSON's in the grammar's text before it is compiled.
_LENGTH_LIMITED_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\\r\n]'


_MAX_CACHED_GRAMMARS = 64


class Grammars:
    """One engine's grammar compiler (its tokenizer's vocabulary, its end-of-sequence ids), made on
    first use."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._compiler = None
        # schema text -> compiled grammar, most recent last: the server compiles in a thread of its
        # own before a request reaches the engine, whose `constraint` then finds it here
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
            info = xgrammar.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                           stop_token_ids=self.eos_token_ids or None)
            # one thread: a compile runs beside the engine's steps (the server's compile thread), and
            # xgrammar's default of 8 threads would take the cores the steps need
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=1)
        return self._compiler

    def compile(self, response_format):
        """The compiled grammar of a `response_format` (cached), or None for plain text. Thread-safe:
        the server calls it off the engine's thread, with a time bound
        (formats.GRAMMAR_COMPILE_TIMEOUT_S)."""
        schema = schema_of(response_format)
        if schema is None:
            return None
        with self._lock:
            compiled = self._compiled.get(schema)
            if compiled is not None:
                self._compiled.move_to_end(schema)
                return compiled
            compiler = self._get_compiler()
        import xgrammar

        try:
            grammar = str(xgrammar.Grammar.from_json_schema(schema, any_whitespace=False))
            compiled = compiler.compile_grammar(grammar.replace(_LENGTH_LIMITED_CHAR, _JSON_STRING_CHAR))
        except (RuntimeError, ValueError, TypeError) as exc:
            # one line, without xgrammar's source location
            reason = re.sub(r"^\[[^\]]*\] [^:]*:\d+: ", "", str(exc).strip())
            reason = re.sub(r"\S+\.(?:cc|cpp|h|hpp|py):\d+:?\s*", "", reason)
            reason = (reason.splitlines() or ["xgrammar refused it"])[0]
            raise bad_format("has a schema that cannot be used: {reason}", reason=reason) from None
        with self._lock:
            self._compiled[schema] = compiled
            while len(self._compiled) > _MAX_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        return compiled

    def constraint(self, response_format) -> GrammarConstraint | None:
        """The request's constraint (a fresh matcher), or None for plain text."""
        compiled = self.compile(response_format)
        return None if compiled is None else GrammarConstraint(compiled, self.vocab_size)
