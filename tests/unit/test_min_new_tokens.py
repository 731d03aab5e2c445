"""`min_new_tokens` masks what would end a sequence early (as transformers and vLLM do), and a forced
EOS on the last allowed token overrides it (as transformers' processors do)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import TINY_MARIAN_EOS, save_tiny_marian
from transformers import MarianMTModel

from widebeam.llm import LLM
from widebeam.params import BeamSearchParams, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), dtype="float32", device="cpu", kv_cache_memory="8MiB")


def _free(llm):
    return {name: pool["free_blocks"] for name, pool in llm.engine.stats()["pools"].items()}


def test_sampled_sequences_never_emit_a_stop_token_before_min_new_tokens(llm):
    prompt = {"prompt_token_ids": [5, 9, 14, 3, 77, 21]}
    free_before = _free(llm)
    (free_run,) = llm.generate([prompt], SamplingParams(max_new_tokens=6, temperature=0), use_tqdm=False)
    first = free_run.outputs[0].token_ids[0]
    # the greedy first token is now a stop token: it must not be produced (and walked past) early
    params = SamplingParams(max_new_tokens=6, temperature=0, stop_token_ids=[first], min_new_tokens=4)
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    tokens = out.outputs[0].token_ids
    assert len(tokens) >= 4 and first not in tokens[:4]
    assert _free(llm) == free_before


def test_forced_eos_overrides_min_new_tokens_as_in_transformers(tmp_path):
    hf = save_tiny_marian(tmp_path, forced_eos=True, eos_logit_bias=0.0)
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", tokens_per_block=4, kv_cache_memory="4MiB",
              max_num_batched_tokens=64, max_beam_width=4)
    source = [5, 17, 33, 9, 100, 3, TINY_MARIAN_EOS]
    settings = {"do_sample": False, "eos_token_id": TINY_MARIAN_EOS, "pad_token_id": hf.config.pad_token_id,
                "decoder_start_token_id": hf.config.pad_token_id, "bad_words_ids": [[hf.config.pad_token_id]],
                "forced_eos_token_id": TINY_MARIAN_EOS, "max_new_tokens": 5, "min_new_tokens": 5}
    for width, params in ((1, SamplingParams(max_new_tokens=5, min_new_tokens=5, temperature=0)),
                          (4, BeamSearchParams(beam_width=4, max_new_tokens=5, min_new_tokens=5))):
        (out,) = llm.generate([{"prompt_token_ids": source}], params, use_tqdm=False)
        with torch.no_grad():
            expected = MarianMTModel.generate(hf, torch.tensor([source]), num_beams=width,
                                              **settings)[0, 1:].tolist()
        assert out.outputs, "forced EOS and min_new_tokens left no token to choose"
        assert out.outputs[0].token_ids == expected and expected[-1] == TINY_MARIAN_EOS
