"""Catalogue files (widebeam/catalogue/sources.py): .jsonl (token ids, strings, objects), .npy and
.parquet read into items that build the same trie as the list they hold; malformed files are a
`CatalogueError` naming the file and, for JSONL, the line."""

from __future__ import annotations

import json

import numpy as np
import pytest

from widebeam.catalogue.sources import load_items, trie_size
from widebeam.catalogue.trie import Catalogue, CatalogueError

ITEMS = [[5, 6, 7], [5, 6], [9], [5, 8, 1, 2]]


def _write_jsonl(path, lines):
    """Lines as given where they are strings (raw JSON text), else JSON-encoded."""
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def _padded(items):
    width = max(len(i) for i in items)
    return np.array([i + [-1] * (width - len(i)) for i in items], dtype=np.int64)


def _same_catalogue(items, expected=ITEMS):
    a, b = Catalogue.from_sequences(items, 100), Catalogue.from_sequences(expected, 100)
    assert (a.num_items, a.num_nodes, a.max_item_tokens) == (b.num_items, b.num_nodes, b.max_item_tokens)
    for item in expected:
        assert a.contains(item)


# -- JSONL -------------------------------------------------------------------------------------------
def test_jsonl_token_lists_objects_and_blank_lines(tmp_path):
    path = _write_jsonl(tmp_path / "c.jsonl", [ITEMS[0], {"tokens": ITEMS[1], "id": "sku-1"}, "",
                                              {"token_ids": ITEMS[2]}, ITEMS[3]])
    assert load_items(path) == ITEMS
    _same_catalogue(load_items(str(path)))


@pytest.mark.parametrize("line, fragment", [
    ("[1, 2", "line 2: not valid JSON"),
    ("[1, 2.5]", "line 2: token 1 is 2.5: token ids must be integers"),
    ("[1, true]", "line 2: token 1 is true: token ids must be integers"),
    ('[1, "a"]', 'line 2: token 1 is "a"'),
    ("[3, -4]", "line 2: token 1 is -4: token ids must be >= 0"),
    ("[]", "line 2: an empty list is no item"),
    ('""', "line 2: an empty string is no item"),
    ("42", "line 2: expected a list of token ids, a string, or an object"),
    ("null", "line 2: expected a list"),
    ('{"id": 3}', "line 2: an object item needs exactly one of 'tokens'"),
    ('{"tokens": [1], "text": "a"}', "found both 'tokens' and 'text'"),
    ('{"tokens": "abc"}', "line 2: 'tokens' must be a list of token ids"),
    ('{"text": [1, 2]}', "line 2: 'text' must be a string"),
])
def test_jsonl_malformed_line_names_its_number(tmp_path, line, fragment):
    path = _write_jsonl(tmp_path / "bad.jsonl", [[1, 2], line, [3]])
    with pytest.raises(CatalogueError) as exc:
        load_items(path)
    assert fragment in str(exc.value) and "bad.jsonl" in str(exc.value)


def test_jsonl_strings_need_a_tokenizer(tmp_path):
    path = _write_jsonl(tmp_path / "s.jsonl", [[1, 2], "", json.dumps("red shoes")])
    with pytest.raises(CatalogueError, match="line 3: a string item needs the model's tokenizer"):
        load_items(path)


def test_jsonl_empty_file(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    with pytest.raises(CatalogueError, match="holds no items"):
        load_items(path)


def test_jsonl_strings_with_the_smollm2_tokenizer(tmp_path, smollm2):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2[1].path))
    texts = ["blue running shoes", " a red hat", "Zürich"]
    path = _write_jsonl(tmp_path / "t.jsonl", [json.dumps(texts[0]), {"text": texts[1], "sku": 7}, [11, 12],
                                              json.dumps(texts[2])])
    items = load_items(path, tokenizer)
    expected = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    assert items == [expected[0], expected[1], [11, 12], expected[2]]
    assert all(tokenizer.bos_token_id not in item for item in items)
    catalogue = Catalogue.from_sequences(items, len(tokenizer))
    assert catalogue.num_items == 4 and all(catalogue.contains(item) for item in items)


def test_unknown_suffix_and_missing_file(tmp_path):
    with pytest.raises(CatalogueError, match=r"unknown type '\.csv'; use one of \.jsonl, \.npy, \.parquet"):
        load_items(tmp_path / "items.csv")
    with pytest.raises(CatalogueError, match="does not exist"):
        load_items(tmp_path / "missing.jsonl")


