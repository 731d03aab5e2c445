"""widebeam's paged Gemma 3 text decoder against transformers on tiny random models (float32).

Two models (`tiny_gemma3_dir`: windows 8 and 16, six layers, five sliding to one full, two RoPE
bases) and two KV pools per model ("self" for the full layer, "sliding_{w}" for the others). Prompts
are shorter than, equal to and longer than the window, so both sides of the sliding mask are hit
in prefill (one chunk and two), in decode, in greedy generation and in beam search.
"""

from __future__ import annotations

import json

import pytest
import torch
from beam_checks import assert_beams_match, assert_greedy_matches_transformers, hf_beam_search
from transformers import AutoModelForCausalLM

from widebeam.kv.tables import Holding
from widebeam.llm import LLM
from widebeam.model.runner import SequenceInput
from widebeam.params import BeamSearchParams

PAD = 0
EOS = 2


def window_of(path) -> int:
    return int(json.loads((path / "config.json").read_text())["sliding_window"])


def prompts_for(window: int) -> list[list[int]]:
    """Shorter than the window, exactly the window, one past it, and several windows long."""
    return [[5, 17, 33, 9, 100], [(7 * i) % 120 + 3 for i in range(window)],
            [(11 * i + 4) % 125 + 3 for i in range(window + 1)], list(range(3, 3 + 3 * window + 5))]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models gain nothing from intra-op threads; on a busy 2-core host two threads made this
    module ~6x slower (116 s against 19 s)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def hf(tiny_gemma3_dir):
    return AutoModelForCausalLM.from_pretrained(str(tiny_gemma3_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(tiny_gemma3_dir):
    """One engine per model for the generate tests; each test checks every block came back."""
    return LLM(str(tiny_gemma3_dir), dtype="float32", device="cpu", tokens_per_block=4,
               kv_cache_memory="16MiB", max_num_batched_tokens=64, max_beam_width=8)


def new_tables(engine):
    """One block table per pool for a fresh sequence."""
    return {name: manager.new_table(Holding()) for name, manager in engine.cache.managers.items()}


def seq_input(engine, tables, token_ids, num_computed):
    slots = {name: engine.cache[name].append_slots(table, len(token_ids)) for name, table in tables.items()}
    return SequenceInput(list(token_ids), num_computed, {name: t.block_ids for name, t in tables.items()},
                         slots)


@pytest.mark.parametrize("tokens_per_block", [1, 4])
def test_prefill_and_decode_logits_match(tiny_gemma3_dir, hf, tokens_per_block):
    llm = LLM(str(tiny_gemma3_dir), dtype="float32", device="cpu", tokens_per_block=tokens_per_block,
              kv_cache_memory="16MiB", max_num_batched_tokens=64, max_beam_width=8)
    engine = llm.engine
    window = window_of(tiny_gemma3_dir)
    assert sorted(engine.cache.managers) == sorted(["self", f"sliding_{window}"])
    assert engine.model.layer_pool_names == [f"sliding_{window}"] * 5 + ["self"]
    prompts = prompts_for(window)
    num_decode = window + 2  # the shortest prompt passes the window while decoding
    decoded = [[(7 * step + 3 * i) % 120 + 3 for step in range(num_decode)] for i in range(len(prompts))]
    # transformers is causal: one forward of each whole sequence gives every prefix's logits.
    with torch.no_grad():
        expected = [hf(torch.tensor([p + d])).logits[0] for p, d in zip(prompts, decoded)]
    tables = [new_tables(engine) for _ in prompts]
    # The longest prompt is prefilled in two chunks, the second starting mid-window.
    split = window + 3
    long_prompt = prompts[-1]
    first = engine.runner.execute([seq_input(engine, tables[-1], long_prompt[:split], 0)], all_logits=True)
    torch.testing.assert_close(first, expected[-1][:split], atol=1e-4, rtol=1e-4)
    # The other prompts and the long one's second chunk in one forward, logits of every token.
    inputs = [seq_input(engine, t, p, 0) for p, t in zip(prompts[:-1], tables[:-1])]
    inputs.append(seq_input(engine, tables[-1], long_prompt[split:], split))
    logits = engine.runner.execute(inputs, all_logits=True)
    offset = 0
    for prompt, exp in zip(prompts[:-1], expected):
        torch.testing.assert_close(logits[offset:offset + len(prompt)], exp[:len(prompt)], atol=1e-4,
                                   rtol=1e-4)
        offset += len(prompt)
    torch.testing.assert_close(logits[offset:], expected[-1][split:len(long_prompt)], atol=1e-4, rtol=1e-4)
    # Decode all sequences together, one token each per step.
    for step in range(num_decode):
        inputs = [seq_input(engine, t, [d[step]], len(p) + step) for p, d, t in zip(prompts, decoded, tables)]
        logits = engine.runner.execute(inputs)
        for row, prompt, exp in zip(logits, prompts, expected):
            torch.testing.assert_close(row, exp[len(prompt) + step], atol=1e-4, rtol=1e-4)
    for seq_tables in tables:
        for name, table in seq_tables.items():
            engine.cache[name].release(table)
    for name, stats in engine.cache.stats().items():
        assert stats["free_blocks"] == stats["total_blocks"], name


def test_greedy_generation_matches_transformers(tiny_gemma3_dir, hf, llm):
    window = window_of(tiny_gemma3_dir)
    prompts = [prompts_for(window)[-1], [9, 4, 60]]  # longer than the window; short, then past it
    assert_greedy_matches_transformers(llm, hf, prompts, PAD)
    for name, stats in llm.stats()["pools"].items():
        assert stats["free_blocks"] == stats["total_blocks"], name


@pytest.mark.parametrize("beam_width", [1, 4, 8])
def test_beam_search_matches_transformers(tiny_gemma3_dir, hf, llm, beam_width):
    window = window_of(tiny_gemma3_dir)
    prompts = [prompts_for(window)[-1], [5, 17, 33, 9, 100, 3, 8]]
    max_new_tokens = 12
    params = BeamSearchParams(beam_width=beam_width, max_new_tokens=max_new_tokens,
                              num_return_sequences=beam_width)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        expected = hf_beam_search(hf, prompt, params, EOS, PAD)
        assert len(output.outputs) == beam_width
        assert_beams_match(output, expected, len(prompt), PAD, EOS, beam_width, f"prompt {prompt[:4]}")
        for pool, required in output.required_blocks.items():
            assert output.peak_blocks[pool] <= required, pool
    for name, stats in llm.stats()["pools"].items():
        assert stats["free_blocks"] == stats["total_blocks"], name


def test_multimodal_checkpoint_runs_text_only(tmp_path):
    """A "gemma3" (Gemma3ForConditionalGeneration) directory: the decoder is read from text_config and
    the vision tower is skipped; text-only logits equal transformers' multimodal model."""
    from transformers import Gemma3Config as HFGemma3Config
    from transformers import Gemma3ForConditionalGeneration

    text = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 6,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "sliding_window": 8,
            "max_position_embeddings": 512, "query_pre_attn_scalar": 16,
            "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
            "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "image_size": 28, "patch_size": 14}
    config = HFGemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                            image_token_index=127,
                            boi_token_index=125, eoi_token_index=126, bos_token_id=1, eos_token_id=2,
                            pad_token_id=0)
    torch.manual_seed(0)
    hf_mm = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in hf_mm.named_parameters():
            if "norm" not in name:
                param.normal_(0, 0.2)
    hf_mm.save_pretrained(str(tmp_path))
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", tokens_per_block=4, kv_cache_memory="16MiB",
              max_num_batched_tokens=64, max_beam_width=8)
    engine = llm.engine
    assert engine.model.layer_pool_names == ["sliding_8"] * 5 + ["self"]
    prompt, decoded = list(range(3, 23)), [40, 41, 42]
    with torch.no_grad():
        expected = hf_mm(torch.tensor([prompt + decoded])).logits[0]
    tables = new_tables(engine)
    logits = engine.runner.execute([seq_input(engine, tables, prompt, 0)], all_logits=True)
    torch.testing.assert_close(logits, expected[:len(prompt)], atol=1e-4, rtol=1e-4)
    for step, token in enumerate(decoded):
        (row,) = engine.runner.execute([seq_input(engine, tables, [token], len(prompt) + step)])
        torch.testing.assert_close(row, expected[len(prompt) + step], atol=1e-4, rtol=1e-4)


