"""Encoder-decoder models: the cross-attention read (fast path vs reference), the 'cross' pool in the
architecture, the plan and admission, and its blocks through the engine (allocated once, freed at
finish or abort)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from widebeam.errors import InvalidParameterError, RequestTooLargeError
from widebeam.kv.spec import CrossAttentionSpec, FullAttentionSpec
from widebeam.model.attention.cross import CrossAttentionMetadata, cross_attention
from widebeam.model.loading.arch import load_arch
from widebeam.params import BeamSearchParams, SamplingParams
from widebeam.plan import PlanInputs, plan


def cross_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              meta: CrossAttentionMetadata, scale: float) -> torch.Tensor:
    """The definition of correct for `cross_attention`, one sequence at a time (tests only):
    q: [num_tokens, heads, head_dim] -> [num_tokens, heads, head_dim]."""
    out = torch.empty_like(q)
    for i in range(meta.num_seqs):
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        slots = meta.key_slots(i, q.device)
        k = k_cache[slots]  # [E, KV, d]
        v = v_cache[slots]
        group = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(group, dim=1).float()  # [E, H, d]
        v = v.repeat_interleave(group, dim=1).float()
        scores = torch.einsum("qhd,ehd->hqe", q[start:end].float(), k) * scale
        out[start:end] = torch.einsum("hqe,ehd->qhd", torch.softmax(scores, dim=-1), v).to(q.dtype)
    return out


@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (4, 2), (6, 1)])
def test_grouped_cross_attention_matches_the_reference(num_heads, num_kv_heads):
    torch.manual_seed(0)
    t, head_dim, num_blocks = 4, 8, 32
    k_cache = torch.randn(num_blocks * t, num_kv_heads, head_dim)
    v_cache = torch.randn(num_blocks * t, num_kv_heads, head_dim)
    # Request A: 3 beams decoding (one query each); request B: a 5-token prefill; request C: 1 beam.
    # Tables are scattered and a last block is partial.
    tables = {"A": ([7, 2, 30], 11), "B": ([5], 3), "C": ([9, 1, 4, 20, 12], 17)}
    seqs = [("A", 1), ("B", 5), ("A", 1), ("C", 1), ("A", 1)]
    query_start_loc = [0]
    for _, num_queries in seqs:
        query_start_loc.append(query_start_loc[-1] + num_queries)
    meta = CrossAttentionMetadata(query_start_loc, [tables[r][0] for r, _ in seqs],
                                  [tables[r][1] for r, _ in seqs], tokens_per_block=t)
    q = torch.randn(query_start_loc[-1], num_heads, head_dim)
    expected = cross_attention_reference(q, k_cache, v_cache, meta, scale=head_dim**-0.5)
    torch.testing.assert_close(cross_attention(q, k_cache, v_cache, meta, scale=head_dim**-0.5), expected)
    groups = meta.groups(q.device)
    assert len(groups) == 3  # one K/V read per request, not per beam
    assert sorted(len(g.key_slots) for g in groups) == [3, 11, 17]


def test_marian_arch_has_a_self_pool_and_a_cross_pool():
    arch = load_arch("opus-mt-en-de")
    assert arch.is_encoder_decoder and arch.num_layers == 6 and arch.num_encoder_layers == 6
    self_spec, cross_spec = arch.kv_pool_specs("bfloat16")
    assert isinstance(self_spec, FullAttentionSpec) and isinstance(cross_spec, CrossAttentionSpec)
    assert (self_spec.name, cross_spec.name) == ("self", "cross")
    # decoder layers x K and V x kv heads x head dim x dtype bytes
    assert self_spec.bytes_per_token == cross_spec.bytes_per_token == 6 * 2 * 8 * 64 * 2
    assert arch.layer_pool_names() == ["self"] * 6 + ["cross"] * 6
    assert 73_000_000 < arch.num_params < 75_000_000  # opus-mt-en-de: ~74M parameters


def test_plan_shows_both_pools_and_cross_blocks_do_not_grow_with_beams(tiny_marian_dir):
    for model in ("opus-mt-en-de", str(tiny_marian_dir / "config.json")):
        arch = load_arch(model)
        for width in (1, 8):
            result = plan(arch,
                          PlanInputs(memory_bytes=2**30, beam_width=width, prompt_len=50, max_new_tokens=40,
                                           encoder_len=100))
            pools = {p["name"]: p for p in result["pools"]}
            assert set(pools) == {"self", "cross"}
            assert pools["cross"]["required_blocks"] == math.ceil(100 / 16)
            # decoder prompt = the start token alone
            assert pools["self"]["required_blocks"] == math.ceil((1 + 40 - 1) / 16) * width
            assert result["request"]["encoder_len"] == 100
            assert result["naive"]["cross_required_blocks"] == math.ceil(100 / 16) * width
    default = plan(load_arch("opus-mt-en-de"), PlanInputs(memory_bytes=2**30, beam_width=4, prompt_len=70,
                                                          max_new_tokens=10))
    assert default["request"]["encoder_len"] == 70


def test_plan_cli_lists_the_cross_pool():
    proc = subprocess.run([sys.executable, "-m", "widebeam", "plan", "--model", "opus-mt-en-de", "--memory",
                           "1GiB", "--beam-width", "8", "--prompt-len", "200", "--json"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    pools = {p["name"]: p for p in json.loads(proc.stdout)["pools"]}
    assert pools["cross"]["required_blocks"] == math.ceil(200 / 16) and pools["cross"]["kind"] == "cross"


@pytest.fixture(scope="module")
def small_llm(tiny_marian_dir):
    """8 blocks of 4 tokens in each pool (tiny Marian: 1 KiB per token per pool, memory split by need)."""
    from widebeam.llm import LLM

    llm = LLM(str(tiny_marian_dir), dtype="float32", device="cpu", tokens_per_block=4,
              kv_cache_memory="64KiB", max_num_batched_tokens=64, max_beam_width=8)
    pools = llm.stats()["pools"]
    assert pools["self"]["total_blocks"] == pools["cross"]["total_blocks"] == 8
    return llm


def all_free(llm) -> bool:
    return all(p["free_blocks"] == p["total_blocks"] for p in llm.stats()["pools"].values())


def test_a_source_larger_than_the_cross_pool_is_rejected_and_the_engine_keeps_serving(small_llm):
    engine = small_llm.engine
    too_long = [5] * 39 + [2]  # 40 tokens = 10 blocks of 4 > 8
    with pytest.raises(RequestTooLargeError) as info:
        engine.add_request("long", {"prompt_token_ids": too_long},
                           BeamSearchParams(beam_width=2, max_new_tokens=4))
    error = info.value
    assert (error.pool, error.required_blocks, error.capacity_blocks) == ("cross", 10, 8)
    assert "pool 'cross'" in str(error) and "encoder output has 40 tokens and at most 32 fit" in str(error)
    assert not engine.has_unfinished() and engine.stats()["rejected"] >= 1
    # a source that fills the cross pool exactly still runs, at any beam width
    fits = [5, 9, 13] * 10 + [4, 2]  # 32 tokens = 8 blocks
    for width in (1, 8):
        params = BeamSearchParams(beam_width=width, max_new_tokens=3)
        (output,) = small_llm.generate([{"prompt_token_ids": fits}], params, use_tqdm=False)
        assert output.finished and output.outputs
        assert output.required_blocks["cross"] == output.peak_blocks["cross"] == 8
        assert all_free(small_llm)


def test_a_source_past_the_model_positions_is_rejected(small_llm):
    with pytest.raises(InvalidParameterError, match="encoder takes at most 128"):
        small_llm.engine.add_request("pos", {"prompt_token_ids": [5] * 129}, SamplingParams(max_new_tokens=2))
    with pytest.raises(InvalidParameterError, match="source is empty"):
        small_llm.engine.add_request("empty", {"prompt_token_ids": []}, SamplingParams(max_new_tokens=2))


def test_cross_table_is_allocated_once_and_released_on_abort(small_llm):
    engine = small_llm.engine
    source = list(range(3, 13)) + [2]  # 11 tokens = 3 blocks
    engine.add_request("a", {"prompt_token_ids": source},
                       BeamSearchParams(beam_width=4, max_new_tokens=5, ignore_eos=True))
    free_cross = engine.cache.num_free_blocks()["cross"]
    engine.step()  # encoder + the decoder's start token
    assert free_cross - engine.cache.num_free_blocks()["cross"] == 3
    engine.step()  # 4 beams now, still the one cross table
    assert free_cross - engine.cache.num_free_blocks()["cross"] == 3
    engine.abort("a")
    assert all_free(small_llm) and not engine.has_unfinished()
