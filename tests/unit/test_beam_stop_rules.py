"""When stop strings finish live beams, the search ends by the same rule as after a step: under
`early_stopping="never"` with a positive length penalty, a live beam is judged at the longest length
it could still reach (max_new_tokens), as transformers does, not at its current one. A case where the
two lengths disagree (a mutant that judges at the current length survived #22's mutation check)."""

from __future__ import annotations

import math

import torch
from helpers import live_cumulative_logprobs

from widebeam.beam import BeamSearchState
from widebeam.params import BeamSearchParams

EOS = 0


def rows(*probabilities: list[float]) -> torch.Tensor:
    return torch.log(torch.tensor(probabilities, dtype=torch.float32))


def test_finish_live_beams_judges_a_live_beam_at_its_reachable_length():
    params = BeamSearchParams(beam_width=2, max_new_tokens=100, early_stopping="never", length_penalty=1.0)
    state = BeamSearchState(params, 100, {EOS})
    state.step(rows([0.01, 0.6, 0.3, 0.09]))  # live: [1] (log .6), [2] (log .3)
    # both beams' EOS outrank every continuation: two finished hypotheses (scores -0.31, -0.65),
    # the live beams go on with [1, 1] (cumulative -3.51) and [1, 2] (-4.02)
    state.step(rows([0.9, 0.05, 0.03, 0.02], [0.9, 0.04, 0.03, 0.03]))
    assert len(state.finished) == 2 and len(state.live_token_ids) == 2 and not state.done
    state.finish_live_beams([0])  # a stop string ends [1, 1]; its score -1.75 does not enter the two kept
    best_finished_worst = min(h.score for h in state.finished)
    live = live_cumulative_logprobs(state)[0]
    assert math.isclose(live, math.log(0.6) + math.log(0.03), rel_tol=1e-5)
    # "never": -4.02 / 100 beats the worst kept (-0.65), so the search goes on; at the current
    # length (-4.02 / 2) it could not, and the search would end
    assert (live / 100 > best_finished_worst) and (live / 2 < best_finished_worst)
    assert not state.done and len(state.live_token_ids) == 1
