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

from widebeam.catalogue.filters import FilteredCatalogue, ItemFilter, filter_stats, node_item_ranges
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
        subset: both when given), less the excluded ones. A filter or a ban that leaves no item is
        refused naming the field that emptied it (the search could only come back empty)."""
        subset = params.catalogue_subset
        single_bans = {s[0] for s in params.bad_words_ids if len(s) == 1}
        if params.allowed_items is None and params.excluded_items is None and subset is None:
            if single_bans:
                _check_bans_leave_an_item(catalogue, np.ones(catalogue.num_items, dtype=bool), single_bans)
            return catalogue
        allowed = np.ones(catalogue.num_items, dtype=bool)
        if subset is not None:
            subsets = self.subsets.get(params.catalogue, {})
            if subset not in subsets:
                raise InvalidParameterError("catalogue_subset", "{catalogue_subset} {value!r} is not "
                                            "registered with {catalogue} {name!r}; registered: {names}",
                                            value=subset,
                                            name=params.catalogue, names=", ".join(sorted(subsets)) or "none")
            allowed = _only(allowed, subsets[subset])
            if not allowed.any():
                raise InvalidParameterError("catalogue_subset", "{catalogue_subset} {value!r} holds no item: "
                                            "name a subset with at least one", value=subset)
        if params.allowed_items is not None:
            allowed = _only(allowed, _item_indices(catalogue, params.allowed_items, "allowed_items"))
            if not allowed.any():
                if subset is None:
                    raise InvalidParameterError("allowed_items", "{allowed_items} is empty: list at least "
                                                "one item index in [0, {limit})", limit=_num_given(catalogue))
                raise InvalidParameterError("allowed_items", "{allowed_items} and {catalogue_subset} "
                                            "{value!r} share no item: allow at least one item of the subset",
                                            value=subset)
        if params.excluded_items is not None:
            allowed[_item_indices(catalogue, params.excluded_items, "excluded_items")] = False
            if not allowed.any():
                raise InvalidParameterError("excluded_items", "{excluded_items} excludes every item "
                                            + _left_by(params) + ": leave at least one")
        if single_bans:
            _check_bans_leave_an_item(catalogue, allowed, single_bans, _left_by(params))
        return FilteredCatalogue(catalogue, ItemFilter(catalogue, allowed))


def _only(allowed: np.ndarray, items: np.ndarray) -> np.ndarray:
    """`allowed` less every item not in `items` (trie items)."""
    mask = np.zeros(allowed.shape[0], dtype=bool)
    mask[items] = True
    return allowed & mask


def _num_given(catalogue: Catalogue) -> int:
    return catalogue.num_items if catalogue.source_items is None else catalogue.source_items.shape[0]


def _left_by(params: BeamSearchParams) -> str:
    """Which items a later check counts from, in words (a template: the names in braces): the
    filters given before it."""
    given = ["{" + name + "}" for name in ("catalogue_subset", "allowed_items")
             if getattr(params, name) is not None]
    return "of the catalogue" if not given else "that " + " and ".join(given) + " allow"


def _check_bans_leave_an_item(catalogue: Catalogue, allowed: np.ndarray, single_bans: set[int],
                              left_by: str = "of the catalogue") -> None:
    """Refuse one-token `bad_words_ids` that ban a token of every allowed item: a node whose token is
    banned takes its whole subtree's items (a contiguous range, catalogue/filters.py) with it. Longer
    banned sequences (and n-grams) depend on the path and end a beam while decoding instead."""
    tokens = catalogue.node_token.cpu().numpy()
    banned_nodes = np.flatnonzero(np.isin(tokens, np.fromiter(single_bans, dtype=np.int64)))
    banned_nodes = banned_nodes[banned_nodes > 0]  # the root has no token
    if banned_nodes.size == 0:
        return
    first, end = (t.cpu().numpy() for t in node_item_ranges(catalogue))
    covered = np.zeros(catalogue.num_items + 1, dtype=np.int64)
    np.add.at(covered, first[banned_nodes], 1)
    np.add.at(covered, end[banned_nodes], -1)
    if not (allowed & (np.cumsum(covered[:-1]) == 0)).any():
        raise InvalidParameterError("bad_words_ids", "{bad_words_ids} bans a token of every item " + left_by
                                    + ": no item could be returned. Leave one item's tokens unbanned")


def _item_indices(catalogue: Catalogue, ids, param: str, what: str | None = None) -> np.ndarray:
    """Item indices as given -> trie items; an index past the items given is an error naming `param`."""
    ids = np.asarray(ids)
    num_given = _num_given(catalogue)
    if ids.size and (ids.ndim != 1 or ids.dtype.kind not in "iu" or int(ids.min()) < 0
                     or int(ids.max()) >= num_given):
        raise InvalidParameterError(param, "{" + param + "} " + (what + " " if what else "")
                                    + "must hold item indices in [0, {limit}) (the catalogue's items), "
                                    "got {value!r}", limit=num_given,
                                    value=ids.tolist() if ids.size < 8 else f"{ids.size} values")
    ids = ids.astype(np.int64)
    return ids if catalogue.source_items is None else catalogue.source_items[ids]
