"""Prefix reuse changes nothing but the work: outputs with the cache equal outputs without it.

Each case runs the same requests on two engines, prefix caching on and off: first one request that
computes the shared prefix, then several that share it (submitted together). With the cache, the
later ones must really hit (`num_cached_tokens`), and every beam's tokens must be equal and its
scores close (the prefix's K/V were computed in another chunk shape: float rounding only). Covers
greedy, seeded sampling, beam search, an encoder-decoder (the encoder output reused whole), Gemma
3's sliding-window pools, a draft model's pools, and pinned prefixes; every scenario ends with every
block back (free or cached-evictable, pinned ones excepted).
"""

from __future__ import annotations

import random

import pytest

from widebeam.errors import RequestTooLargeError
from widebeam.llm import LLM
from widebeam.params import BeamSearchParams, SamplingParams

T = 4
PARAMS = {
    "greedy": SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True),
    "sampled": SamplingParams(max_new_tokens=8, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True),
    "beams": BeamSearchParams(beam_width=4, max_new_tokens=8, length_penalty=0.7),
}


def prompts(prefix_len: int, num: int = 3, seed: int = 0) -> tuple[list[int], list[list[int]]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(5, 120) for _ in range(prefix_len)]
    return prefix, [prefix + [rng.randrange(5, 120) for _ in range(3 + i)] for i in range(num)]


def run_waves(llm: LLM, first: list[int], rest: list[list[int]], params):
    """The prefix's first request alone, then the rest together."""
    (warm,) = llm.generate([{"prompt_token_ids": first}], params, use_tqdm=False)
    return [warm] + llm.generate([{"prompt_token_ids": p} for p in rest], params, use_tqdm=False)


def assert_same_outputs(cached, plain):
    for a, b in zip(cached, plain, strict=True):
        assert len(a.outputs) == len(b.outputs) > 0
        for x, y in zip(a.outputs, b.outputs):
            assert x.token_ids == y.token_ids
            assert x.cumulative_logprob == pytest.approx(y.cumulative_logprob, abs=1e-4)
            if y.score is not None:
                assert x.score == pytest.approx(y.score, abs=1e-4)


def assert_all_blocks_back(llm: LLM):
    for name, pool in llm.stats()["pools"].items():
        assert pool["free_blocks"] + pool["pinned_blocks"] == pool["total_blocks"], name


def pair(model_dir, **options):
    options = {"dtype": "float32", "device": "cpu", "tokens_per_block": T, "kv_cache_memory": "16MiB",
               **options}
    return LLM(str(model_dir), **options), LLM(str(model_dir), enable_prefix_caching=False, **options)


@pytest.fixture(scope="module")
def llama_pair(tiny_llama_dir):
    return pair(tiny_llama_dir)


@pytest.mark.parametrize("kind", sorted(PARAMS))
def test_decoder_only_outputs_equal_with_hits(llama_pair, kind):
    cached_llm, plain_llm = llama_pair
    _, (first, *rest) = prompts(21, seed=sorted(PARAMS).index(kind))  # the engines are shared: own prompts
    cached = run_waves(cached_llm, first, rest, PARAMS[kind])
    plain = run_waves(plain_llm, first, rest, PARAMS[kind])
    assert_same_outputs(cached, plain)
    assert [out.num_cached_tokens for out in cached[1:]] == [20] * len(rest)  # 5 whole blocks of the 21
    assert all(out.num_cached_tokens == 0 for out in plain)
    for out in cached:  # the hit blocks count as held: the bound still holds
        assert all(out.peak_blocks[p] <= out.required_blocks[p] for p in out.required_blocks)
    stats = cached_llm.stats()["prefix_cache"]
    assert stats["hit_tokens"] > 0 and 0 < stats["hit_rate"] < 1
    assert_all_blocks_back(cached_llm)
    assert cached_llm.stats()["pools"]["self"]["evictable_blocks"] > 0


