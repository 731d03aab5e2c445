"""Shared fixtures: tiny random models built with transformers and saved as safetensors."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from tiny_models import save_tiny_model

# Every engine a test builds is watched: when the test ends with nothing running or waiting on it, each
# of its pools must have every block back (free or cached-evictable), pinned prefixes aside. A leak in
# any path a test drives (finish, abort, stop strings, failures) fails that test, whatever it asserts.
_ENGINES: weakref.WeakSet = weakref.WeakSet()


def _watch_engines() -> None:
    try:
        from widebeam.engine import LLMEngine
    except Exception:  # noqa: BLE001  (an engine that cannot import fails its own tests; pure ones run)
        return

    init = LLMEngine.__init__
    if getattr(init, "_watched", False):
        return

    def watched_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        _ENGINES.add(self)

    watched_init._watched = True
    LLMEngine.__init__ = watched_init


_watch_engines()


@pytest.fixture(autouse=True)
def _engines_end_with_every_block_back():
    yield
    for engine in list(_ENGINES):
        cache = getattr(engine, "cache", None)
        if cache is None or engine.has_unfinished():
            continue  # a test that leaves requests in flight on purpose (or an engine that never started)
        for name, pool in engine.stats()["pools"].items():
            assert pool["free_blocks"] + pool["pinned_blocks"] == pool["total_blocks"], (
                f"pool {name!r} of an idle engine holds blocks: {pool}")


@pytest.fixture(autouse=True)
def _collector_unfrozen_after_each_test():
    """A command run in process (`generate`, `serve`, a batch) freezes the heap as a long-lived process
    should (widebeam/heap.py); the suite is not one, so each test hands the frozen objects back."""
    yield
    if gc.get_freeze_count():
        gc.unfreeze()


@pytest.fixture
def dense_kernel_reads_anywhere(monkeypatch):
    """The dense-cache attention kernels on whatever capability this build has: the engine keeps them to
    `kernels.DENSE_ATTENTION_CAPABILITIES` for speed (slower than the torch path on AVX2), not correctness,
    so the tests of those reads run them on every build."""
    from widebeam.model import kernels

    monkeypatch.setattr(kernels, "DENSE_ATTENTION_CAPABILITIES", (kernels._BUILT_FOR,))


# One thread: the suite runs beside server processes it starts, and two threads on two busy cores
# spin-wait on each other (measured 6x slower under load); tiny models gain nothing from two.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_model(path, "llama")
    return path


@pytest.fixture(scope="session")
def tiny_llama_head64_dir(tmp_path_factory):
    """A tiny llama with head_dim 64 and two query heads a KV head (W=4 gives 8 rows a KV head): the C++
    kernels' unrolled head size, for the tests that run them through the engine."""
    path = tmp_path_factory.mktemp("tiny-llama-head64")
    save_tiny_model(path, "llama", hidden_size=256, num_attention_heads=4, num_key_value_heads=2)
    return path


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen2")
    save_tiny_model(path, "qwen2", num_key_value_heads=1, tie_word_embeddings=True)
    return path


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    """The default model's GGUF converted once per test session: (cache_dir, ModelSource)."""
    from widebeam.model.loading import sources as loader

    cache = tmp_path_factory.mktemp("widebeam-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WIDEBEAM_CACHE", str(cache))
        source = loader.resolve_model(loader.DEFAULT_MODEL)
    return cache, source


TINY_VARIANTS = {
    "llama3-rope": ("llama",
                    {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                   "original_max_position_embeddings": 16}}),
    "linear-rope": ("llama",
                    {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}}),
    "mistral": ("mistral", {"sliding_window": None}),
}


@pytest.fixture(scope="session", params=sorted(TINY_VARIANTS))
def tiny_variant_dir(request, tmp_path_factory):
    model_type, overrides = TINY_VARIANTS[request.param]
    path = tmp_path_factory.mktemp(f"tiny-{request.param}")
    save_tiny_model(path, model_type, **overrides)
    return path


# Gemma 3 text decoders: six layers, five sliding to one full. "w8": window 8, a linearly scaled global
# RoPE in transformers 5's per-layer-type `rope_parameters`, query_pre_attn_scalar unlike head_dim, a
# final logit softcap. "w16": window 16, config.json rewritten to the 4.x flat fields (rope_theta +
# rope_scaling for global layers, rope_local_base_freq for sliding ones), and an attention softcap,
# which transformers ignores for Gemma 3.
TINY_GEMMA3 = {
    "w8": {"sliding_window": 8, "head_dim": 16, "query_pre_attn_scalar": 24, "final_logit_softcapping": 30.0,
           "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
    "w16": {"sliding_window": 16, "head_dim": 32, "query_pre_attn_scalar": 32,
            "attn_logit_softcapping": 50.0},
}
TINY_GEMMA3_FLAT_ROPE = {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "linear", "factor": 4.0},
                         "rope_local_base_freq": 100.0}


@pytest.fixture(scope="session", params=sorted(TINY_GEMMA3))
def tiny_gemma3_dir(request, tmp_path_factory):
    import json

    path = tmp_path_factory.mktemp(f"tiny-gemma3-{request.param}")
    save_tiny_model(path, "gemma3_text", num_hidden_layers=6, tie_word_embeddings=True,
                    layer_types=["sliding_attention"] * 5 + ["full_attention"], **TINY_GEMMA3[request.param])
    if request.param == "w16":
        config = json.loads((path / "config.json").read_text())
        del config["rope_parameters"]
        config.update(TINY_GEMMA3_FLAT_ROPE)
        (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


@pytest.fixture(scope="session")
def tiny_marian_dir(tmp_path_factory):
    from tiny_models import save_tiny_marian

    path = tmp_path_factory.mktemp("tiny-marian")
    save_tiny_marian(path)
    return path


# Families added through the model-family table, each on tiny models with random norm weights (so a
# skipped or misplaced norm changes the logits).
# Qwen3: q/k RMS-normed per head. "bias": head_dim 32 (not hidden / heads), q/k/v/o biases, tied
# embeddings. "sliding": layer 0 full, layers 1-2 in a window of 8 (use_sliding_window from
# max_window_layers on), so the model has two pools.
# Phi-3: fused qkv_proj / gate_up_proj checkpoints. "w8-partial": every layer in a window of 8
# (shorter than most prompts) and half of each head rotated; "full": no window, one KV head per query head.
TINY_FAMILIES = {
    "qwen3-bias": ("qwen3", {"head_dim": 32, "attention_bias": True, "tie_word_embeddings": True}),
    "qwen3-sliding": ("qwen3", {"num_hidden_layers": 3, "use_sliding_window": True, "sliding_window": 8,
                                "max_window_layers": 1}),
    "phi3-w8-partial": ("phi3", {"sliding_window": 8, "partial_rotary_factor": 0.5}),
    "phi3-full": ("phi3", {"sliding_window": None, "num_key_value_heads": 4, "rope_theta": 500.0}),
}


@pytest.fixture(scope="session", params=sorted(TINY_FAMILIES))
def tiny_family_dir(request, tmp_path_factory):
    from tiny_models import save_tiny_model_with_norms

    model_type, overrides = TINY_FAMILIES[request.param]
    path = tmp_path_factory.mktemp(f"tiny-{request.param}")
    save_tiny_model_with_norms(path, model_type, **overrides)
    return path
