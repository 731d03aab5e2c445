"""Speculative sampling draws from the target's distribution: the joint distribution of the tokens
chosen in speculative rounds, over thousands of seeded requests, matches the target's exact
probabilities (computed by transformers) by a chi-square test, and is far from the draft's."""

from __future__ import annotations

import math

import pytest
import torch
from tiny_models import save_noisy_copy

from widebeam.engine import LLMEngine
from widebeam.params import SamplingParams

PROMPT = [5, 6, 7, 8, 9]
TOP_K = 3
NUM_DRAWS = 3000


def exact_joint(model_dir, num_tokens: int) -> dict[tuple[int, ...], float]:
    """P(t1..tn) under `model_dir`'s model with temperature 1 and top-k, from transformers' logits."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    joint = {(): 1.0}
    for _ in range(num_tokens):
        nxt = {}
        for prefix, prob in joint.items():
            with torch.no_grad():
                logits = model(torch.tensor([PROMPT + list(prefix)])).logits[0, -1]
            top = torch.topk(logits, TOP_K)
            for token, p in zip(top.indices.tolist(), torch.softmax(top.values, dim=-1).tolist()):
                nxt[prefix + (token,)] = prob * p
        joint = nxt
    return joint


def chi_square(counts: dict, probs: dict, num_draws: int) -> tuple[float, int]:
    """Pearson's statistic over the outcomes, those expected fewer than 5 times pooled into one bin."""
    stat, pooled_count, pooled_expected, bins = 0.0, 0, 0.0, 0
    for outcome, prob in probs.items():
        expected = prob * num_draws
        if expected < 5:
            pooled_count += counts.get(outcome, 0)
            pooled_expected += expected
            continue
        stat += (counts.get(outcome, 0) - expected) ** 2 / expected
        bins += 1
    if pooled_expected > 0:
        stat += (pooled_count - pooled_expected) ** 2 / pooled_expected
        bins += 1
    return stat, bins - 1


def chi_square_critical(df: int, z: float = 3.29) -> float:
    """The upper 0.05% point of chi-square(df), by the Wilson-Hilferty approximation."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.fixture(scope="module")
def noisy_draft_dir(tiny_llama_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-noisy-sampling")
    save_noisy_copy(tiny_llama_dir, path, noise=0.03)
    return path


def test_speculative_sampling_matches_the_target(tiny_llama_dir, noisy_draft_dir):
    engine = LLMEngine(str(tiny_llama_dir), device="cpu", kv_cache_memory="16MiB", tokens_per_block=4,
                       max_num_batched_tokens=4096, max_beam_width=1,
                       speculative_model=str(noisy_draft_dir), num_speculative_tokens=3)
    free = engine.cache.num_free_blocks()
    for i in range(NUM_DRAWS):
        engine.add_request(f"r{i}", {"prompt_token_ids": PROMPT},
                           SamplingParams(temperature=1.0, top_k=TOP_K, max_new_tokens=4, seed=i,
                                          ignore_eos=True))
    counts: dict[tuple[int, ...], int] = {}
    while engine.has_unfinished():
        for delta in engine.step():
            if delta.finished:
                key = tuple(delta.output.outputs[0].token_ids)
                counts[key] = counts.get(key, 0) + 1
    assert engine.cache.num_free_blocks() == free
    stats = engine.stats()["speculative"]
    # both branches of the rejection rule ran many times: drafts accepted and drafts rejected
    acceptance = stats["accepted_tokens"] / stats["drafted_tokens"]
    assert 0.1 < acceptance < 0.9, stats

    target = exact_joint(tiny_llama_dir, 4)
    stat, df = chi_square(counts, target, NUM_DRAWS)
    assert stat < chi_square_critical(df), (stat, df)
    # The test can tell the two apart: the same draws are far from the draft's own distribution.
    draft_stat, draft_df = chi_square(counts, exact_joint(noisy_draft_dir, 4), NUM_DRAWS)
    assert draft_stat > 3 * chi_square_critical(draft_df), (draft_stat, draft_df)
