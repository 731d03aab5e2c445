"""M2M100 (NLLB), BART and mBART through widebeam against transformers' M2M100ForConditionalGeneration,
BartForConditionalGeneration and MBartForConditionalGeneration on tiny random models: encoder outputs,
logits of the paged decoder reading the 'cross' pool, greedy tokens, and beam search sequences and
scores at W = 1, 4, 16 through the whole engine (several sources of different lengths in one `generate`
call), with the cross pool holding exactly ceil(E/T) blocks per request whatever the beam width. Then
the real nllb-200-distilled-600M and bart-base shapes at one layer each, and int8. The checks shared
with the Marian and T5 tests are in tests/seq2seq_checks.py.

Every HF generation setting that changes outputs is stated (tiny_bart_family.HF_SETTINGS), with
forced_bos_token_id=None: the engine's forced BOS is not part of this comparison.
"""

from __future__ import annotations

import pytest
import torch
from seq2seq_checks import (
    Seq2SeqModel,
    assert_beam_search_matches,
    assert_greedy_matches,
    assert_logits_match,
)
from tiny_bart_family import (
    BART_BASE_SHAPE,
    EOS,
    HF_SETTINGS,
    NLLB_600M_SHAPE,
    TINY_CONFIGS,
    save_tiny_seq2seq,
)

from widebeam.llm import LLM
from widebeam.params import BeamSearchParams, SamplingParams

FAMILIES = sorted(TINY_CONFIGS)  # bart, m2m100, mbart
# Sources of several lengths (E = 2 .. 37), each ending with EOS as the families' tokenizers end them;
# none holds PAD (M2M100 gives PAD the padding position, see docs/translation-families.md).
SOURCES = [[5, 17, 33, 9, 100, 3, EOS], [7, 7, 9] * 4 + [EOS], list(range(3, 39)) + [EOS], [11, EOS]]

# (beam_width, tokens_per_block, length_penalty, early_stopping, num_return_sequences, min_new_tokens)
CASES = [
    (1, 4, 1.0, False, 1, 0),
    (4, 1, 1.0, True, 2, 0),
    (4, 16, 2.0, False, 4, 3),
    (4, 4, -1.0, "never", 2, 0),
    (16, 4, 1.0, True, 4, 2),
    (16, 16, 0.0, "never", 16, 0),
    (16, 3, -1.0, False, 8, 1),
]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory) -> Seq2SeqModel:
    path = tmp_path_factory.mktemp(f"tiny-{request.param}")
    return Seq2SeqModel(request.param, save_tiny_seq2seq(path, TINY_CONFIGS[request.param]), path)


def assert_encoder_outputs_match(llm, hf, sources):
    """The encoder over a padding-free batch of the sources equals HF's last_hidden_state of each."""
    model = llm.engine.model
    ids = torch.tensor([t for s in sources for t in s])
    positions = torch.tensor([p for s in sources for p in range(len(s))])
    starts = [0]
    for s in sources:
        starts.append(starts[-1] + len(s))
    with torch.no_grad():
        hidden = model.encoder_hidden(ids, positions, starts)
        for i, source in enumerate(sources):
            expected = hf.get_encoder()(input_ids=torch.tensor([source])).last_hidden_state[0]
            torch.testing.assert_close(hidden[starts[i]:starts[i + 1]], expected, atol=1e-4, rtol=1e-4)


def test_encoder_outputs_match(family):
    assert_encoder_outputs_match(family.llm(4), family.hf, SOURCES)


@pytest.mark.parametrize("tokens_per_block", [1, 3, 16])
def test_logits_match_with_cross_attention_from_the_pool(family, tokens_per_block):
    decoder_ids = [[EOS, 4, 8, 9, 10], [EOS], [EOS] + [3] * 9, [EOS, 50, 51]]
    assert_logits_match(family.llm(tokens_per_block).engine, family.hf, SOURCES, decoder_ids, decode_steps=4)


@pytest.mark.parametrize("beam_width, tokens_per_block, length_penalty, early_stopping, num_return, min_new",
                         CASES)
