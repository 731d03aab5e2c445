"""A per-request decoder prefix (`decoder_prefix`) and a forced first token (`forced_bos_token_id`)
against transformers on the tiny Marian model: the prefix is HF's `decoder_input_ids` after the start
token (never scored; the length penalty counts generated tokens only), the forced token HF's
`forced_bos_token_id` (scored 0, counted in the length). Beams, scores and the self pool's budget."""

from __future__ import annotations

import math

import pytest
import torch
from beam_checks import assert_beams_match
from tiny_models import TINY_MARIAN_EOS as EOS
from tiny_models import TINY_MARIAN_PAD as PAD
from transformers import MarianMTModel

from widebeam.errors import InvalidParameterError
from widebeam.llm import LLM
from widebeam.params import BeamSearchParams, SamplingParams

SOURCES = [[5, 17, 33, 9, 100, 3, EOS], [7, 7, 9] * 4 + [EOS], [11, EOS]]
PREFIXES = [[40], [12, 90, 7], [3, 3, 3, 3, 3, 3]]
HF_SETTINGS = {"do_sample": False, "eos_token_id": EOS, "pad_token_id": PAD, "decoder_start_token_id": PAD,
               "bad_words_ids": [[PAD]], "forced_eos_token_id": None, "no_repeat_ngram_size": 0,
               "repetition_penalty": 1.0}
TOKENS_PER_BLOCK = 4


@pytest.fixture(scope="module")
def models(tiny_marian_dir):
    hf = MarianMTModel.from_pretrained(str(tiny_marian_dir), dtype=torch.float32).eval()
    llm = LLM(str(tiny_marian_dir), dtype="float32", device="cpu", tokens_per_block=TOKENS_PER_BLOCK,
              kv_cache_memory="8MiB", max_num_batched_tokens=64, max_beam_width=16)
    return llm, hf


def hf_generate(hf, source, params, **extra):
    with torch.no_grad():
        return hf.generate(torch.tensor([source]), num_beams=params.beam_width,
                           max_new_tokens=params.max_new_tokens, length_penalty=params.length_penalty,
                           early_stopping=params.early_stopping,
                           num_return_sequences=params.num_return_sequences,
                           min_new_tokens=params.min_new_tokens, output_scores=True,
                           return_dict_in_generate=True, **{**HF_SETTINGS, **extra})


def assert_pools_free(llm):
    for name, pool in llm.stats()["pools"].items():
        assert pool["free_blocks"] == pool["total_blocks"], name


# (beam_width, length_penalty, early_stopping, min_new_tokens)
CASES = [(1, 1.0, False, 0), (4, 1.0, False, 0), (4, 2.0, True, 2), (16, -1.0, "never", 0),
         (16, 0.5, False, 3)]


@pytest.mark.parametrize("beam_width, length_penalty, early_stopping, min_new", CASES)
def test_decoder_prefix_matches_decoder_input_ids(models, beam_width, length_penalty, early_stopping,
                                                  min_new):
    llm, hf = models
    params = [BeamSearchParams(beam_width=beam_width, max_new_tokens=8, length_penalty=length_penalty,
                               early_stopping=early_stopping, min_new_tokens=min_new, decoder_prefix=prefix)
              for prefix in PREFIXES]
    outputs = llm.generate([{"prompt_token_ids": s} for s in SOURCES], params, use_tqdm=False)
    for source, prefix, p, output in zip(SOURCES, PREFIXES, params, outputs):
        expected = hf_generate(hf, source, p, decoder_input_ids=torch.tensor([[PAD, *prefix]]))
        # HF's sequences hold the start token and the prefix; widebeam returns generated tokens only
        assert_beams_match(output, expected, 1 + len(prefix), PAD, EOS, beam_width, f"prefix {prefix}")
        # the prefix is the decoder's prompt: the self pool counts it (P = 1 + len(prefix))
        assert output.peak_blocks["self"] <= output.required_blocks["self"]
        assert output.required_blocks["cross"] == math.ceil(len(source) / TOKENS_PER_BLOCK)
    assert_pools_free(llm)


