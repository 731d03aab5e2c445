"""The beam state's width schedule (`BeamSearchState` with `beam_width_schedule`) against a brute-force
beam search written here from the rules (HF's, with step k at width w_k): every candidate of every
live beam ranked in full, the first 2 w_k kept, EOS candidates finishing only within the first w_k
ranks, w_k non-EOS ones living on, the finished pool and the stopping rule at the final width
(a schedule of width 1 throughout is greedy search: the first EOS ends it)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from widebeam.beam.search import BeamSearchState
from widebeam.errors import InvalidParameterError
from widebeam.params import BeamSearchParams

VOCAB = 40
EOS = 2


def logprobs_of(tokens: tuple[int, ...], seed: int) -> torch.Tensor:
    """A fixed pseudo-random next-token distribution for every generated prefix."""
    generator = torch.Generator().manual_seed(hash((seed,) + tokens) % 2**62)
    logits = torch.randn(VOCAB, generator=generator) * 2.0
    logits[EOS] += 1.0  # so hypotheses do finish early
    return torch.log_softmax(logits, dim=-1)


def brute_force(params: BeamSearchParams, seed: int):
    final = params.final_beam_width
    beams = [((), torch.tensor(0.0))]  # (tokens, cumulative log-prob in float32)
    finished = []  # (score, tokens)
    n = params.max_new_tokens
    for k in range(1, n + 1):
        width = params.width_at_step(k)
        candidates = []
        for tokens, cumulative in beams:
            row = logprobs_of(tokens, seed)
            candidates += [(float(cumulative + row[t]), tokens + (t,), cumulative + row[t])
                           for t in range(VOCAB)]
        candidates.sort(key=lambda c: -c[0])
        live = []
        for rank, (value, tokens, cumulative) in enumerate(candidates[:2 * width]):
            if tokens[-1] == EOS or k == n:
                if rank < width:
                    finished.append((value / k ** params.length_penalty, tokens))
            elif len(live) < width:
                live.append((tokens, cumulative))
        finished = sorted(finished, key=lambda f: -f[0])[:final]
        if k == n:
            break
        beams = live
        if len(finished) >= final:
            if params.early_stopping is True or params.beam_width == 1:  # width 1 everywhere: greedy
                break
            length = n if params.early_stopping == "never" and params.length_penalty > 0 else k
            if not float(live[0][1]) / length ** params.length_penalty > finished[-1][0]:
                break
    return finished[:params.num_return_sequences]


def run_state(params: BeamSearchParams, seed: int):
    state = BeamSearchState(params, params.max_new_tokens, [EOS])
    rows = [()]
    while not state.done:
        result = state.step(torch.stack([logprobs_of(r, seed) for r in rows]))
        if result.empty:
            break
        rows = [tuple(t) for t in state.live_token_ids]
    return state.finalize()


@settings(max_examples=60, deadline=None)
@given(schedule=st.lists(st.integers(1, 6), min_size=1, max_size=5), seed=st.integers(0, 10**6),
       max_new_tokens=st.integers(5, 7), length_penalty=st.sampled_from([-1.0, 0.0, 1.0, 2.0]),
       early_stopping=st.sampled_from([True, False, "never"]))
def test_schedule_equals_brute_force(schedule, seed, max_new_tokens, length_penalty, early_stopping):
    params = BeamSearchParams(beam_width_schedule=schedule, max_new_tokens=max_new_tokens,
                              length_penalty=length_penalty, early_stopping=early_stopping)
    expected = brute_force(params, seed)
    got = run_state(params, seed)
    assert [h.token_ids for h in got] == [list(tokens) for _, tokens in expected]
    for hypothesis, (score, _) in zip(got, expected):
        assert hypothesis.score == pytest.approx(score, abs=1e-4)


def test_constant_schedule_is_plain_beam_search():
    plain = BeamSearchParams(beam_width=4, max_new_tokens=6)
    scheduled = BeamSearchParams(beam_width_schedule=[4], max_new_tokens=6)
    assert [h.token_ids for h in run_state(plain, 7)] == [h.token_ids for h in run_state(scheduled, 7)]


@pytest.mark.parametrize("kwargs, param", [
    ({"beam_width_schedule": []}, "beam_width_schedule"),
    ({"beam_width_schedule": [4, 0]}, "beam_width_schedule"),
    ({"beam_width_schedule": [4, 2.5]}, "beam_width_schedule"),
    ({"beam_width_schedule": [2] * 5, "max_new_tokens": 4}, "beam_width_schedule"),
    ({"beam_width_schedule": [2, 8], "beam_width": 3}, "beam_width"),
    ({"beam_width_schedule": [2, 8], "beam_width": 4}, "beam_width"),  # 4, the default's value, is given
    ({"beam_width_schedule": [8, 2], "num_return_sequences": 3}, "num_return_sequences"),
])
def test_schedule_errors_name_the_parameter(kwargs, param):
    with pytest.raises(InvalidParameterError) as error:
        BeamSearchParams(**kwargs)
    assert error.value.param == param


def test_schedule_sets_width_and_returns():
    params = BeamSearchParams(beam_width_schedule=[2, 16, 8])
    assert params.beam_width == 16 and params.num_return_sequences == 8
    assert [params.width_at_step(k) for k in (1, 2, 3, 9)] == [2, 16, 8, 8]
    assert params.replace(beam_width_schedule=[3]).num_return_sequences == 3


def test_a_width_not_given_is_none_and_resolves_to_an_int():
    """`beam_width=None` is "not given": the schedule's widest step, else 4; every reader gets an int."""
    assert BeamSearchParams().beam_width == 4 and isinstance(BeamSearchParams().beam_width, int)
    assert BeamSearchParams(beam_width=8).beam_width == 8
    assert BeamSearchParams(beam_width_schedule=[2, 8]).beam_width == 8
    assert BeamSearchParams(beam_width=8, beam_width_schedule=[2, 8]).beam_width == 8
    assert BeamSearchParams(beam_width=None) == BeamSearchParams(beam_width=4)
    assert BeamSearchParams().replace(beam_width_schedule=[3, 5]).beam_width == 5
    with pytest.raises(InvalidParameterError, match="beam_width and beam_width_schedule disagree"):
        BeamSearchParams(beam_width_schedule=[2, 8]).replace(beam_width=4)


