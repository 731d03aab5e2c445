"""`no_repeat_ngram_size` and multi-token `bad_words_ids` against transformers' `generate` on a tiny Llama
and the tiny Marian, at W in {1, 4, 16} (beam search: sequences and `sequences_scores` to 1e-4; W=1 and
greedy sampling: tokens). The banned sequences come from each prompt's unbanned output, so every case
changes what is generated (checked), and no returned beam holds a banned n-gram or word (checked apart
from transformers). The exact edges (a history exactly n tokens long; exactly a word's prefix) are
generated with a first-step boost that the ban must overrule, and the processors are compared with
transformers' on every short history."""

from __future__ import annotations

import itertools

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


# -- the exact edges: a history exactly n tokens long, a history exactly as long as a word's prefix --
# transformers bans in both (`NoRepeatNGramLogitsProcessor` from `cur_len >= n`, `NoBadWordsLogitsProcessor`
# wherever the history ends with the prefix, however long the history is).
EDGE_BOOST = 50.0  # added to one token's first-step score: the pick without the ban, never with it


class HfBoostAtStart:
    """transformers' side of `boost_at_start`: +EDGE_BOOST to `token` on the first generated step."""

    def __init__(self, token: int, start_len: int):
        self.token, self.start_len = token, start_len

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] == self.start_len:
            scores[:, self.token] += EDGE_BOOST
        return scores


def boost_at_start(token: int):
    """A caller's processor (run after the engine's bans, as transformers runs `logits_processor` after its
    own): a banned token stays -inf, an allowed one wins the first step."""
    def boost(scores, num_generated_tokens):
        if num_generated_tokens == 0:
            scores[:, token] += EDGE_BOOST
    return boost


_EDGE_IDS = itertools.count()


def engine_generate(llm, prompt, params, processors=()):
    """One request through the engine with a caller's processors (what `LLM.generate` does not take)."""
    engine = llm.engine
    request_id = f"edge-{next(_EDGE_IDS)}"
    engine.add_request(request_id, {"prompt_token_ids": prompt}, params, logits_processors=processors)
    output = None
    while engine.has_unfinished():
        for delta in engine.step():
            assert delta.error is None, delta.error
            if delta.request_id == request_id and delta.finished:
                output = delta.output
    return output


def run_edge(family, prompt, params, ban: dict, boosted: int, label: str):
    """The edge case with the boost against transformers; the boosted token is the first pick without the
    ban (so the ban is what the case tests) and never with it."""
    plain = engine_generate(family.llm, prompt, params, [boost_at_start(boosted)])
    assert plain.outputs[0].token_ids[0] == boosted, f"{label}: the boost does not decide the first step"
    output = engine_generate(family.llm, prompt, params.replace(**ban), [boost_at_start(boosted)])
    start = family.start if family.start is not None else len(prompt)
    expected = family.hf_generate(prompt, params, **ban, logits_processor=[HfBoostAtStart(boosted, start)])
    assert all(beam.token_ids[0] != boosted for beam in output.outputs), f"{label}: the ban did not bite"
    assert_beams_match(output, expected, start, family.pad, family.eos, params.beam_width, label)


# W=1, W=4 and greedy sampling (transformers' side of the last is its W=1 greedy search)
EDGE_PARAMS = [BeamSearchParams(beam_width=width, max_new_tokens=6) for width in (1, 4)]
EDGE_PARAMS.append(SamplingParams(temperature=0, max_new_tokens=6))


# an encoder-decoder's history is its start token: [pad] * n is no history it has, so decoder-only only
@pytest.mark.parametrize("family", ["llama"], indirect=True)
@pytest.mark.parametrize("params", EDGE_PARAMS, ids=["W1", "W4", "greedy"])
@pytest.mark.parametrize("ngram", [1, 2, 3])
def test_no_repeat_ngram_bans_when_the_history_is_exactly_n_tokens(family, params, ngram):
    """The decoder's history is [x] * n (the prompt: a decoder-only model's): its one n-gram's first n-1
    tokens are its last n-1, so x is banned at once."""
    x = 40
    run_edge(family, [x] * ngram, params, {"no_repeat_ngram_size": ngram}, x, f"n={ngram}")


# an encoder-decoder's history on the first step is its one start token: a two-token word only
@pytest.mark.parametrize(("family", "word_len"), [("llama", 2), ("llama", 3), ("marian", 2)],
                         indirect=["family"])
@pytest.mark.parametrize("params", EDGE_PARAMS, ids=["W1", "W4", "greedy"])
def test_a_word_is_banned_when_the_history_is_exactly_its_prefix(family, params, word_len):
    """The history is exactly the word's prefix (the decoder-only prompt; the encoder-decoder's start
    token for a two-token word), so its last token is banned on the first step."""
    y = 77
    if family.start is None:
        prompt = [40, 41][:word_len - 1]
        word = prompt + [y]
    else:
        prompt, word = family.prompts[0], [family.pad, y]
    run_edge(family, prompt, params, {"bad_words_ids": [word]}, y, f"word {word}")


@pytest.mark.parametrize("ngram", [1, 2, 3, 4])
def test_the_processors_match_transformers_at_every_short_history(ngram):
    """Every history over 3 tokens of length n - 1 .. n + 2 (all of them: the edges included), through
    widebeam's processors against transformers' on the same scores; and words of 1-3 tokens."""
    from transformers import NoBadWordsLogitsProcessor, NoRepeatNGramLogitsProcessor

    from widebeam.decoding.bans import BadWords, NoRepeatNGram
    from widebeam.decoding.context import TokenHistory

    vocab = 5
    words = [[0, 1], [1, 1, 2], [2, 0, 0], [3]]
    for length in range(max(1, ngram - 1), ngram + 3):
        for history in itertools.product(range(3), repeat=length):
            ids = torch.tensor([history])
            for ours, theirs in ((NoRepeatNGram(ngram), NoRepeatNGramLogitsProcessor(ngram)),
                                 (BadWords(words, [4]), NoBadWordsLogitsProcessor(words, eos_token_id=4))):
                got = torch.zeros(1, vocab)
                ours.process(got, TokenHistory(list(history)).context(1, 0, torch.device("cpu")))
                want = theirs(ids, torch.zeros(1, vocab))
                assert torch.equal(got.isinf(), want.isinf()), (type(ours).__name__, history)
