"""`no_repeat_ngram_size` and multi-token `bad_words_ids` against transformers' `generate` on a tiny Llama
and the tiny Marian, at W in {1, 4, 16} (beam search: sequences and `sequences_scores` to 1e-4; W=1 and
greedy sampling: tokens). The banned sequences come from each prompt's unbanned output, so every case
changes what is generated (checked), and no returned beam holds a banned n-gram or word (checked apart
from transformers)."""

from __future__ import annotations

import pytest
import torch
from beam_checks import assert_beams_match
from tiny_models import TINY_MARIAN_EOS, TINY_MARIAN_PAD
from transformers import AutoModelForCausalLM, MarianMTModel

from widebeam.errors import InvalidParameterError
from widebeam.llm import LLM
from widebeam.params import BeamSearchParams, SamplingParams

LLAMA_PROMPTS = [[5, 17, 33, 9, 100, 3, 8], [7, 7, 9] * 6, [11, 12]]
MARIAN_SOURCES = [[5, 17, 33, 9, 100, 3, TINY_MARIAN_EOS], [7, 7, 9] * 4 + [TINY_MARIAN_EOS],
                  [11, TINY_MARIAN_EOS]]
MAX_NEW_TOKENS = 12
ENGINE = {"dtype": "float32", "device": "cpu", "tokens_per_block": 4, "kv_cache_memory": "16MiB",
          "max_num_batched_tokens": 64, "max_beam_width": 16}


class Family:
    def __init__(self, llm, hf, prompts, start, pad, eos, hf_settings):
        self.llm, self.hf, self.prompts, self.start = llm, hf, prompts, start
        self.pad, self.eos, self.hf_settings = pad, eos, hf_settings

    def hf_generate(self, prompt, params, **extra):
        settings = {**self.hf_settings, **extra}
        if "bad_words_ids" in settings and "bad_words_ids" in self.hf_settings and "bad_words_ids" in extra:
            settings["bad_words_ids"] = self.hf_settings["bad_words_ids"] + extra["bad_words_ids"]
        with torch.no_grad():
            return self.hf.generate(torch.tensor([prompt]), num_beams=params.beam_width, do_sample=False,
                                    max_new_tokens=params.max_new_tokens,
                                    length_penalty=getattr(params, "length_penalty", 1.0),
                                    num_return_sequences=params.beam_width, output_scores=True,
                                    return_dict_in_generate=True, eos_token_id=self.eos,
                                    pad_token_id=self.pad, **settings)


@pytest.fixture(scope="module", params=["llama", "marian"])
def family(request, tiny_llama_dir, tiny_marian_dir):
    if request.param == "llama":
        hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
        return Family(LLM(str(tiny_llama_dir), **ENGINE), hf, LLAMA_PROMPTS, None, 0, 2, {})
    hf = MarianMTModel.from_pretrained(str(tiny_marian_dir), dtype=torch.float32).eval()
    # Marian's generation config bans its pad token; widebeam keeps that ban beside the request's
    settings = {"decoder_start_token_id": TINY_MARIAN_PAD, "bad_words_ids": [[TINY_MARIAN_PAD]],
                "forced_eos_token_id": None, "repetition_penalty": 1.0}
    return Family(LLM(str(tiny_marian_dir), **ENGINE), hf, MARIAN_SOURCES, 1, TINY_MARIAN_PAD,
                  TINY_MARIAN_EOS, settings)


def repeats_ngram(history: list[int], generated: list[int], n: int) -> bool:
    """Whether an n-gram ending at a generated token occurs earlier in history + generated."""
    tokens = history + generated
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    first_generated_gram = max(0, len(history) - n + 1)
    return any(grams[j] in grams[:j] for j in range(first_generated_gram, len(grams)))


def contains(tokens: list[int], word: tuple[int, ...]) -> bool:
    return any(tuple(tokens[i:i + len(word)]) == word for i in range(len(tokens) - len(word) + 1))


def run_and_compare(family, prompt, params, hf_extra, label):
    (output,) = family.llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    expected = family.hf_generate(prompt, params, **hf_extra)
    start = family.start if family.start is not None else len(prompt)
    # W=1: tokens only (transformers' greedy search reports no sequence score)
    assert_beams_match(output, expected, start, family.pad, family.eos, params.beam_width, label)
    return output


