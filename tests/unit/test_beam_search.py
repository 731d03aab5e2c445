"""`BeamSearchState` against transformers' own beam search, model-free: the state machine is driven with
log-probs that a tiny random Llama computes, without a KV cache, on the full sequence of each live beam, and
must give exactly what `generate(num_beams=W, do_sample=False)` gives: same hypotheses in the same order,
`score` allclose to `sequences_scores`."""

from __future__ import annotations

import dataclasses
import itertools
import math
import random

import pytest
import torch
from helpers import live_cumulative_logprobs

from widebeam.beam import BeamSearchState, Hypothesis, StepResult, hypothesis_score, length_normalizer
from widebeam.errors import InvalidParameterError
from widebeam.params import BeamSearchParams

VOCAB = 96
EOS = 2
SECOND_EOS = 47  # a token the model picks often: with it, hypotheses end at many lengths
PAD = 0
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15], [30], [40, 41, 60, 61, 80, 81, 3, 4, 90, 91, 20, 21]]
WIDTHS = [1, 2, 4, 8]
LENGTH_PENALTIES = [1.0, 0.0, 2.0, -0.5]
EARLY_STOPPING = [True, False, "never"]


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=1, eos_token_id=EOS, pad_token_id=PAD, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # peaky logits, so that EOS wins now and then
        for name, param in hf.named_parameters():
            if "norm" not in name:
                param.normal_(0, 0.3)
    return hf


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def next_logprobs(model, prompt, beams):
    """[len(beams), vocab] log_softmax of the next-token logits, computed without cache on prompt + beam."""
    ids = torch.tensor([prompt + beam for beam in beams])
    with torch.no_grad():
        # logits_to_keep=1 as transformers' generate does: the same matmul shapes give the same float32 bits
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False,
                       logits_to_keep=1).logits[:, -1]
    return torch.log_softmax(logits.float(), dim=-1)


def run_state(model, prompt, params, eos_ids):
    state = BeamSearchState(params, params.max_new_tokens, eos_ids)
    steps = 0
    while not state.done:
        live = state.live_token_ids
        assert len(live) == (1 if steps == 0 else params.beam_width)
        assert all(len(tokens) == steps for tokens in live)
        if steps == 0:
            # One row goes in. It is computed in a batch of W prompt copies, as transformers does, only so
            # that the float32 logits are bit-identical to its own (a batch of 1 may round differently).
            logprobs = next_logprobs(model, prompt, live * params.beam_width)[:1]
        else:
            logprobs = next_logprobs(model, prompt, live)
        result = state.step(logprobs)
        steps += 1
        if not result.empty:
            assert len(result) == params.beam_width
            extended = [live[p] + [t] for p, t in zip(result.parent_indices, result.token_ids)]
            assert extended == state.live_token_ids
    assert steps <= params.max_new_tokens
    return state.finalize()


