"""`widebeam plan` and a built engine lay out the same start-up: the same pools, blocks per pool,
`max_seq_len`, pinned blocks, activation rows and KV budget, for a plain model, Gemma 3's sliding
pools, a draft model (D = 4 at W = 16), pinned prefixes and a catalogue.

Both take the same budget path: the engine is told its device has what plan's --memory leaves once
the weights and the catalogue are loaded (`available_memory_bytes`), and gets a `kv_cache_memory`
too large to bind, so it estimates its activations from shapes as plan does instead of measuring.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from widebeam import startup as startup_module
from widebeam.catalogue.sizing import CataloguePlan, catalogue_nbytes
from widebeam.catalogue.sources import trie_size
from widebeam.config import SpeculativeConfig
from widebeam.engine import LLMEngine
from widebeam.layout import estimate_activation_reserve
from widebeam.model.loading.arch import load_arch
from widebeam.plan import PlanInputs, plan

T = 4
KV_BYTES = 3 << 20  # about what the plan leaves the pools: small enough that a few rows of logits move blocks


def plan_and_engine(monkeypatch, model_dir, beam_width: int = 4, draft_dir=None,
                    num_speculative_tokens: int = 4, pins: list[list[int]] = (),
                    catalogue_items: list[list[int]] | None = None, kv_cache_dtype: str = "auto"):
    """(plan's JSON, the engine) for one setting, the engine started as plan assumes."""
    arch = load_arch(str(model_dir))
    draft_arch = load_arch(str(draft_dir)) if draft_dir is not None else None
    speculative = SpeculativeConfig("draft", str(draft_dir), num_speculative_tokens) if draft_dir else None
    catalogue = None
    if catalogue_items is not None:
        num_items, num_nodes, max_item_tokens = trie_size(catalogue_items)
        catalogue = CataloguePlan(catalogue_nbytes(num_nodes), num_items, num_nodes, max_item_tokens,
                                  exact=True)

    inputs = PlanInputs(memory_bytes=0, beam_width=beam_width, prompt_len=40, max_new_tokens=8,
                        tokens_per_block=T, dtype="float32", speculative=speculative, catalogue=catalogue,
                        pinned_prefixes=tuple(tuple(ids) for ids in pins), kv_cache_dtype=kv_cache_dtype)
    # --memory: the weights, the activation reserve and the catalogue, and KV_BYTES beside them
    weight_bytes = arch.weight_bytes("float32")
    weight_bytes += draft_arch.weight_bytes("float32") if draft_arch else 0
    catalogue_bytes = catalogue.nbytes if catalogue is not None else 0
    memory_bytes = (weight_bytes
                    + estimate_activation_reserve(inputs.engine_config(), arch, draft_arch).nbytes
                    + catalogue_bytes + KV_BYTES)
    result = plan(arch, replace(inputs, memory_bytes=memory_bytes), draft_arch)
    available_bytes = memory_bytes - result["weight_bytes"] - catalogue_bytes
    monkeypatch.setattr(startup_module, "available_memory_bytes", lambda device: available_bytes)
    kwargs = {"speculative_model": str(draft_dir), "num_speculative_tokens": num_speculative_tokens} \
        if draft_dir else {}
    engine = LLMEngine(str(model_dir), catalogues={"items": catalogue_items} if catalogue_items else None,
                       device="cpu", dtype="float32", tokens_per_block=T, max_beam_width=beam_width,
                       kv_cache_memory=memory_bytes, pinned_prefixes=pins, kv_cache_dtype=kv_cache_dtype,
                       **kwargs)
    return result, engine


def assert_same_layout(result: dict, engine: LLMEngine) -> None:
    pools = engine.stats()["pools"]
    assert [p["name"] for p in result["pools"]] == list(pools)
    assert {p["name"]: p["total_blocks"] for p in result["pools"]} == \
        {name: pool["total_blocks"] for name, pool in pools.items()}
    assert {p["name"]: p["pinned_blocks"] for p in result["pools"]} == engine.pinned_blocks
    assert result["max_seq_len"] == engine.max_seq_len
    assert result["activation_rows"] == engine.layout.activation_rows
    assert result["activation_reserve_bytes"] == engine.layout.activation_bytes
    assert result["kv_cache_bytes"] == engine.layout.kv_cache_bytes


def assert_pools_hold_their_bytes(engine: LLMEngine) -> None:
    """Each pool's tensors (an int8 pool's scales included) hold exactly its blocks x the spec's bytes
    per block: the accounting counts what is allocated, to the byte."""
    specs = {spec.name: spec for spec in engine.layout.specs}
    for worker in engine.workers:
        runner = worker.runner
        for local, scoped in worker.pool_names.items():
            allocated = runner.kv_tensors[local].nbytes
            if local in runner.kv_scales:
                allocated += runner.kv_scales[local].nbytes
            spec = specs[scoped]
            assert allocated == engine.layout.blocks_per_pool[scoped] * spec.bytes_per_block(T), scoped


@pytest.mark.parametrize("kv_cache_dtype, bytes_per_value", [("auto", 4), ("float32", 4), ("bfloat16", 2),
                                                             ("float16", 2), ("int8", 1)])
def test_each_kv_cache_dtype(monkeypatch, tiny_gemma3_dir, kv_cache_dtype, bytes_per_value):
    """Sliding pools and a full one, every KV dtype: plan == engine per pool, the tensors hold the bytes
    counted, and the pools' bytes per token are the dtype's (plus an int8 pool's float16 scales)."""
    result, engine = plan_and_engine(monkeypatch, tiny_gemma3_dir, kv_cache_dtype=kv_cache_dtype)
    assert_same_layout(result, engine)
    assert_pools_hold_their_bytes(engine)
    for spec in engine.layout.specs:
        # an int8 pool: a float16 scale per group of >= 32 values (one group below 64 values)
        groups = max(spec.head_dim // 32, 1)
        per_head = spec.head_dim * bytes_per_value + (2 * groups if kv_cache_dtype == "int8" else 0)
        assert spec.bytes_per_token == 2 * spec.num_layers * spec.num_kv_heads * per_head
    assert result["kv_cache_dtype"] == ("float32" if kv_cache_dtype == "auto" else kv_cache_dtype)


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "int8"])
def test_a_draft_model_with_each_kv_cache_dtype(monkeypatch, tiny_llama_dir, kv_cache_dtype):
    result, engine = plan_and_engine(monkeypatch, tiny_llama_dir, beam_width=16, draft_dir=tiny_llama_dir,
                                     kv_cache_dtype=kv_cache_dtype)
    assert_same_layout(result, engine)
    assert_pools_hold_their_bytes(engine)
    assert {spec.dtype for spec in engine.layout.specs} == {kv_cache_dtype}


