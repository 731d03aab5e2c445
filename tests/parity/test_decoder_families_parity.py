"""The families added through the model-family table against transformers on tiny random models
(float32): logits of prefill and decode, greedy tokens, beam sequences and scores.

Qwen3 (the unified decoder with per-head q/k RMSNorm before RoPE) and Phi-3 (its fused qkv_proj /
gate_up_proj checkpoint tensors split at load time, partial rotary, a window on every layer), two
tiny models each (`tiny_family_dir`, tests/conftest.py).
"""

from __future__ import annotations

import json

import pytest
import torch
from beam_checks import assert_beams_match, assert_greedy_matches_transformers, hf_beam_search
from transformers import AutoModelForCausalLM

from widebeam.kv.tables import Holding
from widebeam.llm import LLM
from widebeam.model.runner import SequenceInput
from widebeam.params import BeamSearchParams

PAD = 0
EOS = 2
PROMPTS = [[5, 17, 33, 9, 100, 3, 8], [7] * 23, list(range(3, 40)), [11, 12]]

# (beam_width, tokens_per_block, length_penalty, early_stopping, num_return_sequences, min_new_tokens)
BEAM_CASES = [
    (1, 4, 1.0, False, 1, 0),
    (4, 1, 2.0, True, 4, 2),
    (8, 4, -1.0, "never", 3, 0),
    (16, 16, 0.0, False, 16, 1),
]


@pytest.fixture(scope="module")
def hf(tiny_family_dir):
    return AutoModelForCausalLM.from_pretrained(str(tiny_family_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llms(tiny_family_dir):
    """Engines by tokens_per_block, shared by the generate tests; each test checks every block came back."""
    return {}


def get_llm(llms, path, tokens_per_block):
    if tokens_per_block not in llms:
        llms[tokens_per_block] = LLM(str(path), dtype="float32", device="cpu",
                                     tokens_per_block=tokens_per_block,
                                     kv_cache_memory="16MiB", max_num_batched_tokens=64, max_beam_width=16)
    return llms[tokens_per_block]


def new_tables(engine):
    return {name: manager.new_table(Holding()) for name, manager in engine.cache.managers.items()}


def seq_input(engine, tables, token_ids, num_computed):
    slots = {name: engine.cache[name].append_slots(table, len(token_ids)) for name, table in tables.items()}
    return SequenceInput(list(token_ids), num_computed, {name: t.block_ids for name, t in tables.items()},
                         slots)


def assert_all_blocks_free(llm):
    for name, stats in llm.stats()["pools"].items():
        assert stats["free_blocks"] == stats["total_blocks"], name


def expected_pools(config: dict) -> list[str]:
    """The pool of each layer, as transformers' modeling code applies windows."""
    window = config.get("sliding_window")
    if config["model_type"] == "phi3":  # a window, when set, on every layer
        return [f"sliding_{window}" if window else "self"] * config["num_hidden_layers"]
    return [f"sliding_{window}" if t == "sliding_attention" and config.get("use_sliding_window") else "self"
            for t in config["layer_types"]]


def test_pools_follow_the_config(tiny_family_dir, llms):
    config = json.loads((tiny_family_dir / "config.json").read_text())
    engine = get_llm(llms, tiny_family_dir, 4).engine
    expected = expected_pools(config)
    assert engine.model.layer_pool_names == expected
    assert sorted(engine.cache.managers) == sorted(set(expected))


@pytest.mark.parametrize("tokens_per_block", [1, 3])
def test_prefill_and_decode_logits_match(tiny_family_dir, hf, tokens_per_block):
    engine = LLM(str(tiny_family_dir), dtype="float32", device="cpu", tokens_per_block=tokens_per_block,
                 kv_cache_memory="8MiB", max_num_batched_tokens=128).engine
    num_decode = 10  # the shortest prompt passes the window while decoding
    # Phi-3's qkv_proj was split into q_proj / k_proj / v_proj at load time (then stacked again as one
    # float32 split linear: the q part is first)
    assert engine.model.model.layers[0].self_attn.qkv.sizes[0] == hf.config.num_attention_heads * (
        getattr(hf.config, "head_dim", None) or hf.config.hidden_size // hf.config.num_attention_heads)
    decoded = [[(7 * step + 3 * i) % 120 + 3 for step in range(num_decode)] for i in range(len(PROMPTS))]
    with torch.no_grad():
        expected = [hf(torch.tensor([p + d])).logits[0] for p, d in zip(PROMPTS, decoded)]
    tables = [new_tables(engine) for _ in PROMPTS]
    # All prompts (different lengths) in one forward, logits of every token.
    logits = engine.runner.execute([seq_input(engine, t, p, 0) for p, t in zip(PROMPTS, tables)],
                                   all_logits=True)
    offset = 0
    for prompt, exp in zip(PROMPTS, expected):
        torch.testing.assert_close(logits[offset:offset + len(prompt)], exp[:len(prompt)], atol=1e-4,
                                   rtol=1e-4)
        offset += len(prompt)
    for step in range(num_decode):
        inputs = [seq_input(engine, t, [d[step]], len(p) + step) for p, d, t in zip(PROMPTS, decoded, tables)]
        for row, prompt, exp in zip(engine.runner.execute(inputs), PROMPTS, expected):
            torch.testing.assert_close(row, exp[len(prompt) + step], atol=1e-4, rtol=1e-4)


def test_greedy_generation_matches_transformers(tiny_family_dir, hf, llms):
    llm = get_llm(llms, tiny_family_dir, 4)
    assert_greedy_matches_transformers(llm, hf, PROMPTS, PAD)
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("beam_width, tokens_per_block, length_penalty, early_stopping, num_return, min_new",
                         BEAM_CASES)
def test_beam_search_matches_transformers(tiny_family_dir, hf, llms, beam_width, tokens_per_block,
                                          length_penalty, early_stopping, num_return, min_new):
    llm = get_llm(llms, tiny_family_dir, tokens_per_block)
    max_new_tokens = 12
    params = BeamSearchParams(beam_width=beam_width, max_new_tokens=max_new_tokens,
                              length_penalty=length_penalty,
                              early_stopping=early_stopping, num_return_sequences=num_return,
                              min_new_tokens=min_new)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs):
        expected = hf_beam_search(hf, prompt, params, EOS, PAD)
        assert len(output.outputs) == num_return
        assert_beams_match(output, expected, len(prompt), PAD, EOS, beam_width, f"prompt {prompt[:4]}")
        for pool, required in output.required_blocks.items():
            assert output.peak_blocks[pool] <= required, pool
    assert_all_blocks_free(llm)
