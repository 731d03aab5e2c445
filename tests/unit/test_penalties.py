"""Repetition, presence and frequency penalties (decoding/penalties.py): validation, the processor
against transformers' `RepetitionPenaltyLogitsProcessor` and a plain presence / frequency reference,
per-row histories (the decoder's, moved with the beams; the penalties keep none), and where the engine
puts them (HF's order; none when off)."""

from __future__ import annotations

import math

import pytest
import torch
from decoder_checks import engine_decoder
from transformers import RepetitionPenaltyLogitsProcessor

from widebeam.decoding.context import TokenHistory
from widebeam.decoding.decoders import BeamDecoder, SamplingDecoder
from widebeam.decoding.penalties import TokenPenalties
from widebeam.decoding.processors import BanUntilMinTokens, BeamStateFollower
from widebeam.errors import InvalidParameterError
from widebeam.llm import LLM
from widebeam.params import BeamSearchParams, SamplingParams

VOCAB = 40
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    # drafting every round: the adaptive policy remembers shapes where drafting lost (host timing)
    return LLM(str(tiny_llama_dir), dtype="float32", device="cpu", kv_cache_memory="8MiB", max_beam_width=8,
               speculative_method="ngram", num_speculative_tokens=3, speculative_adaptive=False)


@pytest.mark.parametrize("cls", [SamplingParams, BeamSearchParams])
def test_validation(cls):
    params = cls()
    assert (params.repetition_penalty, params.presence_penalty, params.frequency_penalty) == (1.0, 0.0, 0.0)
    cls(repetition_penalty=0.5, presence_penalty=-2, frequency_penalty=2.0)
    for name, bad in [("repetition_penalty", 0), ("repetition_penalty", -1.0),
                      ("repetition_penalty", math.inf), ("repetition_penalty", math.nan),
                      ("repetition_penalty", True), ("repetition_penalty", "2"),
                      ("presence_penalty", 2.5), ("presence_penalty", -2.01), ("presence_penalty", math.nan),
                      ("frequency_penalty", 3), ("frequency_penalty", None), ("frequency_penalty", False)]:
        with pytest.raises(InvalidParameterError) as error:
            cls(**{name: bad})
        assert error.value.param == name


def _beam_rows(prompt, generated_rows):
    """A history that followed beams to these generated rows (all the same length): the first step
    forks the prompt's one row, every later step row i continues row i."""
    history = TokenHistory(prompt)
    for step in range(len(generated_rows[0])):
        parents = list(range(len(generated_rows))) if step else [0] * len(generated_rows)
        history.move(parents, [row[step] for row in generated_rows])
    return history


def test_repetition_matches_transformers_and_presence_frequency_a_reference():
    torch.manual_seed(0)
    prompt = [3, 5, 5, 9]
    generated = [[5, 11, 11, 2], [12, 12, 12, 30], [9, 3, 7, 1]]
    history = _beam_rows(prompt, generated)
    penalties = TokenPenalties(repetition_penalty=1.7, presence_penalty=0.6, frequency_penalty=0.45)
    scores = torch.randn(3, VOCAB) * 3
    scores[0, 11] = 0.0  # zero stays zero either way
    input_ids = torch.tensor([prompt + row for row in generated])
    expected = RepetitionPenaltyLogitsProcessor(1.7)(input_ids, scores.clone())
    for row, tokens in enumerate(generated):
        for t in set(tokens):
            expected[row, t] -= 0.45 * tokens.count(t) + 0.6
    got = scores.clone()
    penalties.process(got, history.context(3, len(generated[0]), CPU))
    torch.testing.assert_close(got, expected)
    # untouched tokens stay as they were
    untouched = [t for t in range(VOCAB) if t not in set(prompt) | {t for r in generated for t in r}]
    torch.testing.assert_close(got[:, untouched], scores[:, untouched])


def test_presence_frequency_count_only_generated_tokens_and_repetition_counts_the_prompt():
    penalties = TokenPenalties(presence_penalty=1.0, frequency_penalty=0.5)
    history = TokenHistory([4, 4, 6])
    scores = torch.zeros(1, VOCAB)
    penalties.process(scores, history.context(1, 0, CPU))
    assert torch.all(scores == 0)  # nothing generated yet: nothing to subtract
    for token in (6, 7, 6):  # one sequence: each step continues row 0
        history.move([0], [token])
    penalties.process(scores, history.context(1, 3, CPU))
    assert scores[0, 6] == -2.0 and scores[0, 7] == -1.5 and scores[0, 4] == 0
    repetition = TokenPenalties(repetition_penalty=2.0)
    history = TokenHistory([4, 4, 6])
    for token in (6, 7):
        history.move([0], [token])
    scores = torch.full((1, VOCAB), -1.0)
    scores[0, 4] = 3.0
    repetition.process(scores, history.context(1, 2, CPU))  # the two generated tokens count (6, 7)
    assert scores[0, 4] == 1.5 and scores[0, 6] == -2.0 and scores[0, 7] == -2.0 and scores[0, 8] == -1.0


