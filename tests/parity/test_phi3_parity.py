"""widebeam's Phi-3 (the unified decoder, its fused qkv_proj / gate_up_proj checkpoint tensors split
at load time) against transformers on tiny random models (float32): logits of prefill and decode,
greedy tokens, beam sequences and scores.

Two models (`tiny_phi3_dir`): "w8-partial" (every layer in a window of 8, shorter than the prompts,
so the only pool is sliding_8; half of each head rotated) and "full" (no window, as many KV heads as
query heads, another RoPE base).
"""

from __future__ import annotations

import json

import pytest
import torch
from beam_checks import assert_beams_match
from transformers import AutoModelForCausalLM

from widebeam.engine import LLM
from widebeam.kv.managers import Holding
from widebeam.model.runner import SequenceInput
from widebeam.params import BeamSearchParams, SamplingParams

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
def hf(tiny_phi3_dir):
    return AutoModelForCausalLM.from_pretrained(str(tiny_phi3_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llms(tiny_phi3_dir):
    """Engines by tokens_per_block, shared by the generate tests; each test checks every block came back."""
    return {}


def get_llm(llms, path, tokens_per_block):
    if tokens_per_block not in llms:
        llms[tokens_per_block] = LLM(str(path), dtype="float32", device="cpu", tokens_per_block=tokens_per_block,
                                     kv_cache_memory="16MiB", max_num_batched_tokens=64, max_beam_width=16)
    return llms[tokens_per_block]


def new_tables(engine):
    return {name: manager.new_table(Holding()) for name, manager in engine.cache.managers.items()}


def seq_input(engine, tables, token_ids, num_computed):
    slots = {name: engine.cache[name].append_slots(table, len(token_ids)) for name, table in tables.items()}
    return SequenceInput(list(token_ids), num_computed, {name: t.block_ids for name, t in tables.items()}, slots)


def assert_all_blocks_free(llm):
    for name, stats in llm.stats()["pools"].items():
        assert stats["free_blocks"] == stats["total_blocks"], name


def test_pools_follow_the_config(tiny_phi3_dir, llms):
    config = json.loads((tiny_phi3_dir / "config.json").read_text())
    engine = get_llm(llms, tiny_phi3_dir, 4).engine
    window = config["sliding_window"]
    expected = [f"sliding_{window}" if window else "self"] * config["num_hidden_layers"]
    assert engine.model.layer_pool_names == expected
    assert sorted(engine.cache.managers) == sorted(set(expected))


@pytest.mark.parametrize("tokens_per_block", [1, 3])
def test_prefill_and_decode_logits_match(tiny_phi3_dir, hf, tokens_per_block):
    engine = LLM(str(tiny_phi3_dir), dtype="float32", device="cpu", tokens_per_block=tokens_per_block,
                 kv_cache_memory="8MiB", max_num_batched_tokens=128).engine
    num_decode = 10  # the shortest prompt passes the window while decoding
    assert engine.model.model.layers[0].self_attn.q_proj.weight.shape[0] == 64  # split from qkv_proj
    decoded = [[(7 * step + 3 * i) % 120 + 3 for step in range(num_decode)] for i in range(len(PROMPTS))]
    with torch.no_grad():
        expected = [hf(torch.tensor([p + d])).logits[0] for p, d in zip(PROMPTS, decoded)]
    tables = [new_tables(engine) for _ in PROMPTS]
    # All prompts (different lengths) in one forward, logits of every token.
    logits = engine.runner.execute([seq_input(engine, t, p, 0) for p, t in zip(PROMPTS, tables)], all_logits=True)
    offset = 0
    for prompt, exp in zip(PROMPTS, expected):
        torch.testing.assert_close(logits[offset:offset + len(prompt)], exp[:len(prompt)], atol=1e-4, rtol=1e-4)
        offset += len(prompt)
    for step in range(num_decode):
        inputs = [seq_input(engine, t, [d[step]], len(p) + step) for p, d, t in zip(PROMPTS, decoded, tables)]
        for row, prompt, exp in zip(engine.runner.execute(inputs), PROMPTS, expected):
            torch.testing.assert_close(row, exp[len(prompt) + step], atol=1e-4, rtol=1e-4)


def test_greedy_generation_matches_transformers(tiny_phi3_dir, hf, llms):
    llm = get_llm(llms, tiny_phi3_dir, 4)
    params = SamplingParams(max_new_tokens=32, temperature=0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs):
        with torch.no_grad():
            expected = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                                   eos_token_id=None, pad_token_id=PAD)[0, len(prompt):].tolist()
        (completion,) = output.outputs
        assert len(expected) == 32
        assert completion.token_ids == expected
        assert completion.finish_reason == "length"
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("beam_width, tokens_per_block, length_penalty, early_stopping, num_return, min_new",
                         BEAM_CASES)
def test_beam_search_matches_transformers(tiny_phi3_dir, hf, llms, beam_width, tokens_per_block, length_penalty,
                                          early_stopping, num_return, min_new):
    llm = get_llm(llms, tiny_phi3_dir, tokens_per_block)
    max_new_tokens = 12
    params = BeamSearchParams(beam_width=beam_width, max_new_tokens=max_new_tokens, length_penalty=length_penalty,
                              early_stopping=early_stopping, num_return_sequences=num_return,
                              min_new_tokens=min_new)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs):
        with torch.no_grad():
            expected = hf.generate(torch.tensor([prompt]), num_beams=beam_width, do_sample=False,
                                   max_new_tokens=max_new_tokens, length_penalty=length_penalty,
                                   early_stopping=early_stopping, num_return_sequences=num_return,
                                   min_new_tokens=min_new, eos_token_id=EOS, pad_token_id=PAD,
                                   output_scores=True, return_dict_in_generate=True)
        assert len(output.outputs) == num_return
        assert_beams_match(output, expected, len(prompt), PAD, EOS, beam_width, f"prompt {prompt[:4]}")
        for pool, required in output.required_blocks.items():
            assert output.peak_blocks[pool] <= required, pool
    assert_all_blocks_free(llm)