def test_a_plain_model(monkeypatch, tiny_llama_dir):
    result, engine = plan_and_engine(monkeypatch, tiny_llama_dir)
    assert_same_layout(result, engine)
    assert [p["name"] for p in result["pools"]] == ["self"] and result["activation_rows"] == 4


def test_gemma3_sliding_pools(monkeypatch, tiny_gemma3_dir):
    result, engine = plan_and_engine(monkeypatch, tiny_gemma3_dir)
    assert_same_layout(result, engine)
    assert any(p["kind"] == "sliding" for p in result["pools"])


def test_a_draft_model_with_d4_at_w16(monkeypatch, tiny_llama_dir):
    result, engine = plan_and_engine(monkeypatch, tiny_llama_dir, beam_width=16, draft_dir=tiny_llama_dir)
    assert_same_layout(result, engine)
    assert [p["name"] for p in result["pools"]] == ["self", "draft"]
    assert result["activation_rows"] == 16 * (1 + 2 * 4)


def test_pinned_prefixes(monkeypatch, tiny_gemma3_dir):
    prefix = [(7 * i) % 120 + 3 for i in range(43)]
    pins = [prefix, prefix[:30] + [7] * 20]  # the second shares the first's 7 leading blocks
    result, engine = plan_and_engine(monkeypatch, tiny_gemma3_dir, pins=pins)
    assert_same_layout(result, engine)
    assert engine.pinned_blocks["self"] == 43 // T + 50 // T - 30 // T
    assert any(n for name, n in engine.pinned_blocks.items() if name != "self")  # the sliding pools pin too


def test_a_catalogue(monkeypatch, tiny_llama_dir):
    items = [[5, 6, 7], [5, 6, 8], [9, 10], [11, 12, 13, 14]]
    result, engine = plan_and_engine(monkeypatch, tiny_llama_dir, catalogue_items=items)
    assert result["catalogue"]["bytes"] == engine.catalogue_bytes == engine.layout.catalogue_bytes
    assert_same_layout(result, engine)


@pytest.mark.parametrize("text", [False, True])
def test_the_engine_refuses_pins_the_layout_cannot_hold(tiny_llama_dir, text):
    """A pin the layout refuses is refused before any pool is allocated, with the layout's message."""
    from widebeam.errors import InvalidParameterError

    pin = "short" if text else [1, 2, 3]
    with pytest.raises(InvalidParameterError, match="fewer than one block|cannot be tokenized") as exc:
        LLMEngine(str(tiny_llama_dir), device="cpu", tokens_per_block=T, kv_cache_memory="1MiB",
                  pinned_prefixes=[pin])
    assert exc.value.param == "pinned_prefixes"


def test_the_layout_is_torch_free():
    import subprocess
    import sys

    code = "import sys, widebeam.layout, widebeam.plan; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.strip() == "False", out.stderr


def test_the_engine_checks_its_pins_against_the_layout(tiny_llama_dir):
    from widebeam.pinning import pin_prefixes

    engine = LLMEngine(str(tiny_llama_dir), device="cpu", tokens_per_block=T, kv_cache_memory="1MiB")
    assert engine.pinned_blocks == engine.layout.pinned_blocks == {"self": 0}
    with pytest.raises(RuntimeError, match="the start-up layout counted"):
        # a layout that counted no pins
        pin_prefixes([list(range(3, 23))], engine.layout, engine.cache, engine.add_request, engine.step,
                     engine.has_unfinished)
