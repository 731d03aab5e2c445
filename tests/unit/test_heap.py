"""Long-lived processes freeze start-up's objects (widebeam/heap.py): `generate`, `serve`, a batch
engine and `bench` do it once their engine is built; `LLM(...)` alone leaves the collector as it is.
The conftest hands the frozen objects back after each test."""

from __future__ import annotations

import gc
import types

import pytest

from widebeam.cli import main
from widebeam.errors import WidebeamError
from widebeam.heap import freeze_startup_heap


class Stop(WidebeamError):
    """Raised by a fake once the command got past the point under test."""


def test_freezing_takes_every_live_object_out_of_a_full_collection():
    keep = [[i, [i]] for i in range(10_000)]  # tracked objects that stay alive
    assert len(gc.get_objects()) > 10_000
    frozen = freeze_startup_heap()
    assert frozen >= 10_000 and gc.get_freeze_count() == frozen
    assert len(gc.get_objects()) < 1_000  # what a full collection walks now
    assert keep[-1][1] == [9_999]


def test_an_llm_alone_leaves_the_collector_as_it_is(tiny_llama_dir):
    from widebeam.llm import LLM

    LLM(str(tiny_llama_dir), kv_cache_memory="16MiB")
    assert gc.get_freeze_count() == 0


def test_a_batch_engine_freezes_once_built(tiny_llama_dir):
    from widebeam.batch.local import BatchEngine

    BatchEngine(str(tiny_llama_dir), kv_cache_memory="16MiB")
    assert gc.get_freeze_count() > 0


def test_generate_freezes_before_it_generates(monkeypatch):
    frozen_at_generate = []

    class FakeLLM:
        def __init__(self, model="m", **kwargs):
            self.engine = types.SimpleNamespace(apply_chat_template=lambda text: text)

        def generate(self, prompts, params, use_tqdm=False):
            frozen_at_generate.append(gc.get_freeze_count())
            raise Stop("stopped after the freeze")

    monkeypatch.setattr("widebeam.llm.LLM", FakeLLM)
    with pytest.raises(SystemExit):
        main(["generate", "p"])
    assert frozen_at_generate and frozen_at_generate[0] > 0


def test_serve_freezes_before_it_serves(monkeypatch):
    frozen_at_app = []
    monkeypatch.setattr("widebeam.engine.LLMEngine", lambda model, **kwargs: object())

    def create_app(engine, **kwargs):
        frozen_at_app.append(gc.get_freeze_count())
        raise Stop("stopped after the freeze")

    monkeypatch.setattr("widebeam.server.api.create_app", create_app)
    with pytest.raises(Stop):
        main(["serve", "--model", "m"])
    assert frozen_at_app and frozen_at_app[0] > 0
