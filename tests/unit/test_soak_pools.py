"""A randomized soak over every pool kind: full and sliding-window attention (a tiny Gemma 3, five
sliding layers to one full), and self plus cross attention (a tiny Marian), with the prefix cache on,
shared prompt prefixes, greedy, sampled and beam requests of many widths, and aborts at random steps
(waiting, prefilling or decoding). Every finished request stays within its bound in every pool, and
the engine ends with every block back: nothing running or waiting, each pool's free blocks (free +
cached-evictable) equal to its total."""

from __future__ import annotations

import random

import pytest
from tiny_models import save_tiny_marian, save_tiny_model

from widebeam.errors import InvalidParameterError, RequestTooLargeError
from widebeam.llm import LLM
from widebeam.params import BeamSearchParams, SamplingParams

WINDOW = 8


@pytest.fixture(scope="module")
def gemma3_llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-gemma3-soak")
    save_tiny_model(path, "gemma3_text", num_hidden_layers=6, tie_word_embeddings=True, head_dim=16,
                    sliding_window=WINDOW, layer_types=["sliding_attention"] * 5 + ["full_attention"])
    return LLM(str(path), device="cpu", tokens_per_block=4, kv_cache_memory=400 * 1024,
               max_num_batched_tokens=24, max_beam_width=32)


@pytest.fixture(scope="module")
def marian_llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-marian-soak")
    save_tiny_marian(path)
    return LLM(str(path), device="cpu", tokens_per_block=4, kv_cache_memory=600 * 1024,
               max_num_batched_tokens=24, max_beam_width=32)


def soak(llm, seed, num_requests, expected_pools):
    rng = random.Random(seed)
    engine = llm.engine
    totals = {name: pool["total_blocks"] for name, pool in llm.stats()["pools"].items()}
    assert set(totals) == expected_pools
    prefixes = [[rng.randrange(3, 120) for _ in range(rng.randint(4, 20))] for _ in range(3)]
    admitted, rejected, aborted, abort_at = set(), set(), set(), {}
    for n in range(num_requests):
        request_id = f"s{seed}-{n}"
        tail = [rng.randrange(3, 120) for _ in range(rng.randint(1, 24))]
        prompt = (rng.choice(prefixes) + tail) if rng.random() < 0.5 else tail
        max_new = rng.randint(1, 20)
        kind = rng.random()
        if kind < 0.2:
            params = SamplingParams(max_new_tokens=max_new, temperature=0)
        elif kind < 0.35:
            params = SamplingParams(max_new_tokens=max_new, temperature=1.0, seed=n)
        else:
            params = BeamSearchParams(beam_width=rng.choice([1, 2, 3, 4, 8, 16, 32]), max_new_tokens=max_new,
                                      length_penalty=rng.choice([0.0, 1.0]),
                                      early_stopping=rng.choice([True, False, "never"]))
        try:
            engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
        except (RequestTooLargeError, InvalidParameterError):
            rejected.add(request_id)
            continue
        admitted.add(request_id)
        if rng.random() < 0.15:
            abort_at[request_id] = rng.randint(0, 60)
    assert len(admitted) >= num_requests // 2 and abort_at
    outputs, steps = {}, 0
    while engine.has_unfinished():
        for request_id, at in list(abort_at.items()):
            if steps == at:
                engine.abort(request_id)  # a no-op for one already finished
                if request_id not in outputs:
                    aborted.add(request_id)
                del abort_at[request_id]
        for delta in engine.step():
            if delta.finished and delta.error is None:
                outputs[delta.request_id] = delta.output
        steps += 1
        assert steps < 20_000, "the engine did not finish"
    assert set(outputs) | aborted == admitted and not set(outputs) & aborted
    for output in outputs.values():
        assert output.outputs
        assert all(output.peak_blocks[p] <= output.required_blocks[p] for p in output.peak_blocks), \
            output.request_id
    stats = llm.stats()
    assert stats["running"] == stats["waiting"] == 0
    assert {name: pool["free_blocks"] for name, pool in stats["pools"].items()} == totals
    return outputs, aborted


@pytest.mark.parametrize("seed", [11, 12])
def test_soak_full_and_sliding_pools_with_aborts(gemma3_llm, seed):
    outputs, aborted = soak(gemma3_llm, seed, 70, {"self", f"sliding_{WINDOW}"})
    assert aborted and len(outputs) >= 20
    # the sliding pool held less than the full one somewhere: the window really released blocks
    assert any(o.peak_blocks[f"sliding_{WINDOW}"] < o.peak_blocks["self"] for o in outputs.values())


@pytest.mark.parametrize("seed", [21, 22])
def test_soak_self_and_cross_pools_with_aborts(marian_llm, seed):
    outputs, aborted = soak(marian_llm, seed, 60, {"self", "cross"})
    assert aborted and len(outputs) >= 20
    assert all(o.peak_blocks["cross"] == o.required_blocks["cross"] for o in outputs.values())