def run_transformers(model, prompt, params, eos_ids):
    """(generated tokens, sequences_scores or None) per returned sequence, prompt and padding stripped."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=params.beam_width,
                             do_sample=False, max_new_tokens=params.max_new_tokens,
                             length_penalty=params.length_penalty, early_stopping=params.early_stopping,
                             num_return_sequences=params.num_return_sequences,
                             min_new_tokens=params.min_new_tokens, eos_token_id=sorted(eos_ids),
                             pad_token_id=PAD, output_scores=True,
                             return_dict_in_generate=True, use_cache=False)
    if params.beam_width == 1:  # generate(num_beams=1) is greedy search: one sequence, no score, no padding
        return [(out.sequences[0, len(prompt):].tolist(), None)]
    # beam_indices is -1 past each sequence's own end, which tells padding from generated tokens
    lengths = (out.beam_indices != -1).sum(dim=1).tolist()
    return [(out.sequences[i, len(prompt):len(prompt) + n].tolist(), out.sequences_scores[i].item())
            for i, n in enumerate(lengths)]


def sequence_logprob(model, prompt, tokens):
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1:-1]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return float(logprobs[torch.arange(len(tokens)), torch.tensor(tokens)].sum())


def assert_matches(model, prompt, params, eos_ids):
    ours = run_state(model, prompt, params, eos_ids)
    theirs = run_transformers(model, prompt, params, eos_ids)
    assert [h.token_ids for h in ours] == [tokens for tokens, _ in theirs], (params, prompt)
    for rank, (hyp, (tokens, score)) in enumerate(zip(ours, theirs)):
        length = len(tokens)
        if score is not None:
            assert math.isclose(hyp.score, score, rel_tol=0, abs_tol=1e-5), (params, prompt, hyp, score)
        expected_score = hyp.cumulative_logprob / length ** params.length_penalty
        assert hyp.score == pytest.approx(expected_score, rel=1e-6, abs=1e-5)
        if rank < 3:
            assert hyp.cumulative_logprob == pytest.approx(sequence_logprob(model, prompt, tokens), rel=1e-5,
                                                           abs=1e-4)
        ended_with_eos = tokens[-1] in eos_ids
        assert hyp.finish_reason == ("stop" if ended_with_eos else "length")
        assert ended_with_eos or length == params.max_new_tokens
        assert all(t not in eos_ids for t in tokens[:-1])
        assert not ended_with_eos or length > params.min_new_tokens
    return ours


def parity_cases():
    """Every (width, length_penalty, early_stopping) combination, with num_return_sequences, min_new_tokens,
    prompt and max_new_tokens rotating through their values; then the same with two EOS ids."""
    cases = []
    combos = list(itertools.product(WIDTHS, LENGTH_PENALTIES, EARLY_STOPPING))
    for i, (width, lp, early) in enumerate(combos):
        num_return = 1 if i % 2 == 0 else width
        min_new = 3 if (i // 2) % 2 else 0
        cases.append((width, lp, early, num_return, min_new, i % len(PROMPTS), (10, 7, 12)[i % 3], (EOS,)))
    for i, (width, lp, early) in enumerate(itertools.product([2, 4, 8], LENGTH_PENALTIES, EARLY_STOPPING)):
        if i % 2:
            continue
        num_return = width if i % 4 == 0 else 1
        cases.append((width, lp, early, num_return, 3 * (i % 3 == 0), (i + 1) % len(PROMPTS), 9,
                      (EOS, SECOND_EOS)))
    cases.append((16, 1.0, False, 16, 0, 0, 8, (EOS,)))
    cases.append((16, 2.0, "never", 5, 2, 1, 8, (EOS, SECOND_EOS)))
    return cases


@pytest.mark.parametrize("width, lp, early, num_return, min_new, prompt, max_new, eos_ids", parity_cases())
def test_matches_transformers(model, width, lp, early, num_return, min_new, prompt, max_new, eos_ids):
    params = BeamSearchParams(beam_width=width, max_new_tokens=max_new, length_penalty=lp,
                              early_stopping=early, num_return_sequences=num_return, min_new_tokens=min_new)
    ours = assert_matches(model, PROMPTS[prompt], params, set(eos_ids))
    assert len(ours) == num_return


def test_table_exercises_eos_and_every_value():
    cases = parity_cases()
    for column, values in [(0, WIDTHS), (1, LENGTH_PENALTIES), (2, EARLY_STOPPING), (4, [0, 3])]:
        assert set(values) <= {case[column] for case in cases}
    assert any(c[3] == 1 < c[0] for c in cases) and any(c[3] == c[0] > 1 for c in cases)
    assert any(len(c[7]) == 2 for c in cases) and {c[5] for c in cases} == set(range(len(PROMPTS)))


def test_hypotheses_end_early_and_settings_change_the_outcome(model):
    """The parity table would be weak if EOS never won or all settings gave the same answer."""
    base = BeamSearchParams(beam_width=4, max_new_tokens=10)
    results = {}
    for lp, early in itertools.product(LENGTH_PENALTIES, EARLY_STOPPING):
        params = base.replace(length_penalty=lp, early_stopping=early)
        results[lp, early] = run_state(model, PROMPTS[0], params, {EOS})
    ended_early = [h for hyps in results.values() for h in hyps if h.finish_reason == "stop"]
    assert ended_early and any(len(h.token_ids) < 10 for h in ended_early)
    assert all(h.token_ids[-1] == EOS for h in ended_early)
    distinct = {tuple(tuple(h.token_ids) for h in hyps) for hyps in results.values()}
    assert len(distinct) >= 3
    # min_new_tokens pushes EOS later: no hypothesis is shorter than min_new_tokens + 1
    hyps = run_state(model, PROMPTS[0], base.replace(min_new_tokens=6), {EOS})
    assert all(len(h.token_ids) >= 7 for h in hyps)


def test_matches_transformers_with_kv_cache(model):
    """transformers' default (KV cache) path: same hypotheses; scores to float32 noise."""
    params = BeamSearchParams(beam_width=4, max_new_tokens=10, length_penalty=1.0)
    ours = run_state(model, PROMPTS[1], params, {EOS})
    ids = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=4, do_sample=False,
                             max_new_tokens=10, num_return_sequences=4, eos_token_id=EOS, pad_token_id=PAD,
                             output_scores=True, return_dict_in_generate=True)
    lengths = (out.beam_indices != -1).sum(dim=1).tolist()
    assert [h.token_ids for h in ours] == [out.sequences[i, 7:7 + n].tolist() for i, n in enumerate(lengths)]
    scores = torch.tensor([h.score for h in ours])
    torch.testing.assert_close(scores, out.sequences_scores, rtol=1e-5, atol=1e-4)


