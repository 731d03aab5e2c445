"""Incremental detokenization: the text a request's new tokens add, at a cost linear in its length.

Decoding the whole output after every token costs O(N^2) tokens over N steps. A token's text can depend
on its neighbours (SentencePiece drops the space of the first piece it decodes; a character may span
several byte-level tokens), so the text of token i is not `decode([i])`. Instead, as streaming
detokenizers do, keep two offsets into the tokens: `prefix` and `read`. The text new tokens add is
`decode(tokens[prefix:]) - decode(tokens[prefix:read])`: the tokens before `read` are context, already
emitted. When that text does not end in an incomplete character ('\\ufffd'), it is emitted and the window
moves on (prefix <- read, read <- end), so each call decodes a window of a few tokens.

Special tokens that `skip_special_tokens` removes never enter the window (they add no text, and a run
of them, e.g. EOS repeated under `ignore_eos`, would otherwise keep it from moving on).
"""

from __future__ import annotations

import weakref

INCOMPLETE = "\ufffd"  # what decoding yields for the bytes of a character not yet complete

# Per tokenizer: token id -> whether decoding with skip_special_tokens drops it (found out once per id).
_SKIPPED_IDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _special_candidates(tokenizer) -> frozenset[int]:
    ids = set(getattr(tokenizer, "all_special_ids", ()) or ())
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids.update(i for i, token in added.items() if getattr(token, "special", False))
    return frozenset(ids)


class _SkipTable:
    """Which ids `decode(..., skip_special_tokens=True)` drops: special tokens that decode to nothing."""

    def __init__(self, tokenizer):
        self.candidates = _special_candidates(tokenizer)
        self.known: dict[int, bool] = {}

    def skipped(self, tokenizer, token_id: int) -> bool:
        if token_id not in self.candidates:
            return False
        result = self.known.get(token_id)
        if result is None:
            result = self.known[token_id] = tokenizer.decode([token_id], skip_special_tokens=True) == ""
        return result


def _skip_table(tokenizer) -> _SkipTable:
    try:
        table = _SKIPPED_IDS.get(tokenizer)
        if table is None:
            table = _SKIPPED_IDS[tokenizer] = _SkipTable(tokenizer)
        return table
    except TypeError:  # not weak-referenceable: one table per detokenizer
        return _SkipTable(tokenizer)


class IncrementalDetokenizer:
    """`add(token_ids)` returns the text those tokens add; `text` is everything returned so far.

    The concatenation of what `add` returns, then `flush()`, equals
    `tokenizer.decode(all_ids, skip_special_tokens=...)`. `add` holds back text that ends in an
    incomplete character until the tokens completing it arrive; `flush()` gives what is still held
    (only ever non-empty when the output stops mid-character).
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._skip = _skip_table(tokenizer) if skip_special_tokens else None
        self.token_ids: list[int] = []  # the tokens that decode to text (skipped special tokens left out)
        self.prefix_offset = 0
        self.read_offset = 0
        self._pieces: list[str] = []  # joined on demand: appending to one string would copy it each time
        self._text = ""

    @property
    def text(self) -> str:
        """The text returned so far."""
        if self._pieces:
            self._pieces = [self._text, *self._pieces]
            self._text = "".join(self._pieces)
            self._pieces = []
        return self._text

    def add(self, token_ids: list[int]) -> str:
        """Append `token_ids`; return the text they complete."""
        if self._skip is None:
            self.token_ids.extend(token_ids)
        else:
            self.token_ids.extend(t for t in token_ids if not self._skip.skipped(self.tokenizer, t))
        return self._emit(final=False)

    def flush(self) -> str:
        """The text still held back (an incomplete last character, as `decode` renders it), once."""
        return self._emit(final=True)

    def _decode(self, token_ids: list[int]) -> str:
        if not token_ids:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def _emit(self, final: bool) -> str:
        if len(self.token_ids) == self.read_offset:
            return ""
        prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        window_text = self._decode(self.token_ids[self.prefix_offset:])
        if not final and (len(window_text) <= len(prefix_text) or window_text.endswith(INCOMPLETE)):
            return ""  # nothing yet, or a character still incomplete: wait for more tokens
        new_text = window_text[len(prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        if new_text:
            self._pieces.append(new_text)
        return new_text