def test_encoder_decoder_reuses_the_encoder_output_whole(tiny_marian_dir):
    cached_llm, plain_llm = pair(tiny_marian_dir, kv_cache_memory="4MiB")
    source = [random.Random(3).randrange(5, 50) for _ in range(13)] + [0]
    other = source[:-2] + [7, 0]
    params = BeamSearchParams(beam_width=3, max_new_tokens=6)
    cached = [cached_llm.generate([{"prompt_token_ids": s}], params, use_tqdm=False)[0]
              for s in (source, source, other)]
    plain = [plain_llm.generate([{"prompt_token_ids": s}], params, use_tqdm=False)[0]
             for s in (source, source, other)]
    assert_same_outputs(cached, plain)
    # the same source: its encoder output came from the cache; a different one is encoded again
    assert [out.num_cached_tokens for out in cached] == [0, len(source), 0]
    assert_all_blocks_back(cached_llm)


def test_gemma3_sliding_pools_reuse_only_what_the_window_needs(tiny_gemma3_dir):
    cached_llm, plain_llm = pair(tiny_gemma3_dir)
    for seed, params in enumerate((PARAMS["greedy"], PARAMS["beams"])):
        _, (first, *rest) = prompts(45, seed=seed)  # longer than either window (8 or 16)
        cached = run_waves(cached_llm, first, rest, params)
        plain = run_waves(plain_llm, first, rest, params)
        assert_same_outputs(cached, plain)
        assert [out.num_cached_tokens for out in cached[1:]] == [44] * len(rest)
    pools = cached_llm.stats()["pools"]
    assert any(name.startswith("sliding") for name in pools)
    assert_all_blocks_back(cached_llm)


def test_a_draft_models_pools_are_reused_too(tiny_llama_dir):
    cached_llm, plain_llm = pair(tiny_llama_dir, speculative_model=str(tiny_llama_dir),
                                 num_speculative_tokens=3, speculative_adaptive=False)
    for seed, params in enumerate((PARAMS["greedy"], PARAMS["beams"])):
        _, (first, *rest) = prompts(17, seed=seed)
        cached = run_waves(cached_llm, first, rest, params)
        plain = run_waves(plain_llm, first, rest, params)
        assert_same_outputs(cached, plain)
        assert [out.num_cached_tokens for out in cached[1:]] == [16] * len(rest)
    assert cached_llm.stats()["pools"]["draft"]["evictable_blocks"] > 0
    assert_all_blocks_back(cached_llm)


def test_pinned_prefix_is_computed_at_start_up_held_and_counted_in_admission(tiny_llama_dir):
    prefix, (first, second, _) = prompts(30, seed=5)
    cached_llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", tokens_per_block=T,
                     kv_cache_memory="256KiB", pinned_prefixes=[prefix])
    _, plain_llm = pair(tiny_llama_dir, kv_cache_memory="256KiB")
    pool = cached_llm.stats()["pools"]["self"]
    total, pinned = pool["total_blocks"], pool["pinned_blocks"]
    assert pinned == 30 // T and cached_llm.engine.pinned_blocks == {"self": pinned}
    outs = cached_llm.generate([{"prompt_token_ids": first}], PARAMS["beams"], use_tqdm=False)
    assert outs[0].num_cached_tokens == 28  # the first request already hits: the pin was computed at start-up
    assert_same_outputs(outs,
                        plain_llm.generate([{"prompt_token_ids": first}], PARAMS["beams"], use_tqdm=False))
    # The never-fit check: the pool less the pinned blocks, with the pinned blocks a prompt shares
    # counted as held. A prompt that starts with the pin may need every block; another may not.
    fits_all = BeamSearchParams(beam_width=1, max_new_tokens=total * T - len(second) - 1, ignore_eos=True)
    (big,) = cached_llm.generate([{"prompt_token_ids": second}], fits_all, use_tqdm=False)
    assert big.required_blocks["self"] == total and big.num_cached_tokens == 28
    other = [9] * len(second)
    with pytest.raises(RequestTooLargeError) as info:
        cached_llm.generate([{"prompt_token_ids": other}], fits_all, use_tqdm=False)
    assert info.value.capacity_blocks == total - pinned
    # a restart without caching drops the pin: it is the cache that holds it
    assert cached_llm.stats()["pools"]["self"]["pinned_blocks"] == pinned
    assert_all_blocks_back(cached_llm)