def bigram_llama(seed, eos_ids, vocab=64, scale=2.5):
    """A one-layer Llama whose logits are mostly a bigram table chosen so that the EOS ids are near the top
    of every row and win about a quarter of the time: hypotheses end at all lengths, which exercises the
    early-stopping rules. The embeddings are one-hot, so the final RMSNorm scales them by ~sqrt(vocab) and
    `lm_head` holds the table; the decoder layer's small random weights add a context-dependent part. (A
    pure bigram model gives exactly equal float32 scores to beams that permute a cycle of tokens, and
    torch.topk orders exact ties arbitrarily, differently on different tensor shapes.)"""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=vocab, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                         bos_token_id=1, eos_token_id=eos_ids[0], pad_token_id=PAD, tie_word_embeddings=False)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    hf = LlamaForCausalLM(config).eval()
    table = torch.randn(vocab, vocab, generator=gen) * scale
    for eos in eos_ids:
        table[:, eos] = table.max(dim=1).values + torch.rand(vocab, generator=gen) * 4 - 3
    with torch.no_grad():
        for name, param in hf.model.layers.named_parameters():
            if "norm" not in name:
                param.normal_(0, 0.05, generator=gen)
        hf.model.embed_tokens.weight.copy_(torch.eye(vocab))
        hf.lm_head.weight.copy_(table.T.contiguous() / vocab ** 0.5)
    return hf


def bigram_case(seed):
    rng = random.Random(seed)
    eos_ids = rng.sample(range(3, 64), rng.choice([1, 1, 2, 3]))
    width = rng.choice([1, 2, 3, 4, 8, 16])
    max_new = rng.randint(3, 14)
    params = BeamSearchParams(beam_width=width, max_new_tokens=max_new,
                              length_penalty=rng.choice([1.0, 0.0, 2.0, -0.5, 0.7, -2.0]),
                              early_stopping=rng.choice([True, False, "never"]),
                              num_return_sequences=rng.randint(1, width),
                              min_new_tokens=min(max_new, rng.choice([0, 0, 1, 3])))
    prompt = [rng.randrange(3, 64) for _ in range(rng.randint(1, 5))]
    return eos_ids, params, prompt


@pytest.mark.parametrize("seed", range(80))
def test_matches_transformers_on_eos_heavy_bigram_model(seed):
    eos_ids, params, prompt = bigram_case(seed)
    assert_matches(bigram_llama(seed, eos_ids), prompt, params, set(eos_ids))


@pytest.mark.parametrize("width, lp, early, eos_ids", [
    (4, 2.0, True, (5,)), (4, 2.0, False, (5,)), (4, 2.0, "never", (5,)),
    (4, -0.5, "never", (5,)), (4, -2.0, "never", (5, 9)), (8, 0.7, "never", (5, 9)),
    (6, 1.0, False, (5, 9, 11)), (6, 1.0, True, (5, 9, 11)),
    (1, 2.0, "never", (5,)), (1, 0.7, "never", (5, 9)),
])
@pytest.mark.parametrize("seed", [101, 102, 103])
def test_early_stopping_rules_on_bigram_model(width, lp, early, eos_ids, seed):
    """Hypotheses finish early and often here, so each stopping rule decides when the search ends."""
    params = BeamSearchParams(beam_width=width, max_new_tokens=14, length_penalty=lp, early_stopping=early,
                              num_return_sequences=width)
    assert_matches(bigram_llama(seed, list(eos_ids)), [seed % 50 + 3], params, set(eos_ids))