@pytest.mark.parametrize("beam_width, length_penalty, early_stopping, min_new", CASES)
def test_forced_bos_matches_transformers(models, beam_width, length_penalty, early_stopping, min_new):
    llm, hf = models
    forced = 77
    params = BeamSearchParams(beam_width=beam_width, max_new_tokens=8, length_penalty=length_penalty,
                              early_stopping=early_stopping, min_new_tokens=min_new,
                              forced_bos_token_id=forced)
    outputs = llm.generate([{"prompt_token_ids": s} for s in SOURCES], params, use_tqdm=False)
    for source, output in zip(SOURCES, outputs):
        expected = hf_generate(hf, source, params, forced_bos_token_id=forced)
        assert_beams_match(output, expected, 1, PAD, EOS, beam_width, f"source {source[:3]}")
        assert all(beam.token_ids[0] == forced for beam in output.outputs)
    assert_pools_free(llm)


def test_greedy_with_a_prefix_and_forced_bos(models):
    llm, hf = models
    cases = (({"decoder_prefix": [12, 90]}, {"decoder_input_ids": torch.tensor([[PAD, 12, 90]])}),
             ({"forced_bos_token_id": 50}, {"forced_bos_token_id": 50}))
    for extra, hf_extra in cases:
        params = SamplingParams(temperature=0, max_new_tokens=8, **extra)
        (output,) = llm.generate([{"prompt_token_ids": SOURCES[0]}], params, use_tqdm=False)
        with torch.no_grad():
            expected = hf.generate(torch.tensor([SOURCES[0]]), num_beams=1, max_new_tokens=8,
                                   **{**HF_SETTINGS, **hf_extra})[0]
        start = 1 + len(extra.get("decoder_prefix", ()))
        generated = [t for t in expected[start:].tolist() if t != PAD]
        assert output.outputs[0].token_ids == generated
    assert_pools_free(llm)


def test_a_long_prefix_counts_in_the_self_budget(models):
    """The prefix is decoder prompt: a W=8 request with a 30-token prefix reserves more self blocks
    than one without, exactly the bound's prompt term."""
    llm, _ = models
    base = BeamSearchParams(beam_width=8, max_new_tokens=4)
    (plain,) = llm.generate([{"prompt_token_ids": SOURCES[0]}], base, use_tqdm=False)
    (prefixed,) = llm.generate([{"prompt_token_ids": SOURCES[0]}], base.replace(decoder_prefix=[9] * 30),
                               use_tqdm=False)
    assert prefixed.required_blocks["self"] > plain.required_blocks["self"]
    assert prefixed.peak_blocks["self"] <= prefixed.required_blocks["self"]
    assert_pools_free(llm)


@pytest.mark.parametrize("params, field", [
    (BeamSearchParams(decoder_prefix=[10**6]), "decoder_prefix"),
    (BeamSearchParams(forced_bos_token_id=10**6), "forced_bos_token_id"),
])
def test_out_of_vocabulary_prefix_is_refused(models, params, field):
    llm, _ = models
    with pytest.raises(InvalidParameterError) as excinfo:
        llm.generate([{"prompt_token_ids": SOURCES[0]}], params, use_tqdm=False)
    assert excinfo.value.param == field
    assert_pools_free(llm)


@pytest.mark.parametrize("kwargs, field", [({"decoder_prefix": [-1]}, "decoder_prefix"),
                                           ({"decoder_prefix": ""}, "decoder_prefix"),
                                           ({"forced_bos_token_id": -2}, "forced_bos_token_id"),
                                           ({"forced_bos_token_id": True}, "forced_bos_token_id")])
def test_bad_values_are_refused_at_the_edge(kwargs, field):
    for cls in (BeamSearchParams, SamplingParams):
        with pytest.raises(InvalidParameterError) as excinfo:
            cls(**kwargs)
        assert excinfo.value.param == field
