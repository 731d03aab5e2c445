"""Marian (encoder-decoder) through widebeam against transformers' MarianMTModel on a tiny random model:
logits of the paged decoder with cross-attention through the 'cross' pool, then greedy, sampled and
beam search through the whole engine (several sources of different lengths in one `generate` call),
with the cross pool holding exactly ceil(E/T) blocks per request whatever the beam width. The checks
shared with the BART-family and T5 tests are in tests/seq2seq_checks.py."""

from __future__ import annotations

import pytest
import torch
from seq2seq_checks import (
    Seq2SeqModel,
    assert_beam_search_matches,
    assert_every_block_back,
    assert_generate_cli_matches,
    assert_greedy_matches,
    assert_logits_match,
)
from tiny_models import TINY_MARIAN_EOS as EOS
from tiny_models import TINY_MARIAN_PAD as PAD
from transformers import MarianMTModel

from widebeam.llm import LLM
from widebeam.params import BeamSearchParams, SamplingParams

# Sources of several lengths (E = 2 .. 37), each ending with EOS as Marian's tokenizer ends them.
SOURCES = [[5, 17, 33, 9, 100, 3, EOS], [7, 7, 9] * 4 + [EOS], list(range(3, 39)) + [EOS], [11, EOS]]
# Everything in HF's generation config that changes outputs, stated explicitly.
HF_SETTINGS = {"do_sample": False, "eos_token_id": EOS, "pad_token_id": PAD, "decoder_start_token_id": PAD,
               "bad_words_ids": [[PAD]], "forced_eos_token_id": None, "no_repeat_ngram_size": 0,
               "repetition_penalty": 1.0}

# (beam_width, tokens_per_block, length_penalty, early_stopping, num_return_sequences, min_new_tokens)
CASES = [
    (1, 4, 1.0, False, 1, 0),
    (4, 1, 1.0, True, 2, 0),
    (4, 16, 2.0, False, 4, 3),
    (4, 4, -1.0, "never", 2, 0),
    (8, 4, 0.0, True, 8, 0),
    (8, 16, 1.0, "never", 3, 2),
    (8, 1, -1.0, False, 4, 1),
]


def unpadded(sequence: torch.Tensor) -> list[int]:
    """HF's generated tokens without the padding after EOS (pad is also the start token, never generated)."""
    tokens = sequence.tolist()
    while tokens and tokens[-1] == PAD:
        tokens.pop()
    return tokens


@pytest.fixture(scope="module")
def models(tiny_marian_dir) -> Seq2SeqModel:
    hf = MarianMTModel.from_pretrained(str(tiny_marian_dir), dtype=torch.float32).eval()
    return Seq2SeqModel("marian", hf, tiny_marian_dir)


@pytest.mark.parametrize("tokens_per_block", [1, 3, 16])
def test_logits_match_with_cross_attention_from_the_pool(models, tokens_per_block):
    # Decoder prefixes of different lengths, all in one forward, logits of every token.
    decoder_ids = [[PAD, 4, 8, 9, 10], [PAD], [PAD] + [3] * 9, [PAD, 50, 51]]
    assert_logits_match(models.llm(tokens_per_block).engine, models.hf, SOURCES, decoder_ids, decode_steps=4)


@pytest.mark.parametrize("beam_width, tokens_per_block, length_penalty, early_stopping, num_return, min_new",
                         CASES)
def test_beam_search_matches_transformers(models, beam_width, tokens_per_block, length_penalty,
                                          early_stopping, num_return, min_new):
    params = BeamSearchParams(beam_width=beam_width, max_new_tokens=12, length_penalty=length_penalty,
                              early_stopping=early_stopping, num_return_sequences=num_return,
                              min_new_tokens=min_new)
    assert_beam_search_matches(models.llm(tokens_per_block), models.hf, SOURCES, params, tokens_per_block,
                               HF_SETTINGS, models.name)


def test_greedy_and_sampling_through_the_engine(models):
    llm = models.llm(4)
    assert_greedy_matches(llm, models.hf, SOURCES, HF_SETTINGS)
    sampled = llm.generate([{"prompt_token_ids": s} for s in SOURCES],
                           SamplingParams(temperature=1.0, seed=7, max_new_tokens=10), use_tqdm=False)
    again = llm.generate([{"prompt_token_ids": s} for s in SOURCES],
                         SamplingParams(temperature=1.0, seed=7, max_new_tokens=10), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in sampled] == [o.outputs[0].token_ids for o in again]
    assert all(PAD not in o.outputs[0].token_ids for o in sampled)
    assert_every_block_back(llm)


