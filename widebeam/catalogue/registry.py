"""The engine's catalogues by name, and the one a request constrains its beams to.

A source is a built `Catalogue`, token-id sequences, a [num_items, width] array (-1 padded), or a
file (`sources.py`: .jsonl, .npy, .parquet). Every problem is an `InvalidParameterError` naming the
parameter the caller used (`catalogue`, or `allowed_sequences` for an inline one).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from widebeam.catalogue.filters import FilteredCatalogue, ItemFilter, filter_stats
from widebeam.catalogue.trie import Catalogue, CatalogueError
from widebeam.errors import InvalidParameterError
from widebeam.params import BeamSearchParams


@dataclass(frozen=True)
class WithSubsets:
    """A catalogue source with named subsets of its item indices (what `widebeam serve
    --catalogue-subset` registers): `LLMEngine(catalogues={name: WithSubsets(source, subsets)})`.
    A subset is item indices, or a file of them (.npy, or text/JSON integers)."""

    source: object
    subsets: dict


def load_item_indices(source) -> np.ndarray:
    """Item indices from an array or list, or a file: .npy, else integers separated by spaces,
    commas or newlines (a JSON list reads the same)."""
    if not isinstance(source, (str, os.PathLike)):
        return np.asarray(source)
    if str(source).endswith(".npy"):
        return np.load(source)
    with open(source, encoding="utf-8") as file:
        text = file.read().replace("[", " ").replace("]", " ").replace(",", " ")
    try:
        return np.array([int(t) for t in text.split()], dtype=np.int64)
    except ValueError:
        raise InvalidParameterError("subsets", "{subsets} file {path!r} must hold integer item indices",
                                    path=str(source)) from None


class CatalogueRegistry(dict):
    """name -> Catalogue, on the engine's device, for one model's vocabulary."""

    def __init__(self, vocab_size: int, device: torch.device, tokenizer=None):
        super().__init__()
        self.vocab_size = vocab_size
        self.device = device
        self.tokenizer = tokenizer  # encodes a .jsonl file's text items
        self.subsets: dict[str, dict[str, np.ndarray]] = {}  # catalogue -> subset name -> item indices

    @property
    def nbytes(self) -> int:
        return sum(catalogue.nbytes for catalogue in self.values())

    def register(self, name: str, source, subsets: dict | None = None) -> Catalogue:
        """Build `source` and register it under `name` (replacing one of that name), with named
        `subsets` of its item indices (`BeamSearchParams(catalogue_subset=...)`)."""
        if not isinstance(name, str) or not name:
            raise InvalidParameterError("catalogue",
                                        "{catalogue} names must be non-empty strings, got {value!r}",
                                        value=name)
        if isinstance(source, WithSubsets):
            source, subsets = source.source, {**source.subsets, **(subsets or {})}
        catalogue = self.build(source)
        checked = {}
        for subset, ids in (subsets or {}).items():
            if not isinstance(subset, str) or not subset:
                raise InvalidParameterError("subsets", "{subsets} names must be non-empty strings, got "
                                            "{value!r}", value=subset)
            checked[subset] = _item_indices(catalogue, load_item_indices(ids), "subsets",
                                            f"subset {subset!r}")
        self[name] = catalogue
        self.subsets[name] = checked
        return catalogue

    def stats(self, request_catalogues) -> dict:
        """Per-request filter memory over the live requests' catalogues (`request_catalogues`): their
        filters, the filters' prefix-sum bytes, and the catalogues' index bytes."""
        filters = [c.item_filter for c in request_catalogues if isinstance(c, FilteredCatalogue)]
        return filter_stats(filters, self)

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
            return self._filtered(self[params.catalogue], params)
        if params.allowed_sequences is not None:
            try:
                catalogue = self.build(params.allowed_sequences)
            except InvalidParameterError as exc:
                raise InvalidParameterError("allowed_sequences", exc.template.replace("{catalogue}",
                                            "{allowed_sequences}"), **exc.values) from None
            return self._filtered(catalogue, params)
        return None

    def fit_request(self, params) -> tuple[Catalogue | None, object]:
        """(the request's catalogue or None, its params with `max_new_tokens` defaulting to the longest
        item and its end token). Refuses lengths that no item could satisfy: the search could only come
        back empty."""
        catalogue = self.for_request(params) if isinstance(params, BeamSearchParams) else None
        if catalogue is None:
            return None, params
        if params.max_new_tokens is None:
            params = params.replace(max_new_tokens=catalogue.max_item_tokens + 1)
        if params.max_new_tokens < catalogue.min_item_tokens + 1:
            raise InvalidParameterError(
                "max_new_tokens", "{max_new_tokens} must be >= {limit} with this catalogue (its shortest "
                "item has {shortest} tokens, then the end-of-sequence token), got {value}",
                limit=catalogue.min_item_tokens + 1, shortest=catalogue.min_item_tokens,
                value=params.max_new_tokens)
        if params.min_new_tokens > catalogue.max_item_tokens:
            # EOS is banned until min_new_tokens, and it ends every item: none could end
            raise InvalidParameterError(
                "min_new_tokens", "{min_new_tokens} must be <= {limit} with this catalogue (its longest "
                "item; each ends with the end-of-sequence token), got {value}",
                limit=catalogue.max_item_tokens, value=params.min_new_tokens)
        return catalogue, params

    def _filtered(self, catalogue: Catalogue, params: BeamSearchParams) -> Catalogue:
        """The catalogue with the request's item filter, if it has one: allowed items (and a named
        subset: both when given), less the excluded ones."""
        subset = params.catalogue_subset
        if params.allowed_items is None and params.excluded_items is None and subset is None:
            return catalogue
        chosen = []
        if subset is not None:
            subsets = self.subsets.get(params.catalogue, {})
            if subset not in subsets:
                raise InvalidParameterError("catalogue_subset", "{catalogue_subset} {value!r} is not "
                                            "registered with {catalogue} {name!r}; registered: {names}",
                                            value=subset,
                                            name=params.catalogue, names=", ".join(sorted(subsets)) or "none")
            chosen.append(subsets[subset])
        if params.allowed_items is not None:
            chosen.append(_item_indices(catalogue, params.allowed_items, "allowed_items"))
        allowed = np.ones(catalogue.num_items, dtype=bool)
        for items in chosen:
            mask = np.zeros(catalogue.num_items, dtype=bool)
            mask[items] = True
            allowed &= mask
        if params.excluded_items is not None:
            allowed[_item_indices(catalogue, params.excluded_items, "excluded_items")] = False
        return FilteredCatalogue(catalogue, ItemFilter(catalogue, allowed))


def _item_indices(catalogue: Catalogue, ids, param: str, what: str | None = None) -> np.ndarray:
    """Item indices as given -> trie items; an index past the items given is an error naming `param`."""
    ids = np.asarray(ids)
    num_given = catalogue.num_items if catalogue.source_items is None else catalogue.source_items.shape[0]
    if ids.size and (ids.ndim != 1 or ids.dtype.kind not in "iu" or int(ids.min()) < 0
                     or int(ids.max()) >= num_given):
        raise InvalidParameterError(param, "{" + param + "} " + (what + " " if what else "")
                                    + "must hold item indices in [0, {limit}) (the catalogue's items), "
                                    "got {value!r}", limit=num_given,
                                    value=ids.tolist() if ids.size < 8 else f"{ids.size} values")
    ids = ids.astype(np.int64)
    return ids if catalogue.source_items is None else catalogue.source_items[ids]
