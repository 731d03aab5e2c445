"""Beam search through the whole engine (paged KV, shared prompt, copy-on-write) against transformers
`generate(num_beams=W)`: same sequences in the same order, `score` allclose to `sequences_scores`."""

from __future__ import annotations

import pytest
import torch
from beam_checks import assert_beams_match, hf_beam_search
from helpers import prefill_request_ids, record_schedules
from transformers import AutoModelForCausalLM

from widebeam.llm import LLM
from widebeam.params import BeamSearchParams

PAD = 0
EOS = 2
PROMPTS = [[5, 17, 33, 9, 100, 3, 8], [7, 7, 9] * 6, list(range(3, 40)), [11, 12]]

# (beam_width, tokens_per_block, length_penalty, early_stopping, num_return_sequences, min_new_tokens)
CASES = [
    (1, 4, 1.0, False, 1, 0),
    (2, 1, 1.0, True, 2, 0),
    (4, 16, 2.0, False, 4, 3),
    (4, 1, -1.0, "never", 2, 0),
    (8, 4, 0.0, True, 8, 0),
    (8, 16, 1.0, "never", 3, 2),
    (16, 4, 2.0, True, 16, 0),
    (16, 1, -1.0, False, 4, 1),
    (32, 16, 1.0, False, 32, 0),
    (32, 4, 0.0, "never", 5, 4),
]


@pytest.fixture(scope="module")
def models(tiny_llama_dir):
    llms = {}
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    return llms, hf, tiny_llama_dir


def get_llm(models, tokens_per_block):
    llms, _, path = models
    if tokens_per_block not in llms:
        llms[tokens_per_block] = LLM(str(path), dtype="float32", device="cpu",
                                     tokens_per_block=tokens_per_block,
                                     kv_cache_memory="16MiB", max_num_batched_tokens=64, max_beam_width=64)
    return llms[tokens_per_block]


@pytest.mark.parametrize("beam_width, tokens_per_block, length_penalty, early_stopping, num_return, min_new",
                         CASES)
def test_beam_search_matches_transformers(models, beam_width, tokens_per_block, length_penalty,
                                          early_stopping, num_return, min_new):
    llm, hf = get_llm(models, tokens_per_block), models[1]
    max_new_tokens = 12
    params = BeamSearchParams(beam_width=beam_width, max_new_tokens=max_new_tokens,
                              length_penalty=length_penalty,
                              early_stopping=early_stopping, num_return_sequences=num_return,
                              min_new_tokens=min_new)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    saw_eos = False
    for prompt, output in zip(PROMPTS, outputs):
        expected = hf_beam_search(hf, prompt, params, EOS, PAD)
        assert len(output.outputs) == num_return
        saw_eos |= assert_beams_match(output, expected, len(prompt), PAD, EOS, beam_width,
                                      f"prompt {prompt[:4]}")
        for rank, beam in enumerate(output.outputs):
            assert beam.index == rank
            assert beam.finish_reason == ("stop" if beam.token_ids[-1] == EOS else "length")
        # KV: never above the bound, and every block back afterwards.
        assert output.peak_blocks["self"] <= output.required_blocks["self"]
    if beam_width >= 8 and length_penalty <= 0:  # short hypotheses win: finished ones must show up
        assert saw_eos, "the EOS paths were not exercised"
    pool = llm.stats()["pools"]["self"]
    assert pool["free_blocks"] == pool["total_blocks"]


def test_prompt_is_stored_once_and_held_blocks_stay_in_bound(models):
    llm = get_llm(models, 4)
    prompt = list(range(3, 43))  # 40 tokens = 10 full blocks of 4
    width = 16
    engine = llm.engine
    engine.add_request("wide", {"prompt_token_ids": prompt},
                       BeamSearchParams(beam_width=width, max_new_tokens=10, ignore_eos=True))
    total = engine.cache.stats()["self"]["total_blocks"]
    schedules = record_schedules(engine)
    engine.step()  # the prefill: one sequence of 40 tokens, whatever the beam width
    assert prefill_request_ids(schedules[-1]) == ["wide"]
    assert total - engine.cache.num_free_blocks()["self"] == 10
    held = []
    outputs = []
    while engine.has_unfinished():
        outputs += [delta.output for delta in engine.step() if delta.finished]
        held.append(total - engine.cache.num_free_blocks()["self"])
    (output,) = outputs
    required = output.required_blocks["self"]
    assert required == 10 + 3 * width  # ceil((0 + 10) / 4) = 3 own blocks per beam
    assert max(held) <= required and output.peak_blocks["self"] <= required
    assert held[-1] == 0
    # every beam runs to the end (ignore_eos): all W distinct beams hold their own last block
    assert output.peak_blocks["self"] >= 10 + width  # each live beam owns at least its last block