@pytest.mark.parametrize("beam_width", [1, 4, 16])
@pytest.mark.parametrize("ngram", [1, 2, 3])
def test_no_repeat_ngram_matches_transformers(family, beam_width, ngram):
    changed = False
    for prompt in family.prompts:
        base = BeamSearchParams(beam_width=beam_width, max_new_tokens=MAX_NEW_TOKENS)
        (plain,) = family.llm.generate([{"prompt_token_ids": prompt}], base, use_tqdm=False)
        params = base.replace(no_repeat_ngram_size=ngram)
        output = run_and_compare(family, prompt, params, {"no_repeat_ngram_size": ngram},
                                 f"prompt {prompt[:3]} n={ngram}")
        history = [family.pad] if family.start is not None else prompt  # the decoder's prompt
        for beam in output.outputs:
            assert not repeats_ngram(history, beam.token_ids, ngram), beam.token_ids
        changed |= [b.token_ids for b in plain.outputs] != [b.token_ids for b in output.outputs]
    assert changed, "no prompt's output changed: the case tests nothing"


@pytest.mark.parametrize("beam_width", [1, 4, 16])
@pytest.mark.parametrize("kind", ["multi", "single"])
def test_bad_words_match_transformers(family, beam_width, kind):
    changed = False
    for prompt in family.prompts:
        base = BeamSearchParams(beam_width=beam_width, max_new_tokens=MAX_NEW_TOKENS)
        (plain,) = family.llm.generate([{"prompt_token_ids": prompt}], base, use_tqdm=False)
        best = plain.outputs[0].token_ids
        # a bigram and a trigram of the unbanned best beam (a single token first would change the
        # beam before them), or its first token
        words = [tuple(best[1:3]), tuple(best[2:5])] if kind == "multi" else [(best[0],)]
        params = base.replace(bad_words_ids=words)
        output = run_and_compare(family, prompt, params, {"bad_words_ids": [list(w) for w in words]},
                                 f"prompt {prompt[:3]} bad {words}")
        for beam in output.outputs:
            assert not any(contains(beam.token_ids, w) for w in words if len(w) > 1), beam.token_ids
        changed |= [b.token_ids for b in plain.outputs] != [b.token_ids for b in output.outputs]
    assert changed


def test_greedy_sampling_params_take_both_bans(family):
    prompt = family.prompts[1]
    params = SamplingParams(temperature=0, max_new_tokens=MAX_NEW_TOKENS, no_repeat_ngram_size=2,
                            bad_words_ids=[[9, 7]])
    (output,) = family.llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    expected = family.hf_generate(prompt, BeamSearchParams(beam_width=1, max_new_tokens=MAX_NEW_TOKENS),
                                  no_repeat_ngram_size=2, bad_words_ids=[[9, 7]])
    start = family.start if family.start is not None else len(prompt)
    assert_beams_match(output, expected, start, family.pad, family.eos, 1, "greedy")


@pytest.mark.parametrize("kwargs, field", [
    ({"no_repeat_ngram_size": -1}, "no_repeat_ngram_size"),
    ({"no_repeat_ngram_size": 2.5}, "no_repeat_ngram_size"),
    ({"bad_words_ids": [[]]}, "bad_words_ids"),
    ({"bad_words_ids": [[1, -2]]}, "bad_words_ids"),
    ({"bad_words_ids": [3, 4]}, "bad_words_ids"),
    ({"bad_words_ids": "ab"}, "bad_words_ids"),
    ({"no_repeat_ngram_size": 2, "response_format": {"type": "json_object"}}, "no_repeat_ngram_size"),
])
def test_bad_values_are_refused_at_the_edge(kwargs, field):
    for cls in (BeamSearchParams, SamplingParams):
        with pytest.raises(InvalidParameterError) as excinfo:
            cls(**kwargs)
        assert excinfo.value.param == field


def test_out_of_vocabulary_words_are_refused(family):
    with pytest.raises(InvalidParameterError) as excinfo:
        family.llm.generate([{"prompt_token_ids": family.prompts[0]}],
                            BeamSearchParams(bad_words_ids=[[3, 10**6]]), use_tqdm=False)
    assert excinfo.value.param == "bad_words_ids"