def test_sparse_configs_get_transformers_defaults():
    """Hub configs store only what differs from Gemma3TextConfig's defaults (a multimodal text_config
    may hold four fields): layer pattern, window, RoPE bases, heads and scale must match transformers'."""
    from transformers import Gemma3Config as HFGemma3Config

    from widebeam.model.families.decoder_config import gemma3_text_config
    from widebeam.model.families.table import parse_config

    sparse = {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
              "num_hidden_layers": 34,
              "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024}
    hf_text = HFGemma3Config(text_config=dict(sparse)).text_config
    for raw in ({"model_type": "gemma3", "text_config": dict(sparse)}, dict(sparse)):
        parsed = parse_config(raw)
        arch, settings = parsed.arch, parsed.settings
        expected_windows = tuple(hf_text.sliding_window if t == "sliding_attention" else None
                                 for t in hf_text.layer_types)
        assert arch.layer_windows == expected_windows
        assert (arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.vocab_size) == (
            hf_text.num_attention_heads, hf_text.num_key_value_heads, hf_text.head_dim, hf_text.vocab_size)
        assert float(gemma3_text_config(raw)["query_pre_attn_scalar"]) == hf_text.query_pre_attn_scalar
        assert settings.attention_scale == float(hf_text.query_pre_attn_scalar) ** -0.5
        assert settings.rms_norm_eps == hf_text.rms_norm_eps
        assert arch.tie_word_embeddings
        for kind in ("full_attention", "sliding_attention"):
            hf_rope = hf_text.rope_parameters[kind]
            assert settings.rope[kind]["rope_type"] == hf_rope["rope_type"]
            assert settings.rope[kind]["rope_theta"] == hf_rope["rope_theta"]
            assert settings.rope[kind].get("factor") == hf_rope.get("factor")
