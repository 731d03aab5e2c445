"""The parity checks on a GPU (`pytest -m cuda` on a machine with one): the engine on CUDA against
transformers on the CPU (the reference), float32: greedy tokens equal, beam sequences and scores
equal. Without a CUDA device these are skipped; CI machines have none."""

from __future__ import annotations

import pytest
import torch
from beam_checks import assert_beams_match, assert_greedy_matches_transformers, hf_beam_search

from widebeam.llm import LLM
from widebeam.params import BeamSearchParams

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPTS = [[(i * 31 + k) % 120 + 3 for i in range(n)] for k, n in ((1, 9), (5, 23), (11, 40))]


@pytest.fixture(scope="module")
def models(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cuda", kv_cache_memory="64MiB")
    assert llm.engine.model.lm_head.weight.device.type == "cuda"
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    return llm, hf


def test_greedy_on_cuda_equals_transformers(models):
    llm, hf = models
    assert_greedy_matches_transformers(llm, hf, PROMPTS, pad=0, max_new_tokens=16)


@pytest.mark.parametrize("width", [2, 4, 8])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_beam_search_on_cuda_equals_transformers(models, prompt, width):
    llm, hf = models
    params = BeamSearchParams(beam_width=width, max_new_tokens=12, length_penalty=1.0)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert_beams_match(out, hf_beam_search(hf, prompt, params, eos=2, pad=0), len(prompt), pad=0, eos=2,
                       beam_width=width, label=f"cuda W={width}")