def test_pinned_prefixes_need_the_cache_and_a_whole_block(tiny_llama_dir):
    from widebeam.errors import InvalidParameterError

    with pytest.raises(InvalidParameterError, match="prefix caching"):
        LLM(str(tiny_llama_dir), device="cpu", kv_cache_memory="1MiB", enable_prefix_caching=False,
            pinned_prefixes=[[1, 2, 3, 4, 5]])
    with pytest.raises(InvalidParameterError, match="fewer than one block"):
        LLM(str(tiny_llama_dir), device="cpu", tokens_per_block=T, kv_cache_memory="1MiB",
            pinned_prefixes=[[1, 2, 3]])


def test_plan_shows_the_blocks_the_engine_pins(tiny_gemma3_dir):
    """`widebeam plan --pin-prefix` counts, per pool (the sliding ones: what a hit at the prefix's end
    needs), the blocks the engine really pins; prefixes sharing blocks share them."""
    from widebeam.model.loading.arch import load_arch
    from widebeam.plan import PlanInputs, plan

    prefix = prompts(43, seed=9)[0]
    pins = [prefix, prefix[:30] + [7] * 20]  # the second shares the first's 7 leading blocks
    llm = LLM(str(tiny_gemma3_dir), dtype="float32", device="cpu", tokens_per_block=T,
              kv_cache_memory="16MiB", pinned_prefixes=pins)
    engine_pinned = {name: n for name, n in llm.engine.pinned_blocks.items() if n}
    result = plan(load_arch(str(tiny_gemma3_dir)), PlanInputs(memory_bytes=2**30, beam_width=4, prompt_len=64,
                                                              max_new_tokens=8, tokens_per_block=T,
                                                              dtype="float32",
                                                              pinned_prefixes=tuple(map(tuple, pins))))
    assert result["pinned_prefixes"]["blocks"] == engine_pinned
    assert engine_pinned["self"] == 43 // T + 50 // T - 30 // T
    assert any(name.startswith("sliding") for name in engine_pinned)
    for pool in result["pools"]:
        assert pool["pinned_blocks"] == engine_pinned.get(pool["name"], 0)


def test_requests_submitted_together_compute_their_shared_prefix_once(llama_pair):
    """All in one batch, no warm-up: the first computes the prefix; the others, which would have
    computed it in the same step, wait one step and take it as a hit (in-batch deferral)."""
    cached_llm, plain_llm = llama_pair
    _, batch = prompts(26, num=4, seed=11)
    params = PARAMS["beams"]
    cached = cached_llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    plain = plain_llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    assert_same_outputs(cached, plain)
    assert [out.num_cached_tokens for out in cached] == [0, 24, 24, 24]
    assert_all_blocks_back(cached_llm)


@pytest.mark.parametrize("kind", ["greedy", "beams"])
def test_a_block_recurring_at_another_position_is_not_a_hit(llama_pair, kind):
    """A block's name covers its parent: block A at position 0 and the same tokens at position 2 are
    different blocks (their K/V differ by position). The first prompt is A B A + tail; the later ones
    repeat A or B at other positions (A A, B A, B B A) and may reuse only true prefixes: the same
    tokens and scores as without the cache, and only those blocks counted as cached."""
    cached_llm, plain_llm = llama_pair
    rng = random.Random(40 + len(kind))
    a, b = ([rng.randrange(5, 120) for _ in range(T)] for _ in range(2))
    tail = [[rng.randrange(5, 120) for _ in range(2 + i)] for i in range(4)]
    first = a + b + a + tail[0]
    rest = [a + a + b + tail[1], b + a + tail[2], b + b + a + tail[3], a + b + a + a + tail[1]]
    cached = run_waves(cached_llm, first, rest, PARAMS[kind])
    plain = run_waves(plain_llm, first, rest, PARAMS[kind])
    assert_same_outputs(cached, plain)
    # A at 0 from the first; B at 0 of B B A from B A, submitted with it (a true prefix); A B A whole
    assert [out.num_cached_tokens for out in cached] == [0, T, 0, T, 3 * T]
    assert_all_blocks_back(cached_llm)
