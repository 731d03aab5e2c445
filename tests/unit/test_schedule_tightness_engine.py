"""A width schedule's KV bound (`kv/schedule_budget.py: scheduled_blocks`) is reached through the engine's
public path, not only on the bare allocator (tests/unit/test_kv_schedule_traces.py).

A logits processor decides every step: each live row offers one token of its own scored near 0
(rows ranked in order), and row 0 offers further tokens far below (for the extra beams of a growing
step); everything else (EOS included) is -1e4. So a step keeps every parent when the width grows and
the first w rows (distinct ancestors at every earlier step) when it falls: every beam diverges and
the ancestors stay as spread as the widths allow, the trace the bound's proof says reaches it."""

from __future__ import annotations

import pytest

from widebeam.kv.schedule_budget import scheduled_blocks
from widebeam.llm import LLM
from widebeam.params import BeamSearchParams


def spread(schedule):
    def processor(scores, num_generated_tokens):
        scores.fill_(-1e4)
        width = schedule[min(num_generated_tokens + 1, len(schedule)) - 1]  # the step being chosen
        rows = scores.shape[0]
        for row in range(rows):
            scores[row, 3 + (7 * row + num_generated_tokens) % 60] = -0.001 * row
        extra = width - rows if num_generated_tokens else width - 1
        for j in range(max(0, extra)):  # row 0's further children, below every row's own
            scores[0, 64 + (j + num_generated_tokens) % 60] = -1.0 - 0.01 * j
    return processor


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), dtype="float32", device="cpu", tokens_per_block=4, kv_cache_memory="4MiB",
               max_beam_width=8)


@pytest.mark.parametrize("schedule, prompt_tokens", [
    ((1, 1, 1, 1, 1, 4), 6), ((1, 2, 3, 5), 9), ((4, 2, 3), 5), ((2, 5, 3, 1, 4), 8), ((6,), 7),
])
def test_engine_reaches_the_schedule_bound(llm, schedule, prompt_tokens):
    engine = llm.engine
    params = BeamSearchParams(beam_width_schedule=list(schedule), max_new_tokens=12)
    engine.add_request("tight", {"prompt_token_ids": list(range(10, 10 + prompt_tokens))}, params,
                       logits_processors=[spread(schedule)])
    output = None
    while engine.has_unfinished():
        for delta in engine.step():
            if delta.finished:
                output = delta.output
    required = scheduled_blocks(prompt_tokens, 12, schedule, 4)
    assert output.required_blocks["self"] == required
    assert output.peak_blocks["self"] == required
    assert len(output.outputs) == schedule[-1]