def test_replace_keeps_what_was_given_even_at_the_defaults_value():
    """`num_return_sequences=4` at width 4 was given: a wider copy still returns 4 (an explicit value
    equal to the default, all beams, once read as not given); left out, it follows the width."""
    import pickle

    given = BeamSearchParams(beam_width=4, num_return_sequences=4)
    assert given.replace(beam_width=8).num_return_sequences == 4
    assert BeamSearchParams(beam_width=4).replace(beam_width=8).num_return_sequences == 8
    scheduled = BeamSearchParams(beam_width_schedule=[2, 8])
    assert scheduled.replace(beam_width_schedule=None).beam_width == 4  # not given: the default again
    assert BeamSearchParams(beam_width=8, beam_width_schedule=[2, 8]).replace(
        beam_width_schedule=None).beam_width == 8
    assert pickle.loads(pickle.dumps(given)).replace(beam_width=8).num_return_sequences == 4


@pytest.mark.parametrize("extra, param", [({"beam_width": 4}, "beam_width"), ({"best_of": 4}, "best_of")])
def test_http_width_beside_a_schedule_must_be_its_widest(extra, param):
    from widebeam.server.protocol import plan_request
    from widebeam.server.schemas import ApiError, CompletionRequest

    body = {"prompt": "hi", "use_beam_search": True, "beam_width_schedule": [2, 8]}
    with pytest.raises(ApiError) as error:
        plan_request(CompletionRequest(**body, **extra))
    assert error.value.param == param and "widest step (8)" in error.value.message
    assert plan_request(CompletionRequest(**body)).params[0].beam_width == 8
    assert plan_request(CompletionRequest(**body, beam_width=8)).params[0].beam_width == 8


def test_batch_row_width_overrides_the_jobs_other_kind():
    from widebeam.batch.rows import make_params

    # the job's --beam-width beside a row's own schedule (and the reverse) is the row's choice, not a clash
    assert make_params({"beam_width_schedule": [2, 8]}, {"beam_width": 4}).beam_width_schedule == (2, 8)
    assert make_params({"beam_width": 3}, {"beam_width_schedule": [2, 8]}).beam_width == 3
    # both in one row are the row's own, and must agree
    with pytest.raises(InvalidParameterError) as error:
        make_params({"beam_width": 4, "beam_width_schedule": [2, 8]})
    assert error.value.param == "beam_width"
