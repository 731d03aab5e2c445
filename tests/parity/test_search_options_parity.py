"""`patience`, `max_input_length` and end-token lists through the engine, on a tiny Llama and the tiny
Marian.

- patience (CTranslate2's): live beams never depend on the finished hypotheses, so a patient search
  runs the same steps as an impatient one until the latter stops, and then keeps going: it keeps
  round(W * patience) hypotheses, a superset of those found at patience 1; its best W can only be
  as good or better, rank by rank, and patience 1 is the default search exactly.
- max_input_length: truncation equals giving the truncated prompt (a decoder-only prompt's last
  tokens, an encoder-decoder source's first); off, a prompt too long is still refused.
- stop_token_ids as CTranslate2's `end_token` list: any of them ends a hypothesis, as transformers'
  list of `eos_token_id`s does (sequences and scores equal to 1e-4, W in {1, 4, 16}).
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import TINY_MARIAN_EOS
from transformers import AutoModelForCausalLM

from widebeam.errors import InvalidParameterError
from widebeam.llm import LLM
from widebeam.params import BeamSearchParams, SamplingParams

PROMPTS = [[5, 17, 33, 9, 100, 3, 8], [7, 7, 9] * 6, list(range(3, 30)), [11, 12]]
SOURCES = [[5, 17, 33, 9, 100, 3, TINY_MARIAN_EOS], [7, 7, 9] * 4 + [TINY_MARIAN_EOS], [11, TINY_MARIAN_EOS]]
ENGINE = {"dtype": "float32", "device": "cpu", "tokens_per_block": 4, "kv_cache_memory": "16MiB",
          "max_num_batched_tokens": 64, "max_beam_width": 16, "max_seq_len": 64}


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), **ENGINE)


@pytest.fixture(scope="module")
def marian(tiny_marian_dir):
    return LLM(str(tiny_marian_dir), **ENGINE)


def beams(llm, prompts, params):
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[(b.token_ids, b.score) for b in out.outputs] for out in outputs]


@pytest.fixture(scope="module")
def ending_marian(tmp_path_factory):
    """The tiny Marian with a stronger EOS bias: hypotheses finish at many lengths, so when the
    search stops matters."""
    from tiny_models import save_tiny_marian

    path = tmp_path_factory.mktemp("tiny-marian-ending")
    save_tiny_marian(path, eos_logit_bias=6.0)
    return LLM(str(path), **ENGINE)


def test_patience_searches_longer_and_never_worse(ending_marian):
    improved = set()
    for beam_width, early_stopping in [(2, True), (4, True), (4, False), (8, True), (8, "never")]:
        base = BeamSearchParams(beam_width=beam_width, max_new_tokens=16, early_stopping=early_stopping)
        impatient = beams(ending_marian, SOURCES, base)
        assert beams(ending_marian, SOURCES, base.replace(patience=1.0)) == impatient
        for patience in (1.5, 2.0, 4.0):
            patient = beams(ending_marian, SOURCES, base.replace(patience=patience))
            for before, after in zip(impatient, patient):
                assert len(after) == len(before)
                for (_, score_before), (_, score_after) in zip(before, after):
                    assert score_after >= score_before - 1e-6
                if after != before:
                    improved.add((beam_width, early_stopping))
    # early_stopping=True stops at W finished: patience must change what it returns at every width
    assert {(2, True), (4, True), (8, True)} <= improved, improved


def test_patience_is_refused_where_it_cannot_apply():
    with pytest.raises(InvalidParameterError) as excinfo:
        BeamSearchParams(beam_width=1, patience=2.0)
    assert excinfo.value.param == "patience"
    for bad in (0.5, float("nan"), 1e9, True, "2"):
        with pytest.raises(InvalidParameterError) as excinfo:
            BeamSearchParams(patience=bad)
        assert excinfo.value.param == "patience"


def test_max_input_length_keeps_a_prompts_last_tokens(llama):
    prompt = PROMPTS[2]
    for params in (BeamSearchParams(beam_width=4, max_new_tokens=8),
                   SamplingParams(temperature=0, max_new_tokens=8)):
        (cut,) = llama.generate([{"prompt_token_ids": prompt}], params.replace(max_input_length=10),
                                use_tqdm=False)
        (given,) = llama.generate([{"prompt_token_ids": prompt[-10:]}], params, use_tqdm=False)
        assert cut.prompt_token_ids == prompt[-10:]
        assert [b.token_ids for b in cut.outputs] == [b.token_ids for b in given.outputs]
    # off by default: a prompt past max_seq_len is refused; with the option it runs
    long_prompt = [5] * 80
    with pytest.raises(InvalidParameterError) as excinfo:
        llama.generate([{"prompt_token_ids": long_prompt}], SamplingParams(max_new_tokens=4), use_tqdm=False)
    assert excinfo.value.param == "prompt"
    (out,) = llama.generate([{"prompt_token_ids": long_prompt}],
                            SamplingParams(max_new_tokens=4, max_input_length=32), use_tqdm=False)
    assert len(out.prompt_token_ids) == 32


def test_max_input_length_keeps_a_sources_first_tokens(marian):
    source = SOURCES[1]
    params = BeamSearchParams(beam_width=4, max_new_tokens=8)
    (cut,) = marian.generate([{"prompt_token_ids": source}], params.replace(max_input_length=5),
                             use_tqdm=False)
    (given,) = marian.generate([{"prompt_token_ids": source[:5]}], params, use_tqdm=False)
    assert cut.prompt_token_ids == source[:5]
    assert [b.token_ids for b in cut.outputs] == [b.token_ids for b in given.outputs]
    for bad in (0, -3, 2.5):
        with pytest.raises(InvalidParameterError) as excinfo:
            BeamSearchParams(max_input_length=bad)
        assert excinfo.value.param == "max_input_length"


@pytest.mark.parametrize("beam_width", [1, 4, 16])
def test_stop_token_ids_are_an_end_token_list(llama, tiny_llama_dir, beam_width):
    """Any listed id ends a hypothesis, as transformers' `eos_token_id=[...]` (CTranslate2's end_token
    list): the ids are taken from the unconstrained beams so that they do end some."""
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    ended = False
    for prompt in PROMPTS:
        base = BeamSearchParams(beam_width=beam_width, max_new_tokens=10)
        (plain,) = llama.generate([{"prompt_token_ids": prompt}], base, use_tqdm=False)
        ends = sorted({plain.outputs[0].token_ids[2], plain.outputs[-1].token_ids[4]} - {2})
        params = base.replace(stop_token_ids=ends)
        (output,) = llama.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        with torch.no_grad():
            expected = hf.generate(torch.tensor([prompt]), num_beams=beam_width, do_sample=False,
                                   max_new_tokens=10, num_return_sequences=beam_width,
                                   eos_token_id=[2, *ends],
                                   pad_token_id=0, output_scores=True, return_dict_in_generate=True)
        for rank, (beam, sequence) in enumerate(zip(output.outputs, expected.sequences)):
            # transformers pads after any of its EOS ids with the pad token: compare up to our length
            n = len(beam.token_ids)
            assert beam.token_ids == sequence[len(prompt):len(prompt) + n].tolist(), rank
            if beam.finish_reason == "stop":
                assert beam.token_ids[-1] in {2, *ends}
                ended |= beam.token_ids[-1] in ends
            if beam_width > 1:
                torch.testing.assert_close(beam.score, float(expected.sequences_scores[rank]), atol=1e-4,
                                           rtol=1e-5)
    assert ended, "no hypothesis ended on a listed id: the case tests nothing"
