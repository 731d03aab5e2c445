"""`LLM(model="owner/name")` and `widebeam plan --model owner/name` from a local Hugging Face cache, built
here in the hub's layout (models--owner--name/refs/main, snapshots/<commit>/...): offline first, and a
clear error naming the id and the cache directory when the repo is neither cached nor reachable. No
test reaches a hub: the unreachable case points the hub at a closed loopback port."""

from __future__ import annotations

import shutil

import pytest

from widebeam.llm import LLM
from widebeam.model.loading.arch import load_arch
from widebeam.model.loading.hub import looks_like_repo_id
from widebeam.model.loading.sources import ModelNotFoundError
from widebeam.params import BeamSearchParams

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path, tiny_marian_dir, monkeypatch):
    cache = tmp_path / "hub"
    repo = cache / "models--acme--tiny-marian"
    snapshot = repo / "snapshots" / COMMIT
    shutil.copytree(tiny_marian_dir, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_a_cached_repo_id_loads_offline_and_generates_like_its_directory(hub_cache, tiny_marian_dir):
    kwargs = {"dtype": "float32", "device": "cpu", "kv_cache_memory": "4MiB", "max_beam_width": 4}
    by_id = LLM("acme/tiny-marian", **kwargs)
    by_dir = LLM(str(tiny_marian_dir), **kwargs)
    params = BeamSearchParams(beam_width=4, max_new_tokens=6)
    source = {"prompt_token_ids": [5, 17, 33, 9, 2]}
    (a,) = by_id.generate([source], params, use_tqdm=False)
    (b,) = by_dir.generate([source], params, use_tqdm=False)
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    snapshot = hub_cache / "models--acme--tiny-marian" / "snapshots" / COMMIT
    assert by_id.engine.source.path == snapshot.resolve()


def test_plan_reads_a_cached_repo_config(hub_cache):
    arch = load_arch("acme/tiny-marian")
    assert arch.model_type == "marian" and arch.is_encoder_decoder


def test_an_uncached_repo_offline_names_the_id_and_the_cache(hub_cache):
    with pytest.raises(ModelNotFoundError) as excinfo:
        LLM("acme/not-there", dtype="float32", device="cpu", kv_cache_memory="4MiB")
    message = str(excinfo.value)
    assert "acme/not-there" in message and str(hub_cache) in message and "HF_HUB_OFFLINE" in message


def test_an_unreachable_hub_names_the_id_and_the_cache(hub_cache, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # discard port: nothing listens
    with pytest.raises(ModelNotFoundError) as excinfo:
        LLM("acme/not-there", dtype="float32", device="cpu", kv_cache_memory="4MiB")
    message = str(excinfo.value)
    assert "acme/not-there" in message and str(hub_cache) in message and "downloadable" in message


@pytest.mark.parametrize("model, expected", [("facebook/nllb-200-distilled-600M", True), ("t5-small", False),
                                             ("a/b/c", False), ("/abs/path", False), ("./x/y", False)])
def test_repo_id_shape(model, expected):
    assert looks_like_repo_id(model) is expected
