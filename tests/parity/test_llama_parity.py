"""widebeam's paged Llama-family decoder against transformers on tiny random models (float32)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from widebeam.kv.tables import Holding
from widebeam.llm import LLM
from widebeam.model.runner import SequenceInput
from widebeam.params import SamplingParams

PROMPTS = [[5, 17, 33, 9, 100, 3, 8], [7] * 23, list(range(3, 40)), [11, 12]]


@pytest.fixture(scope="module", params=["tiny_llama_dir", "tiny_qwen2_dir"])
def model_dir(request):
    return request.getfixturevalue(request.param)


def hf_model(path):
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


@pytest.mark.parametrize("tokens_per_block", [1, 3, 16])
def test_prefill_and_decode_logits_match(model_dir, tokens_per_block):
    llm = LLM(str(model_dir), dtype="float32", device="cpu", tokens_per_block=tokens_per_block,
              kv_cache_memory="8MiB")
    engine, hf = llm.engine, hf_model(model_dir)
    manager = engine.cache["self"]
    holdings = [Holding() for _ in PROMPTS]
    tables = [manager.new_table(h) for h in holdings]
    # Prefill all prompts (different lengths) in one forward, logits of every token.
    inputs = [SequenceInput(p, 0, {"self": t.block_ids}, {"self": manager.append_slots(t, len(p))})
              for p, t in zip(PROMPTS, tables)]
    logits = engine.runner.execute(inputs, all_logits=True)
    offset = 0
    with torch.no_grad():
        for prompt in PROMPTS:
            expected = hf(torch.tensor([prompt])).logits[0]
            torch.testing.assert_close(logits[offset:offset + len(prompt)], expected, atol=1e-4, rtol=1e-4)
            offset += len(prompt)
    # Then several decode steps of all sequences together.
    sequences = [list(p) for p in PROMPTS]
    for step in range(6):
        next_tokens = [(7 * step + 3 * i) % 120 + 3 for i in range(len(PROMPTS))]
        inputs = []
        for seq, table, token in zip(sequences, tables, next_tokens):
            slots = manager.append_slots(table, 1)
            inputs.append(SequenceInput([token], len(seq), {"self": table.block_ids}, {"self": slots}))
            seq.append(token)
        logits = engine.runner.execute(inputs)
        with torch.no_grad():
            for row, seq in zip(logits, sequences):
                expected = hf(torch.tensor([seq])).logits[0, -1]
                torch.testing.assert_close(row, expected, atol=1e-4, rtol=1e-4)
    for table in tables:
        manager.release(table)
    assert engine.cache.num_free_blocks()["self"] == engine.cache.stats()["self"]["total_blocks"]


def test_greedy_generation_matches_transformers(model_dir):
    llm = LLM(str(model_dir), dtype="float32", device="cpu", tokens_per_block=4, kv_cache_memory="8MiB")
    hf = hf_model(model_dir)
    params = SamplingParams(max_new_tokens=64, temperature=0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs):
        with torch.no_grad():
            expected = hf.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False,
                                   eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        (completion,) = output.outputs
        assert completion.token_ids == expected
        assert completion.finish_reason == "length"
        assert completion.cumulative_logprob < 0
    stats = llm.stats()["pools"]["self"]
    assert stats["free_blocks"] == stats["total_blocks"]


def test_rope_scaling_and_mistral_variants_match(tiny_variant_dir):
    """RoPE scaling types (llama3, linear) and the Mistral family, decoded past the original context."""
    llm = LLM(str(tiny_variant_dir), dtype="float32", device="cpu", tokens_per_block=4,
              kv_cache_memory="8MiB")
    hf = hf_model(tiny_variant_dir)
    prompt = list(range(3, 43))
    (output,) = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_new_tokens=24, temperature=0,
                                                                            ignore_eos=True), use_tqdm=False)
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(prompt):].tolist()
    assert output.outputs[0].token_ids == expected