def test_beam_history_follows_reorder_and_drop():
    penalties = TokenPenalties(repetition_penalty=2.0)
    assert not isinstance(penalties, BeamStateFollower)  # stateless: the history is the decoder's
    history = TokenHistory([1, 2])
    history.move([0, 0, 0], [10, 11, 12])
    history.move([2, 0, 2], [20, 21, 22])
    assert history.ids(CPU).tolist() == [[1, 2, 12, 20], [1, 2, 10, 21], [1, 2, 12, 22]]
    history.keep([0, 2])  # beam 1 finished on a stop string
    assert history.ids(CPU).tolist() == [[1, 2, 12, 20], [1, 2, 12, 22]]
    history.move([1, 0], [30, 31])
    history.keep([1])  # a drop before the move was read: the queued move loses the row
    assert history.ids(CPU).tolist() == [[1, 2, 12, 20, 31]]
    history = TokenHistory([1, 2])
    history.move([0, 0, 0], [10, 11, 12])
    history.move([2, 0, 2], [20, 21, 22])
    history.keep([0, 2])
    scores = torch.ones(2, VOCAB)
    penalties.process(scores, history.context(2, 2, CPU))
    assert scores[0, 20] == 0.5 and scores[0, 22] == 1 and scores[1, 22] == 0.5 and scores[1, 10] == 1
    with pytest.raises(ValueError):
        penalties.process(torch.ones(3, VOCAB), history.context(3, 2, CPU))


def test_engine_adds_penalties_first_and_nothing_when_off(llm):
    engine = llm.engine
    for params in (SamplingParams(temperature=0), BeamSearchParams(beam_width=4),
                   SamplingParams(repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0)):
        decoder = engine_decoder(engine, params, 8, prompt_token_ids=[1, 2])
        assert not any(isinstance(p, TokenPenalties) for p in decoder.processors)
    assert engine_decoder(engine, SamplingParams(temperature=0), 8).batched_greedy  # the batched argmax stays
    decoder = engine_decoder(engine, SamplingParams(temperature=0, presence_penalty=0.5, min_new_tokens=2), 8,
                              prompt_token_ids=[1, 2])
    assert isinstance(decoder, SamplingDecoder) and not decoder.batched_greedy
    assert (isinstance(decoder.processors[0], TokenPenalties)
            and isinstance(decoder.processors[1], BanUntilMinTokens))
    assert decoder.history.ids(CPU).tolist() == [[1, 2]]  # the one history the processors read
    decoder = engine_decoder(engine, BeamSearchParams(beam_width=4, repetition_penalty=1.2), 8,
                             prompt_token_ids=[1, 2])
    assert isinstance(decoder, BeamDecoder) and isinstance(decoder.processors[0], TokenPenalties)
    assert decoder.history.ids(CPU).tolist() == [[1, 2]]


def test_speculative_greedy_with_penalties_equals_plain_greedy(llm, tiny_llama_dir):
    """Prompt-lookup drafts verified one position at a time: the penalties see each verified token."""
    plain = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", kv_cache_memory="8MiB")
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 5, 6, 7, 9, 10, 5, 6]},
               {"prompt_token_ids": [3, 4, 50, 60] * 3}]
    for params in (SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True, repetition_penalty=1.4),
                   SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True, frequency_penalty=0.7,
                                  presence_penalty=0.3)):
        expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
        drafted = llm.engine.stats()["speculative"]["drafted_tokens"]
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == expected
        assert llm.engine.stats()["speculative"]["drafted_tokens"] > drafted, "nothing was drafted"


def test_catalogue_search_with_penalties_stays_in_the_catalogue(llm):
    items = [[5, 6, 7], [5, 6, 8], [9, 9, 9], [10, 11, 5], [12, 13, 14]]
    params = BeamSearchParams(beam_width=4, allowed_sequences=items,
                              repetition_penalty=3.0, presence_penalty=1.0)
    (output,) = llm.generate([{"prompt_token_ids": [5, 6, 9, 9]}], params, use_tqdm=False)
    assert output.outputs
    for beam in output.outputs:
        assert beam.token_ids[:-1] in items and beam.token_ids[-1] in llm.engine.eos_token_ids