@pytest.mark.parametrize("seed, lp", [(35, -0.5), (87, -0.2)])
def test_never_with_a_negative_length_penalty_bounds_at_the_current_length(seed, lp):
    """early_stopping="never" looks ahead to max_new_tokens only when length_penalty > 0 (cases found by
    checking that a variant which always looks ahead gives different hypotheses)."""
    eos_ids, params, prompt = bigram_case(seed)
    params = params.replace(early_stopping="never", length_penalty=lp, max_new_tokens=14)
    assert_matches(bigram_llama(seed, eos_ids), prompt, params, set(eos_ids))


@pytest.mark.parametrize("width, scale, min_new, eos_ids", [(16, 0.7, 0, (5,)), (12, 1.5, 2, (5, 9, 11))])
def test_wide_beams_over_a_larger_vocabulary(width, scale, min_new, eos_ids):
    """Flat rows: many beams hold several of the best continuations, so the deep top-k path runs."""
    params = BeamSearchParams(beam_width=width, max_new_tokens=6, length_penalty=1.0, min_new_tokens=min_new)
    assert_matches(bigram_llama(7, list(eos_ids), vocab=256, scale=scale), [3, 4], params, set(eos_ids))


# -- the state machine on synthetic log-probs ---------------------------------------------------------------


def table_logprobs(table, beams):
    """Log-probs looked up by the beam's last generated token (row 0 of `table` for the prompt)."""
    rows = [table[beam[-1] + 1 if beam else 0] for beam in beams]
    return torch.log_softmax(torch.stack(rows), dim=-1)


def test_first_step_takes_one_row_and_later_steps_w_rows():
    params = BeamSearchParams(beam_width=3, max_new_tokens=4)
    state = BeamSearchState(params, 4, {0})
    assert state.live_token_ids == [[]] and len(state.live_token_ids) == 1
    with pytest.raises(ValueError, match=r"\[1, vocab\]"):
        state.step(torch.zeros(3, 10))
    torch.manual_seed(1)
    table = torch.randn(11, 10) * 3
    result = state.step(table_logprobs(table, state.live_token_ids))
    assert result.parent_indices == [0, 0, 0] and len(set(result.token_ids)) == 3
    assert state.live_token_ids == [[t] for t in result.token_ids]
    with pytest.raises(ValueError, match=r"\[3, vocab\]"):
        state.step(torch.zeros(1, 10))


def test_max_new_tokens_one_returns_the_best_first_tokens():
    lp = torch.log_softmax(torch.tensor([[0.0, 3.0, 1.0, 2.0, -1.0]]), dim=-1)
    state = BeamSearchState(BeamSearchParams(beam_width=3, max_new_tokens=1, length_penalty=2.0), 1, {2})
    assert state.step(lp).empty and state.done
    hyps = state.finalize()
    assert [h.token_ids for h in hyps] == [[1], [3], [2]]
    assert [h.finish_reason for h in hyps] == ["length", "length", "stop"]
    assert [h.cumulative_logprob for h in hyps] == pytest.approx(lp[0, [1, 3, 2]].tolist())
    assert [h.score for h in hyps] == [h.cumulative_logprob for h in hyps]  # 1 ** 2.0 == 1


def test_eos_beyond_the_first_w_ranks_is_dropped_and_min_new_tokens_masks_eos():
    # vocab 6, EOS 5. Prompt: token 5 (EOS) ranks 3rd, so with W=2 it cannot finish and is not continued.
    first = torch.log_softmax(torch.tensor([[4.0, 3.0, -5.0, -5.0, -5.0, 2.0]]), dim=-1)
    state = BeamSearchState(BeamSearchParams(beam_width=2, max_new_tokens=5), 5, {5})
    result = state.step(first)
    assert result.token_ids == [0, 1] and state.finished == []
    # Now EOS ranks first: it finishes; min_new_tokens=3 would have masked it to -inf.
    nxt = torch.log_softmax(torch.tensor([[-5.0, -5.0, 1.0, 0.0, -5.0, 6.0]] * 2), dim=-1)
    state.step(nxt)  # both beams' EOS rank in the first W: both finish
    assert [h.token_ids for h in state.finished] == [[0, 5], [1, 5]]
    assert [h.finish_reason for h in state.finished] == ["stop", "stop"]
    masked = BeamSearchState(BeamSearchParams(beam_width=2, max_new_tokens=5, min_new_tokens=3), 5, {5})
    masked.step(first)
    result = masked.step(nxt)
    assert 5 not in result.token_ids and masked.finished == []