# -- .npy --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.int16, np.uint16])
def test_npy_padded_array(tmp_path, dtype):
    array = _padded(ITEMS)
    if np.dtype(dtype).kind == "u":  # unsigned files pad nothing: fixed-width items
        array = np.array([[5, 6, 7], [9, 1, 2]])
        expected = [[5, 6, 7], [9, 1, 2]]
    else:
        expected = ITEMS
    np.save(tmp_path / "c.npy", array.astype(dtype))
    loaded = load_items(tmp_path / "c.npy")
    assert loaded.dtype == np.int64 and loaded.shape == array.shape
    _same_catalogue(loaded, expected)


def test_npy_is_never_unpickled(tmp_path):
    np.save(tmp_path / "obj.npy", np.array([[1, 2], [3]], dtype=object), allow_pickle=True)
    with pytest.raises(CatalogueError, match="never unpickled"):
        load_items(tmp_path / "obj.npy")


@pytest.mark.parametrize("array, fragment", [
    (np.array([1, 2, 3]), "expected a 2-D [num_items, width] array, got shape (3,)"),
    (np.array([[1.0, 2.0]]), "expected integer token ids, got dtype float64"),
    (np.array([[1, 2], [3, -2]]), "item 1 holds -2"),
])
def test_npy_malformed(tmp_path, array, fragment):
    np.save(tmp_path / "bad.npy", array)
    with pytest.raises(CatalogueError) as exc:
        load_items(tmp_path / "bad.npy")
    assert fragment in str(exc.value)


# -- .parquet ----------------------------------------------------------------------------------------
def test_parquet_list_column_with_an_id_column(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table = pa.table({"item_id": list(range(len(ITEMS))),
                      "tokens": pa.array(ITEMS, type=pa.list_(pa.int32()))})
    pq.write_table(table, tmp_path / "c.parquet", row_group_size=2)  # two chunks
    loaded = load_items(tmp_path / "c.parquet")
    np.testing.assert_array_equal(loaded, _padded(ITEMS))
    _same_catalogue(loaded)


def test_parquet_fixed_size_list(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    items = [[1, 2, 3, 4], [1, 2, 3, 5], [7, 7, 7, 7]]
    pq.write_table(pa.table({"sid": pa.array(items, type=pa.list_(pa.int64(), 4))}), tmp_path / "f.parquet")
    np.testing.assert_array_equal(load_items(tmp_path / "f.parquet"), np.array(items))


def test_parquet_integer_columns_nulls_pad(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    array = _padded(ITEMS)
    columns = {f"t{j}": pa.array([None if v == -1 else int(v) for v in array[:, j]], type=pa.int32())
               for j in range(array.shape[1])}
    pq.write_table(pa.table(columns), tmp_path / "cols.parquet")
    np.testing.assert_array_equal(load_items(tmp_path / "cols.parquet"), array)


@pytest.mark.parametrize("columns, fragment", [
    ({"a": [[1]], "b": [[2]]}, "several list columns (a, b)"),
    ({"t0": [1], "name": ["x"]}, "column 'name' is string"),
    ({"tokens": [[1, 2], []]}, "row 1 is an empty item"),
    ({"tokens": [[1, 2], None]}, "row 1 is null"),
    ({"tokens": [[1, -3]]}, "negative token ids"),
    ({"tokens": [["a"]]}, "not integer token ids"),
])
def test_parquet_malformed(tmp_path, columns, fragment):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table(columns), tmp_path / "bad.parquet")
    with pytest.raises(CatalogueError) as exc:
        load_items(tmp_path / "bad.parquet")
    assert fragment in str(exc.value)


def test_parquet_without_pyarrow_is_a_clear_error(tmp_path, monkeypatch):
    import builtins

    (tmp_path / "c.parquet").write_bytes(b"PAR1")
    real_import = builtins.__import__

    def no_pyarrow(name, *args, **kwargs):
        if name.startswith("pyarrow"):
            raise ImportError(name=name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pyarrow)
    with pytest.raises(CatalogueError, match=r"needs pyarrow.*pip install 'widebeam\[catalogue\]'"):
        load_items(tmp_path / "c.parquet")


# -- trie sizes without torch -------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(5))
def test_trie_size_matches_the_built_trie(seed):
    rng = np.random.default_rng(seed)
    items = [list(rng.integers(0, 6, size=rng.integers(1, 5))) for _ in range(rng.integers(1, 60))]
    items = [[int(t) for t in item] for item in items] + [items[0]]  # a duplicate
    catalogue = Catalogue.from_sequences(items, 6)
    assert trie_size(items) == (catalogue.num_items, catalogue.num_nodes, catalogue.max_item_tokens)
    assert trie_size(_padded(items)) == trie_size(items)
