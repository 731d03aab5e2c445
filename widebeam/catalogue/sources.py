"""Catalogue files: the items of a catalogue read from disk, for `Catalogue.from_sequences`.

- `.jsonl`: one item per line, either a JSON list of token ids (`[17, 4, 902]`), a JSON string the
  model's tokenizer encodes without special tokens (`"blue running shoes"`), or an object holding one
  of them (`{"tokens": [...]}`, `{"token_ids": [...]}` or `{"text": "..."}`; other keys are ignored,
  so a line may carry its item id). Blank lines are skipped.
- `.npy`: a 2-D integer array [num_items, width], rows padded with -1 after their last token. It is
  read with `allow_pickle=False`: an object array is refused, never unpickled.
- `.parquet` (needs pyarrow: `pip install 'widebeam[catalogue]'`): either one list<int> column (the
  items; other columns, such as an item id, are ignored), or else every column an integer column,
  in order, one token each (nulls and -1 are padding).

Errors are `CatalogueError`s naming the file and, for JSONL, the line. This module imports neither
torch nor the trie until it raises (`widebeam plan --catalogue FILE` stays torch-free).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

PAD = -1  # widebeam.catalogue.trie.PAD
SUFFIXES = (".jsonl", ".npy", ".parquet")
JSONL_TOKEN_KEYS = ("tokens", "token_ids")
JSONL_TEXT_KEYS = ("text",)


def _error(message: str) -> Exception:
    from widebeam.catalogue.trie import CatalogueError

    return CatalogueError(message)


def load_items(path: str | os.PathLike, tokenizer=None) -> np.ndarray | list[list[int]]:
    """The items of a catalogue file: a list of token-id lists (.jsonl) or a [num_items, width] int64
    array padded with -1 (.npy, .parquet). `tokenizer` (a Hugging Face tokenizer) encodes JSONL string
    items; without one a string item is an error."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise _error(f"catalogue file {str(path)!r}: unknown type {suffix or '(no suffix)'!r}; "
                     f"use one of {', '.join(SUFFIXES)}")
    if not path.is_file():
        raise _error(f"catalogue file {str(path)!r} does not exist")
    if suffix == ".jsonl":
        return _jsonl(path, tokenizer)
    if suffix == ".npy":
        return _npy(path)
    return _parquet(path)


