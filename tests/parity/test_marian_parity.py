"""Marian (encoder-decoder) through widebeam against transformers' MarianMTModel on a tiny random model:
logits of the paged decoder with cross-attention through the 'cross' pool, then greedy, sampled and
beam search through the whole engine (several sources of different lengths in one `generate` call),
with the cross pool holding exactly ceil(E/T) blocks per request whatever the beam width."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from beam_checks import assert_beams_match
from kv_helpers import allocate_table
from tiny_models import TINY_MARIAN_EOS as EOS
from tiny_models import TINY_MARIAN_PAD as PAD
from transformers import MarianMTModel

from widebeam.kv.tables import Holding
from widebeam.llm import LLM
from widebeam.model.runner import SequenceInput
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
def models(tiny_marian_dir):
    hf = MarianMTModel.from_pretrained(str(tiny_marian_dir), dtype=torch.float32).eval()
    return {}, hf, tiny_marian_dir


def get_llm(models, tokens_per_block):
    llms, _, path = models
    if tokens_per_block not in llms:
        llms[tokens_per_block] = LLM(str(path), dtype="float32", device="cpu",
                                     tokens_per_block=tokens_per_block,
                                     kv_cache_memory="8MiB", max_num_batched_tokens=64, max_beam_width=16)
    return llms[tokens_per_block]


@pytest.mark.parametrize("tokens_per_block", [1, 3, 16])
def test_logits_match_with_cross_attention_from_the_pool(models, tokens_per_block):
    engine, hf = get_llm(models, tokens_per_block).engine, models[1]
    self_manager, cross_manager = engine.cache["self"], engine.cache["cross"]
    cross_tables = [allocate_table(cross_manager, Holding(), len(s)) for s in SOURCES]
    engine.runner.encode(SOURCES, [cross_manager.slots(t) for t in cross_tables])
    # Decoder prefixes of different lengths, all in one forward, logits of every token.
    decoder_ids = [[PAD, 4, 8, 9, 10], [PAD], [PAD] + [3] * 9, [PAD, 50, 51]]
    tables = [self_manager.new_table(Holding()) for _ in decoder_ids]

    def inputs_for(tokens_per_seq, starts):
        return [SequenceInput(tokens, start, {"self": table.block_ids},
                              {"self": self_manager.append_slots(table, len(tokens))},
                              cross_block_table=cross.block_ids, num_encoder_tokens=cross.num_tokens)
                for tokens, start, table, cross in zip(tokens_per_seq, starts, tables, cross_tables)]

    logits = engine.runner.execute(inputs_for(decoder_ids, [0] * len(SOURCES)), all_logits=True)
    offset = 0
    with torch.no_grad():
        for source, decoder in zip(SOURCES, decoder_ids):
            expected = hf(input_ids=torch.tensor([source]),
                          decoder_input_ids=torch.tensor([decoder])).logits[0]
            torch.testing.assert_close(logits[offset:offset + len(decoder)], expected, atol=1e-4, rtol=1e-4)
            offset += len(decoder)
    # Then decode steps of all sequences together.
    for step in range(4):
        next_tokens = [[(7 * step + 3 * i) % 120 + 3] for i in range(len(SOURCES))]
        logits = engine.runner.execute(inputs_for(next_tokens, [len(d) for d in decoder_ids]))
        for decoder, token in zip(decoder_ids, next_tokens):
            decoder.extend(token)
        with torch.no_grad():
            for row, source, decoder in zip(logits, SOURCES, decoder_ids):
                expected = hf(input_ids=torch.tensor([source]),
                              decoder_input_ids=torch.tensor([decoder])).logits[0, -1]
                torch.testing.assert_close(row, expected, atol=1e-4, rtol=1e-4)
    for table in tables:
        self_manager.release(table)
    for table in cross_tables:
        cross_manager.release(table)
    assert engine.stats()["pools"]["self"]["free_blocks"] == engine.stats()["pools"]["self"]["total_blocks"]
    assert engine.stats()["pools"]["cross"]["free_blocks"] == engine.stats()["pools"]["cross"]["total_blocks"]


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
    outputs = llm.generate([{"prompt_token_ids": s} for s in SOURCES], params, use_tqdm=False)
    saw_eos = False
    for source, output in zip(SOURCES, outputs):
        with torch.no_grad():
            expected = hf.generate(torch.tensor([source]), num_beams=beam_width,
                                   max_new_tokens=max_new_tokens,
                                   length_penalty=length_penalty, early_stopping=early_stopping,
                                   num_return_sequences=num_return, min_new_tokens=min_new,
                                   output_scores=True, return_dict_in_generate=True, **HF_SETTINGS)
        assert output.prompt_token_ids == source
        assert len(output.outputs) == num_return
        # HF's sequences start with the decoder start token
        saw_eos |= assert_beams_match(output, expected, 1, PAD, EOS, beam_width, f"source {source[:4]}")
        assert all(PAD not in beam.token_ids for beam in output.outputs)  # bad_words_ids
        # The cross pool: ceil(E/T) blocks, once per request, whatever the beam width.
        cross_blocks = math.ceil(len(source) / tokens_per_block)
        assert output.required_blocks["cross"] == output.peak_blocks["cross"] == cross_blocks
        assert output.peak_blocks["self"] <= output.required_blocks["self"]
    if beam_width >= 4 and length_penalty <= 0:
        assert saw_eos, "the EOS paths were not exercised"
    for name, pool in llm.stats()["pools"].items():
        assert pool["free_blocks"] == pool["total_blocks"], name


def test_greedy_and_sampling_through_the_engine(models):
    llm, hf = get_llm(models, 4), models[1]
    outputs = llm.generate([{"prompt_token_ids": s} for s in SOURCES],
                           SamplingParams(temperature=0.0, max_new_tokens=10), use_tqdm=False)
    for source, output in zip(SOURCES, outputs):
        with torch.no_grad():
            expected = hf.generate(torch.tensor([source]), num_beams=1, max_new_tokens=10,
                                   **HF_SETTINGS)[0, 1:]
        assert len(output.outputs) == 1
        assert output.outputs[0].token_ids == expected.tolist()  # whole: an empty output fails
    sampled = llm.generate([{"prompt_token_ids": s} for s in SOURCES],
                           SamplingParams(temperature=1.0, seed=7, max_new_tokens=10), use_tqdm=False)
    again = llm.generate([{"prompt_token_ids": s} for s in SOURCES],
                         SamplingParams(temperature=1.0, seed=7, max_new_tokens=10), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in sampled] == [o.outputs[0].token_ids for o in again]
    assert all(PAD not in o.outputs[0].token_ids for o in sampled)
    for name, pool in llm.stats()["pools"].items():
        assert pool["free_blocks"] == pool["total_blocks"], name


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
    model = get_llm(models, 4).engine.model
    shared = model.model.shared.weight
    assert (model.model.encoder.embed_tokens.weight is shared
            and model.model.decoder.embed_tokens.weight is shared)
    assert model.lm_head.weight is shared
    torch.testing.assert_close(model.final_logits_bias, models[1].final_logits_bias)


def test_generate_cli_translates_text_like_transformers(tmp_path):
    """A model directory with a tokenizer: `widebeam generate "text" --model DIR` encodes the text as
    the source and returns HF's beams and scores."""
    pytest.importorskip("sentencepiece")  # Marian's tokenizer (the dev extra installs it)
    from tiny_models import save_tiny_marian, save_tiny_marian_tokenizer

    tokenizer = save_tiny_marian_tokenizer(tmp_path)
    hf = save_tiny_marian(tmp_path, vocab_size=len(tokenizer), pad=tokenizer.pad_token_id,
                          eos=tokenizer.eos_token_id, eos_logit_bias=2.0)
    text = "the quick brown dog sat on the mat"
    proc = subprocess.run([sys.executable, "-m", "widebeam", "generate", text, "--model", str(tmp_path),
                           "--beam-width", "4", "--max-new-tokens", "8", "--tokens-per-block", "4", "--json",
                           "--kv-cache-memory", "1MiB", "--device", "cpu"],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    source = tokenizer(text).input_ids
    with torch.no_grad():
        expected = hf.generate(torch.tensor([source]), num_beams=4, num_return_sequences=4, max_new_tokens=8,
                               output_scores=True, return_dict_in_generate=True,
                               **{**HF_SETTINGS, "eos_token_id": tokenizer.eos_token_id,
                                  "pad_token_id": tokenizer.pad_token_id,
                                  "bad_words_ids": [[tokenizer.pad_token_id]],
                                  "decoder_start_token_id": tokenizer.pad_token_id})
    for rank, beam in enumerate(result["outputs"]):
        generated = expected.sequences[rank, 1:].tolist()
        assert beam["token_ids"] == generated[:len(beam["token_ids"])]
        assert beam["text"] == tokenizer.decode(beam["token_ids"], skip_special_tokens=True)
        assert abs(beam["score"] - float(expected.sequences_scores[rank])) < 1e-4
    assert result["kv_peak_blocks"]["cross"] == math.ceil(len(source) / 4)
