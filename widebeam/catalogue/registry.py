"""The engine's catalogues by name, and the one a request constrains its beams to.

A source is a built `Catalogue`, token-id sequences, a [num_items, width] array (-1 padded), or a
file (`sources.py`: .jsonl, .npy, .parquet). Every problem is an `InvalidParameterError` naming the
parameter the caller used (`catalogue`, or `allowed_sequences` for an inline one).
"""

from __future__ import annotations

import os

import torch

from widebeam.catalogue.trie import Catalogue, CatalogueError
from widebeam.errors import InvalidParameterError
from widebeam.params import BeamSearchParams


class CatalogueRegistry(dict):
    """name -> Catalogue, on the engine's device, for one model's vocabulary."""

    def __init__(self, vocab_size: int, device: torch.device, tokenizer=None):
        super().__init__()
        self.vocab_size = vocab_size
        self.device = device
        self.tokenizer = tokenizer  # encodes a .jsonl file's text items

    @property
    def nbytes(self) -> int:
        return sum(catalogue.nbytes for catalogue in self.values())

    def register(self, name: str, source) -> Catalogue:
        """Build `source` and register it under `name` (replacing one of that name)."""
        if not isinstance(name, str) or not name:
            raise InvalidParameterError("catalogue",
                                        "{catalogue} names must be non-empty strings, got {value!r}",
                                        value=name)
        self[name] = self.build(source)
        return self[name]

    def build(self, source) -> Catalogue:
        if isinstance(source, Catalogue):
            if source.vocab_size != self.vocab_size:
                raise InvalidParameterError("catalogue",
                                            "{catalogue} was built for a vocabulary of {size} tokens; "
                                            "this model has {vocab_size}", size=source.vocab_size,
                                            vocab_size=self.vocab_size)
            return source.to(self.device)
        try:
            if isinstance(source, (str, os.PathLike)):
                from widebeam.catalogue.sources import load_items

                source = load_items(source, self.tokenizer)
            return Catalogue.from_sequences(source, self.vocab_size, self.device)
        except CatalogueError as exc:
            raise InvalidParameterError("catalogue", "{catalogue} is malformed: {problem}",
                                        problem=str(exc)) from None

    def for_request(self, params: BeamSearchParams) -> Catalogue | None:
        """The request's catalogue (registered or inline), or None."""
        if params.catalogue is not None:
            if params.catalogue not in self:
                raise InvalidParameterError("catalogue",
                                            "{catalogue} {value!r} is not registered; registered: "
                                            "{names}", value=params.catalogue,
                                            names=", ".join(sorted(self)) or "none")
            return self[params.catalogue]
        if params.allowed_sequences is not None:
            try:
                return self.build(params.allowed_sequences)
            except InvalidParameterError as exc:
                raise InvalidParameterError("allowed_sequences", exc.template.replace("{catalogue}",
                                            "{allowed_sequences}"), **exc.values) from None
        return None
