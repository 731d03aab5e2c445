"""Sliding-window pools through the engine: no false rejections, honest ones, and every block back."""

from __future__ import annotations

import pytest
from tiny_models import save_tiny_model

from widebeam.errors import RequestTooLargeError
from widebeam.kv.budget import full_attention_blocks
from widebeam.llm import LLM
from widebeam.params import BeamSearchParams, SamplingParams

WINDOW = 8


@pytest.fixture(scope="module")
def gemma3_llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-gemma3-admission")
    save_tiny_model(path, "gemma3_text", num_hidden_layers=6, tie_word_embeddings=True, head_dim=16,
                    sliding_window=WINDOW, layer_types=["sliding_attention"] * 5 + ["full_attention"])
    return LLM(str(path), device="cpu", tokens_per_block=4, kv_cache_memory=560 * 1024,
               max_num_batched_tokens=16, max_beam_width=64)


def pools(llm):
    return llm.stats()["pools"]


def test_windowed_need_is_admitted_where_full_attention_would_reject(gemma3_llm):
    llm = gemma3_llm
    sliding = f"sliding_{WINDOW}"
    capacity = pools(llm)[sliding]["total_blocks"]
    prompt, params = list(range(3, 43)), BeamSearchParams(beam_width=4, max_new_tokens=30, ignore_eos=True)
    as_full_attention = full_attention_blocks(len(prompt), 30, 4, 4)
    (output,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    required = output.required_blocks[sliding]
    assert required <= capacity < as_full_attention  # the full-attention estimate would have rejected it
    assert len(output.outputs) == 4 and all(len(c.token_ids) == 30 for c in output.outputs)
    assert output.peak_blocks[sliding] <= required
    assert output.peak_blocks["self"] <= output.required_blocks["self"] == as_full_attention
    assert all(p["free_blocks"] == p["total_blocks"] for p in pools(llm).values())


def test_truly_infeasible_request_is_rejected_naming_the_sliding_pool(gemma3_llm):
    llm = gemma3_llm
    with pytest.raises(RequestTooLargeError, match=f"'sliding_{WINDOW}'") as info:
        llm.generate([{"prompt_token_ids": list(range(3, 43))}],
                     BeamSearchParams(beam_width=32, max_new_tokens=30), use_tqdm=False)
    assert info.value.pool == f"sliding_{WINDOW}"
    assert 1 <= info.value.beam_width_that_fits < 32  # the pool 'self' alone would take all 32
    # and the engine keeps serving
    (out,) = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_new_tokens=5, temperature=0,
                                                                           ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 5
    assert all(p["free_blocks"] == p["total_blocks"] for p in pools(llm).values())


def test_long_generation_holds_a_bounded_window(gemma3_llm):
    """A greedy sequence far longer than the window never holds more than its windowed bound."""
    llm = gemma3_llm
    (out,) = llm.generate([{"prompt_token_ids": list(range(3, 23))}],
                          SamplingParams(max_new_tokens=120, temperature=0, ignore_eos=True), use_tqdm=False)
    sliding = f"sliding_{WINDOW}"
    assert out.peak_blocks[sliding] <= out.required_blocks[sliding] <= 2 + (WINDOW + 16) // 4 + 1
    assert out.required_blocks["self"] == -(-(20 + 120) // 4)
