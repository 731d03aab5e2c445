"""`return_alternatives` on the tiny Marian after a decoder prefix, against transformers: the alternatives'
first tokens are the most likely tokens of transformers' distribution at the first free position (pad
banned, as Marian's generation config bans it), in that order; each alternative's continuation is
transformers' greedy search from prefix + that token; each cumulative log-prob is the sum of
transformers' log-softmax along the sequence (1e-4). `min_alternative_expansion_prob` drops the
alternatives below it (the best always stays)."""

from __future__ import annotations

import math

import pytest
import torch
from tiny_models import TINY_MARIAN_EOS as EOS
from tiny_models import TINY_MARIAN_PAD as PAD
from transformers import MarianMTModel

from widebeam.errors import InvalidParameterError
from widebeam.llm import LLM
from widebeam.params import BeamSearchParams

SOURCES = [[5, 17, 33, 9, 100, 3, EOS], [7, 7, 9] * 4 + [EOS], [11, EOS]]
PREFIXES = [[40], [12, 90, 7], []]
MAX_NEW = 8


@pytest.fixture(scope="module")
def models(tiny_marian_dir):
    hf = MarianMTModel.from_pretrained(str(tiny_marian_dir), dtype=torch.float32).eval()
    llm = LLM(str(tiny_marian_dir), dtype="float32", device="cpu", tokens_per_block=4, kv_cache_memory="8MiB",
              max_num_batched_tokens=64, max_beam_width=16)
    return llm, hf


def hf_logprobs(hf, source, decoder_ids):
    with torch.no_grad():
        logits = hf(input_ids=torch.tensor([source]), decoder_input_ids=torch.tensor([decoder_ids])).logits
    return torch.log_softmax(logits[0].float(), -1)


@pytest.mark.parametrize("beam_width", [1, 4, 16])
def test_alternatives_match_transformers(models, beam_width):
    llm, hf = models
    for source, prefix in zip(SOURCES, PREFIXES):
        params = BeamSearchParams(beam_width=beam_width, max_new_tokens=MAX_NEW, decoder_prefix=prefix,
                                  return_alternatives=True)
        (output,) = llm.generate([{"prompt_token_ids": source}], params, use_tqdm=False)
        first = hf_logprobs(hf, source, [PAD, *prefix])[-1]
        first[PAD] = float("-inf")
        expected_first = torch.topk(first, beam_width).indices.tolist()
        assert [b.token_ids[0] for b in output.outputs] == expected_first
        for beam in output.outputs:
            start = [PAD, *prefix, beam.token_ids[0]]
            if beam.token_ids[0] != EOS and len(beam.token_ids) < MAX_NEW + 1:
                with torch.no_grad():
                    greedy = hf.generate(torch.tensor([source]), decoder_input_ids=torch.tensor([start]),
                                         num_beams=1, do_sample=False, max_new_tokens=MAX_NEW - 1,
                                         eos_token_id=EOS, pad_token_id=PAD, decoder_start_token_id=PAD,
                                         bad_words_ids=[[PAD]], forced_eos_token_id=None)[0, len(start):]
                rest = [t for t in greedy.tolist() if t != PAD]
                assert beam.token_ids[1:] == rest
            logprobs = hf_logprobs(hf, source, [PAD, *prefix, *beam.token_ids])[len(prefix):]
            expected = sum(float(logprobs[j, t]) for j, t in enumerate(beam.token_ids))
            assert beam.cumulative_logprob == pytest.approx(expected, abs=1e-4)
            assert beam.finish_reason == ("stop" if beam.token_ids[-1] == EOS else "length")


def test_min_alternative_expansion_prob_drops_unlikely_alternatives(models):
    llm, hf = models
    source, prefix = SOURCES[0], PREFIXES[0]
    first = hf_logprobs(hf, source, [PAD, *prefix])[-1]
    first[PAD] = float("-inf")
    probs = torch.topk(first, 8).values.exp().tolist()
    threshold = (probs[2] + probs[3]) / 2  # three alternatives pass
    params = BeamSearchParams(beam_width=8, max_new_tokens=4, decoder_prefix=prefix, return_alternatives=True,
                              min_alternative_expansion_prob=threshold)
    (output,) = llm.generate([{"prompt_token_ids": source}], params, use_tqdm=False)
    assert len(output.outputs) == 3
    assert all(math.exp(lp) >= threshold for lp in first[[b.token_ids[0] for b in output.outputs]].tolist())
    (best_only,) = llm.generate([{"prompt_token_ids": source}],
                                params.replace(min_alternative_expansion_prob=1.0), use_tqdm=False)
    assert [b.token_ids[0] for b in best_only.outputs] == [int(first.argmax())]


@pytest.mark.parametrize("kwargs, field", [
    ({"min_alternative_expansion_prob": 0.1}, "min_alternative_expansion_prob"),
    ({"return_alternatives": True, "min_alternative_expansion_prob": 1.5}, "min_alternative_expansion_prob"),
    ({"return_alternatives": True, "patience": 2.0}, "patience"),
    ({"return_alternatives": True, "early_stopping": True}, "early_stopping"),
    ({"return_alternatives": True, "decoder_prefix": [3], "prefix_bias_beta": 0.5}, "prefix_bias_beta"),
    ({"return_alternatives": True, "allowed_sequences": [[3]]}, "return_alternatives"),
    ({"return_alternatives": 1}, "return_alternatives"),
])
def test_refusals_name_the_field(kwargs, field):
    with pytest.raises(InvalidParameterError) as excinfo:
        BeamSearchParams(**kwargs)
    assert excinfo.value.param == field