# -- JSONL ------------------------------------------------------------------------------------------
def _jsonl(path: Path, tokenizer) -> list[list[int]]:
    items: list[list[int] | None] = []
    texts: list[tuple[int, int, str]] = []  # (item index, line number, text) to encode in one batch
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"catalogue file {str(path)!r}, line {number}"
            try:
                value = json.loads(line)
            except json.JSONDecodeError as exc:
                raise _error(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
            if isinstance(value, dict):
                value = _from_object(value, where)
            if isinstance(value, str):
                if not value:
                    raise _error(f"{where}: an empty string is no item")
                texts.append((len(items), number, value))
                items.append(None)
            elif isinstance(value, list):
                items.append(_token_ids(value, where))
            else:
                raise _error(f"{where}: expected a list of token ids, a string, or an object with "
                             f"'tokens' or 'text'; got {type(value).__name__}")
    if not items:
        raise _error(f"catalogue file {str(path)!r} holds no items")
    if texts:
        if tokenizer is None:
            raise _error(f"catalogue file {str(path)!r}, line {texts[0][1]}: a string item needs the model's "
                         f"tokenizer, and this model has none; give token ids instead")
        for (index, number, text), ids in zip(texts, _encode(tokenizer, [t for _, _, t in texts])):
            if not ids:
                raise _error(f"catalogue file {str(path)!r}, line {number}: {text!r} encodes to no tokens")
            items[index] = ids
    return items  # type: ignore[return-value]


def _from_object(value: dict, where: str):
    keys = [k for k in (*JSONL_TOKEN_KEYS, *JSONL_TEXT_KEYS) if k in value]
    if len(keys) != 1:
        found = "both " + " and ".join(repr(k) for k in keys) if keys else "neither"
        raise _error(f"{where}: an object item needs exactly one of 'tokens' (or 'token_ids') and 'text'; "
                     f"found {found}")
    item = value[keys[0]]
    if keys[0] in JSONL_TEXT_KEYS and not isinstance(item, str):
        raise _error(f"{where}: 'text' must be a string, got {type(item).__name__}")
    if keys[0] in JSONL_TOKEN_KEYS and not isinstance(item, list):
        raise _error(f"{where}: {keys[0]!r} must be a list of token ids, got {type(item).__name__}")
    return item


def _token_ids(value: list, where: str) -> list[int]:
    if not value:
        raise _error(f"{where}: an empty list is no item")
    for position, token in enumerate(value):
        if isinstance(token, bool) or not isinstance(token, int):
            raise _error(f"{where}: token {position} is {json.dumps(token)}: token ids must be integers")
        if token < 0:
            raise _error(f"{where}: token {position} is {token}: token ids must be >= 0")
    return value


def _encode(tokenizer, texts: list[str]) -> list[list[int]]:
    try:  # a Hugging Face tokenizer encodes a batch at once (fast tokenizers in parallel)
        return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    except TypeError:
        return [list(tokenizer.encode(text, add_special_tokens=False)) for text in texts]


# -- arrays -----------------------------------------------------------------------------------------
def _npy(path: Path) -> np.ndarray:
    try:
        array = np.load(path, allow_pickle=False)
    except ValueError as exc:  # an object array (it would need unpickling), or a damaged file
        raise _error(f"catalogue file {str(path)!r}: cannot read it as a plain integer array "
                     f"(object arrays are never unpickled): {exc}") from None
    if not isinstance(array, np.ndarray):
        raise _error(f"catalogue file {str(path)!r}: expected one array (.npy), not an archive")
    return _checked_array(array, f"catalogue file {str(path)!r}")


def _checked_array(array: np.ndarray, where: str) -> np.ndarray:
    if array.ndim != 2:
        raise _error(f"{where}: expected a 2-D [num_items, width] array, got shape {tuple(array.shape)}")
    if array.dtype.kind not in "iu":
        raise _error(f"{where}: expected integer token ids, got dtype {array.dtype}")
    if array.dtype.kind == "u" and array.size and int(array.max()) > np.iinfo(np.int64).max:
        raise _error(f"{where}: token ids above the int64 range")
    array = array.astype(np.int64, copy=False)
    below = array < PAD
    if below.any():
        row, column = (int(x) for x in np.argwhere(below)[0])
        raise _error(f"{where}: item {row} holds {int(array[row, column])}: token ids are >= 0 "
                     f"(-1 pads a row after its last token)")
    return array


def _parquet(path: Path) -> np.ndarray:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise _error(f"catalogue file {str(path)!r}: reading .parquet needs pyarrow, which is not installed: "
                     "pip install 'widebeam[catalogue]' (or pyarrow), or use .jsonl or .npy") from None
    where = f"catalogue file {str(path)!r}"
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        raise _error(f"{where}: not a readable Parquet file: {exc}") from None
    if table.num_rows == 0 or table.num_columns == 0:
        raise _error(f"{where} holds no items")
    list_columns = [f.name for f in table.schema
                    if pa.types.is_list(f.type) or pa.types.is_large_list(f.type)
                    or pa.types.is_fixed_size_list(f.type)]
    if len(list_columns) > 1:
        raise _error(f"{where}: several list columns ({', '.join(list_columns)}); keep the items' one")
    if list_columns:
        return _list_column(table.column(list_columns[0]).combine_chunks(), list_columns[0], where)
    for field in table.schema:
        if not pa.types.is_integer(field.type):
            raise _error(f"{where}: column {field.name!r} is {field.type}: give one list<int> column "
                         "of items, or only integer columns (one token each)")
    columns = [table.column(i).combine_chunks() for i in range(table.num_columns)]
    array = np.stack([np.asarray(c.fill_null(PAD).to_numpy(zero_copy_only=False), dtype=np.int64)
                      for c in columns], axis=1)
    return _checked_array(array, where)


def _list_column(column, name: str, where: str) -> np.ndarray:
    import pyarrow as pa

    if column.null_count:
        row = int(np.argmax(np.asarray(column.is_null().to_numpy(zero_copy_only=False))))
        raise _error(f"{where}: column {name!r}, row {row} is null")
    if not pa.types.is_integer(column.type.value_type):
        raise _error(f"{where}: column {name!r} holds {column.type.value_type}, not integer token ids")
    if pa.types.is_fixed_size_list(column.type):
        width = column.type.list_size
        values = column.flatten().fill_null(PAD).to_numpy(zero_copy_only=False)
        return _checked_array(np.asarray(values, dtype=np.int64).reshape(len(column), width), where)
    offsets = np.asarray(column.offsets.to_numpy(zero_copy_only=False), dtype=np.int64)
    values = column.flatten()
    if values.null_count:
        raise _error(f"{where}: column {name!r} holds null token ids")
    values = np.asarray(values.to_numpy(zero_copy_only=False), dtype=np.int64)
    lengths = np.diff(offsets)
    if (lengths == 0).any():
        raise _error(f"{where}: column {name!r}, row {int(np.argmax(lengths == 0))} is an empty item")
    if (values < 0).any():
        raise _error(f"{where}: column {name!r} holds negative token ids")
    width = int(lengths.max())
    array = np.full((len(lengths), width), PAD, dtype=np.int64)
    rows = np.repeat(np.arange(len(lengths)), lengths)
    positions = np.arange(len(values)) - np.repeat(offsets[:-1] - offsets[0], lengths)
    array[rows, positions] = values
    return array


# -- sizes ------------------------------------------------------------------------------------------
def trie_size(items: np.ndarray | list[list[int]]) -> tuple[int, int, int]:
    """(distinct items, trie nodes including the root, longest item) of the trie that
    `Catalogue.from_sequences(items)` builds, counted the same way (sorted rows; a row opens a node at
    depth d where its first d tokens differ from the row before), in numpy alone."""
    if isinstance(items, np.ndarray):
        array = items.astype(np.int64, copy=False)
    else:
        width = max((len(item) for item in items), default=0)
        array = np.full((len(items), max(width, 1)), PAD, dtype=np.int64)
        for i, item in enumerate(items):
            array[i, :len(item)] = item
    if array.ndim != 2 or array.shape[0] == 0:
        return 0, 1, 0
    lengths = (array != PAD).sum(axis=1)
    array = array[np.lexsort(array.T[::-1])]
    different = np.zeros(array.shape[0], dtype=bool)
    different[0] = True
    num_nodes = 1
    ends = np.zeros(array.shape[0], dtype=bool)  # a row ends a distinct item (its full prefix is new)
    sorted_lengths = (array != PAD).sum(axis=1)
    for depth in range(1, array.shape[1] + 1):
        column = array[:, depth - 1]
        valid = column != PAD
        different[1:] |= column[1:] != column[:-1]
        opens = valid & different
        num_nodes += int(opens.sum())
        ends |= opens & (sorted_lengths == depth)
    return int(ends.sum()), num_nodes, int(lengths.max())