def test_beam_search_matches_transformers(family, beam_width, tokens_per_block, length_penalty,
                                          early_stopping, num_return, min_new):
    params = BeamSearchParams(beam_width=beam_width, max_new_tokens=12, length_penalty=length_penalty,
                              early_stopping=early_stopping, num_return_sequences=num_return,
                              min_new_tokens=min_new)
    assert_beam_search_matches(family.llm(tokens_per_block), family.hf, SOURCES, params, tokens_per_block,
                               HF_SETTINGS, family.name)


def test_greedy_matches_transformers(family):
    assert_greedy_matches(family.llm(4), family.hf, SOURCES, HF_SETTINGS)


def test_the_decoder_starts_at_eos_and_embeddings_are_shared(family):
    model = family.llm(4).engine.model
    assert model.decoder_start_token_id == EOS
    shared = model.model.shared.weight
    assert model.model.encoder.embed_tokens.weight is shared
    assert model.model.decoder.embed_tokens.weight is shared
    assert model.lm_head.weight is shared
    if hasattr(family.hf, "final_logits_bias"):
        torch.testing.assert_close(model.final_logits_bias, family.hf.final_logits_bias)
    else:
        assert not hasattr(model, "final_logits_bias")  # M2M100 has none


def test_int8_runs_greedy(family):
    """dtype="int8" (int8 linears, float32 activations and KV) runs each family's encoder and decoder."""
    llm = LLM(str(family.path), dtype="int8", device="cpu", tokens_per_block=4, kv_cache_memory="4MiB",
              max_num_batched_tokens=64, max_beam_width=4)
    outputs = llm.generate([{"prompt_token_ids": s} for s in SOURCES],
                           SamplingParams(temperature=0.0, max_new_tokens=8), use_tqdm=False)
    for output in outputs:
        (completion,) = output.outputs
        assert completion.token_ids and (len(completion.token_ids) == 8 or completion.token_ids[-1] == EOS)
        assert all(0 <= t < 128 for t in completion.token_ids)


@pytest.mark.parametrize("shape", ["nllb-200-distilled-600M", "bart-base"])
def test_real_config_shapes_at_one_layer(shape, tmp_path):
    """The real d_model, heads, feed-forward, vocabulary and position table at one encoder and one
    decoder layer: encoder outputs, logits, greedy tokens and a W=4 beam search equal HF's."""
    config = NLLB_600M_SHAPE if shape.startswith("nllb") else BART_BASE_SHAPE
    hf = save_tiny_seq2seq(tmp_path, config, std=0.05, embed_std=0.05)
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", tokens_per_block=16, kv_cache_memory="16MiB",
              max_num_batched_tokens=64, max_beam_width=4)
    sources = [[5, 17, 33, 9, 1000, 3, EOS], list(range(300, 340)) + [EOS]]
    assert_encoder_outputs_match(llm, hf, sources)
    assert_logits_match(llm.engine, hf, sources, [[EOS, 40, 8000], [EOS]], decode_steps=2)
    params = BeamSearchParams(beam_width=4, max_new_tokens=6, num_return_sequences=2)
    assert_beam_search_matches(llm, hf, sources, params, 16, HF_SETTINGS, shape)


def test_older_checkpoint_names_load(family, tmp_path):
    """Hub checkpoints saved by older transformers store the tied copies (encoder and decoder
    embed_tokens, lm_head) and, for M2M100, a sinusoidal table placeholder; they load to the same
    model: greedy tokens equal the tiny model's."""
    import shutil

    from safetensors.torch import load_file, save_file

    tensors = load_file(str(family.path / "model.safetensors"))
    shared = tensors["model.shared.weight"]
    for name in ("model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight", "lm_head.weight"):
        tensors[name] = shared.clone()
    if "model.encoder.embed_positions.weight" not in tensors:  # computed positions (M2M100)
        tensors["model.encoder.embed_positions._float_tensor"] = torch.zeros(1)
        tensors["model.decoder.embed_positions._float_tensor"] = torch.zeros(1)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    for name in ("config.json", "generation_config.json"):
        shutil.copy(family.path / name, tmp_path / name)
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    older = LLM(str(tmp_path), dtype="float32", device="cpu", tokens_per_block=4, kv_cache_memory="4MiB",
                max_num_batched_tokens=64, max_beam_width=4)
    prompts = [{"prompt_token_ids": s} for s in SOURCES]
    expected = family.llm(4).generate(prompts, params, use_tqdm=False)
    got = older.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