def test_stop_token_ids_and_ignore_eos():
    lp = torch.log_softmax(torch.tensor([[5.0, 1.0, 0.0, 0.0]]), dim=-1)
    params = BeamSearchParams(beam_width=1, max_new_tokens=3, stop_token_ids=(0,))
    state = BeamSearchState(params, 3, {3})
    assert state.eos_token_ids == {0, 3}
    assert state.step(lp).empty
    assert state.finalize()[0].token_ids == [0] and state.finalize()[0].finish_reason == "stop"
    state = BeamSearchState(params.replace(stop_token_ids=(), ignore_eos=True), 3, {0})
    assert state.eos_token_ids == frozenset()
    for _ in range(3):
        state.step(lp)
    [hyp] = state.finalize()
    assert hyp.token_ids == [0, 0, 0] and hyp.finish_reason == "length"


@pytest.mark.parametrize("stopped_index", [0, 1])
def test_finish_live_beams_keeps_a_stop_hypothesis(stopped_index):
    """A beam finished on a stop string is a hypothesis like one that ended on EOS. With
    length_penalty 0 the score is the cumulative log-prob, which only falls as a beam grows, so the
    best live beam stopped after 2 steps is the best hypothesis (every 6-step beam's 2-step prefix
    was a live beam, at most as good, then lost more); the second is kept too, for this seed."""
    torch.manual_seed(3)
    table = torch.randn(9, 8) * 2
    params = BeamSearchParams(beam_width=3, max_new_tokens=6, length_penalty=0.0)
    state = BeamSearchState(params, 6, set())
    state.step(table_logprobs(table, state.live_token_ids))
    state.step(table_logprobs(table, state.live_token_ids))
    live, scores = state.live_token_ids, live_cumulative_logprobs(state)
    state.finish_live_beams([stopped_index])
    assert state.live_token_ids == [b for i, b in enumerate(live) if i != stopped_index] and not state.done
    result = state.step(table_logprobs(table, state.live_token_ids))
    assert len(result) == 3 and max(result.parent_indices) <= 1
    while not state.done:
        state.step(table_logprobs(table, state.live_token_ids))
    hyps = state.finalize()
    stopped = [h for h in hyps if h.finish_reason == "stop"]
    assert len(stopped) == 1 and len(hyps) == 3
    assert stopped[0].token_ids == live[stopped_index]
    assert stopped[0].score == pytest.approx(scores[stopped_index])
    assert stopped[0].cumulative_logprob == pytest.approx(scores[stopped_index])
    if stopped_index == 0:
        assert hyps[0] is stopped[0] and all(stopped[0].score > h.score for h in hyps[1:])
    params = params.replace(length_penalty=1.0)
    # Finishing every live beam ends the search with those hypotheses.
    state = BeamSearchState(params, 6, set())
    state.step(table_logprobs(table, state.live_token_ids))
    live = state.live_token_ids
    with pytest.raises(IndexError):
        state.finish_live_beams([3])
    state.finish_live_beams(range(3))
    assert state.done
    assert sorted(h.token_ids for h in state.finalize()) == sorted(live)
    assert {h.finish_reason for h in state.finalize()} == {"stop"}
    with pytest.raises(RuntimeError):
        state.step(torch.zeros(3, 8))


def test_finalize_before_done_fills_with_live_beams():
    torch.manual_seed(4)
    table = torch.randn(9, 8)
    state = BeamSearchState(BeamSearchParams(beam_width=3, max_new_tokens=10), 10, set())
    for _ in range(2):
        state.step(table_logprobs(table, state.live_token_ids))
    hyps = state.finalize()
    assert len(hyps) == 3 and all(h.finish_reason == "length" and len(h.token_ids) == 2 for h in hyps)
    assert [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)