@pytest.mark.parametrize("beam_width", [1, 4])
def test_forced_eos_of_the_generation_config_matches_transformers(tmp_path, beam_width):
    """opus-mt's generation config forces EOS as the last allowed token (`forced_eos_token_id`)."""
    from tiny_models import save_tiny_marian

    hf = save_tiny_marian(tmp_path, forced_eos=True, eos_logit_bias=0.0)
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", tokens_per_block=4, kv_cache_memory="4MiB",
              max_num_batched_tokens=64, max_beam_width=8)
    max_new_tokens = 6
    params = BeamSearchParams(beam_width=beam_width, max_new_tokens=max_new_tokens,
                              num_return_sequences=beam_width)
    outputs = llm.generate([{"prompt_token_ids": s} for s in SOURCES], params, use_tqdm=False)
    for source, output in zip(SOURCES, outputs):
        with torch.no_grad():
            expected = hf.generate(torch.tensor([source]), num_beams=beam_width,
                                   num_return_sequences=beam_width, max_new_tokens=max_new_tokens,
                                   output_scores=True, return_dict_in_generate=True,
                                   **{**HF_SETTINGS, "forced_eos_token_id": EOS})
        assert len(output.outputs) == beam_width
        for rank, beam in enumerate(output.outputs):
            assert beam.token_ids == unpadded(expected.sequences[rank, 1:])
            assert beam.token_ids[-1] == EOS
            if beam_width > 1:
                torch.testing.assert_close(beam.score, float(expected.sequences_scores[rank]), atol=1e-4,
                                           rtol=1e-5)


def test_a_generation_config_without_forced_eos_wins_over_config_json(tmp_path):
    """As in transformers: a saved generation config is complete; config.json's forced EOS is ignored."""
    from tiny_models import save_tiny_marian

    hf = save_tiny_marian(tmp_path, eos_logit_bias=0.0, forced_eos_token_id=EOS)  # config.json only
    assert hf.generation_config.forced_eos_token_id is None
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", tokens_per_block=4, kv_cache_memory="4MiB",
              max_num_batched_tokens=64, max_beam_width=4)
    params = BeamSearchParams(beam_width=4, max_new_tokens=6)
    outputs = llm.generate([{"prompt_token_ids": s} for s in SOURCES], params, use_tqdm=False)
    settings = {k: v for k, v in HF_SETTINGS.items() if k != "forced_eos_token_id"}
    for source, output in zip(SOURCES, outputs):
        with torch.no_grad():
            expected = hf.generate(torch.tensor([source]), num_beams=4, max_new_tokens=6, **settings)
        assert len(output.outputs) == 4
        assert output.outputs[0].token_ids == unpadded(expected[0, 1:])


def test_loads_through_the_registry_with_shared_embeddings(models):
    model = models.llm(4).engine.model
    shared = model.model.shared.weight
    assert (model.model.encoder.embed_tokens.weight is shared
            and model.model.decoder.embed_tokens.weight is shared)
    assert model.lm_head.weight is shared
    torch.testing.assert_close(model.final_logits_bias, models.hf.final_logits_bias)


def test_generate_cli_translates_text_like_transformers(tmp_path):
    """A model directory with a tokenizer: `widebeam generate "text" --model DIR` encodes the text as
    the source and returns HF's beams and scores."""
    pytest.importorskip("sentencepiece")  # Marian's tokenizer (the dev extra installs it)
    from tiny_models import save_tiny_marian, save_tiny_marian_tokenizer

    tokenizer = save_tiny_marian_tokenizer(tmp_path)
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    hf = save_tiny_marian(tmp_path, vocab_size=len(tokenizer), pad=pad, eos=eos, eos_logit_bias=2.0)
    settings = {**HF_SETTINGS, "eos_token_id": eos, "pad_token_id": pad, "bad_words_ids": [[pad]],
                "decoder_start_token_id": pad}
    assert_generate_cli_matches(tmp_path, "the quick brown dog sat on the mat", tokenizer, hf, settings)