def test_step_accepts_other_dtypes_and_does_not_modify_the_input():
    lp = torch.log_softmax(torch.randn(1, 50), dim=-1)
    before = lp.clone()
    state = BeamSearchState(BeamSearchParams(beam_width=4, max_new_tokens=5, min_new_tokens=2), 5, {1, 2})
    state.step(lp)
    assert torch.equal(lp, before)
    state.step(torch.log_softmax(torch.randn(4, 50), dim=-1).to(torch.bfloat16))
    assert len(state.live_token_ids) == 4 and state.num_generated_tokens == 2


# -- scores and parameters ----------------------------------------------------------------------------------


def test_hypothesis_score():
    assert hypothesis_score(-6.0, 3, 1.0) == -2.0
    assert hypothesis_score(-6.0, 3, 0.0) == -6.0
    assert hypothesis_score(-6.0, 3, 2.0) == pytest.approx(-6.0 / 9)
    assert hypothesis_score(-6.0, 4, -0.5) == pytest.approx(-12.0)
    assert hypothesis_score(-1.5, 1, 2.0) == -1.5
    assert length_normalizer(4, 0.5) == 2.0
    # float32 like HF: the stored value is the float32 quotient
    assert hypothesis_score(-1.0, 3, 1.0) == float(torch.tensor(-1.0) / 3.0)
    assert hypothesis_score(-1.0, 3, 1.0) != -1.0 / 3.0
    with pytest.raises(ValueError):
        hypothesis_score(-1.0, 0, 1.0)


def test_hypothesis_dataclasses():
    assert StepResult().empty and len(StepResult([0], [5])) == 1
    hyp = Hypothesis([1, 2], -1.0, -0.5, "stop")
    assert hyp.token_ids == [1, 2] and hyp.finish_reason == "stop"


def test_params_defaults_and_replace():
    params = BeamSearchParams()
    assert (params.beam_width, params.max_new_tokens, params.length_penalty) == (4, 16, 1.0)
    assert params.early_stopping is False and params.min_new_tokens == 0 and params.ignore_eos is False
    assert params.num_return_sequences == 4 and params.stop == () and params.stop_token_ids == ()
    assert params.replace(beam_width=8).num_return_sequences == 8  # "all beams" follows the width
    assert params.replace(num_return_sequences=2).replace(beam_width=8).num_return_sequences == 2
    assert BeamSearchParams(stop="x", stop_token_ids=7).stop == ("x",)
    assert BeamSearchParams(stop_token_ids=[7, 8]).stop_token_ids == (7, 8)
    assert BeamSearchParams(early_stopping="never", max_new_tokens=None).early_stopping == "never"
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.beam_width = 3


@pytest.mark.parametrize("field, value, fragment", [
    ("beam_width", 0, ">= 1"), ("beam_width", 2.0, ">= 1"), ("beam_width", True, ">= 1"),
    ("max_new_tokens", 0, ">= 1"), ("length_penalty", float("nan"), "finite"),
    ("length_penalty", "1", "finite"), ("early_stopping", "always", "never"), ("early_stopping", 1, "never"),
    ("num_return_sequences", 5, "[1, beam_width=4]"), ("num_return_sequences", 0, "[1, beam_width=4]"),
    ("min_new_tokens", -1, ">= 0"), ("min_new_tokens", 17, "<= max_new_tokens"),
    ("stop_token_ids", ("a",), "int"), ("stop_token_ids", (-1,), ">= 0"),
    ("stop", ("",), "empty"),
])
def test_params_validation_names_the_field(field, value, fragment):
    with pytest.raises(InvalidParameterError) as info:
        BeamSearchParams(**{field: value})
    assert info.value.param == field
    assert str(info.value).startswith(field) and fragment in str(info.value)


def test_state_validation():
    with pytest.raises(ValueError, match="max_new_tokens"):
        BeamSearchState(BeamSearchParams(), 0, {2})
    with pytest.raises(TypeError):
        BeamSearchState(object(), 4, {2})
    state = BeamSearchState(BeamSearchParams(beam_width=2), 4, {2})
    with pytest.raises(ValueError, match="no beam"):
        state.finish_live_beams([0])
