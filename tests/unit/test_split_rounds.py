"""A round wider than the step's token budget is split (sched/scheduler.py, request.py: `SplitRound`): its
rows are fed over several steps and it chooses once all are scored. Through the engine: the beams and
scores equal the same search in one step per token, no forward pass feeds more rows than the budget, a
greedy request beside a wide search gets a token every step, and preemption or abort between two parts
loses nothing (the conftest checks every engine's pools after each test)."""

from __future__ import annotations

import pytest

import widebeam.engine as engine_module
from widebeam.engine import LLMEngine
from widebeam.params import BeamSearchParams, SamplingParams

T = 4
WIDE = BeamSearchParams(beam_width=8, max_new_tokens=6, min_new_tokens=6)


def engine_of(model_dir, **kwargs) -> LLMEngine:
    return LLMEngine(str(model_dir), device="cpu", tokens_per_block=T, kv_cache_memory=120 * T * 512,
                     max_beam_width=8, **kwargs)


def prompt(seed: int) -> dict:
    return {"prompt_token_ids": [(7 * i + seed) % 120 + 3 for i in range(20)]}


def finish(engine: LLMEngine) -> tuple[int, dict]:
    """(steps run, each request's output)."""
    steps, outputs = 0, {}
    while engine.has_unfinished():
        steps += 1
        outputs.update({d.request_id: d.output for d in engine.step() if d.finished})
    return steps, outputs


def assert_same_beams(got, expected) -> None:
    """The same sequences in the same order; scores within float32 noise (a budget also chunks the
    prompt, and a pass's row count changes how its products are blocked)."""
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in expected.outputs]
    assert [c.cumulative_logprob for c in got.outputs] == pytest.approx(
        [c.cumulative_logprob for c in expected.outputs], abs=1e-4)


@pytest.fixture
def rows_per_pass(monkeypatch) -> list[int]:
    """The rows of every forward pass the engine runs (a spy on its one call into the model)."""
    seen = []
    real = engine_module.execute_step

    def spy(worker, inputs, num_rows, *args, **kwargs):
        seen.append(sum(len(seq.token_ids) for seq in inputs))
        return real(worker, inputs, num_rows, *args, **kwargs)

    monkeypatch.setattr(engine_module, "execute_step", spy)
    return seen


@pytest.mark.parametrize("policy", ["guaranteed_no_evict", "max_utilization"])
@pytest.mark.parametrize("budget", [3, 4, 7])
def test_a_round_wider_than_the_budget_is_split_and_chooses_the_same(tiny_llama_dir, rows_per_pass,
                                                                     policy, budget):
    whole = engine_of(tiny_llama_dir)
    whole.add_request("r", prompt(1), WIDE)
    whole_steps, expected = finish(whole)
    rows_per_pass.clear()
    split = engine_of(tiny_llama_dir, max_num_batched_tokens=budget, scheduling_policy=policy)
    split.add_request("r", prompt(1), WIDE)
    split_steps, got = finish(split)
    assert_same_beams(got["r"], expected["r"])
    assert max(rows_per_pass) <= budget
    # the prompt in chunks of the budget, then each of the 5 later rounds of 8 rows in ceil(8 / budget) steps
    assert split_steps == -(-20 // budget) + 5 * -(-8 // budget)
    assert whole_steps == 1 + 5


def test_a_greedy_request_beside_a_wide_search_gets_a_token_every_step(tiny_llama_dir):
    """The wide search runs first; the greedy one, more urgent, is admitted in a step of its own
    (`priority_yield`), then shares every step: its decode goes before the wide rows, which fill what
    is left of the budget."""
    engine = engine_of(tiny_llama_dir, max_num_batched_tokens=4, priority_yield=2)
    engine.add_request("wide", prompt(1), BeamSearchParams(beam_width=8, max_new_tokens=12, min_new_tokens=12,
                                                           priority=1))
    engine.step()
    wide = engine.scheduler.running[0]
    while wide.split is None:
        engine.step()
    greedy = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True, priority=0)
    engine.add_request("greedy", prompt(2), greedy)
    tokens_per_step, wide_rows = [], []
    while "greedy" in {r.request_id for r in (*engine.scheduler.running, *engine.scheduler.waiting)}:
        done_before = wide.split.num_done if wide.split else 0
        deltas = {d.request_id: d for d in engine.step()}
        tokens_per_step.append(len(deltas["greedy"].new_token_ids) if "greedy" in deltas else 0)
        wide_rows.append((wide.split.num_done if wide.split else 8) - done_before)
    first = next(i for i, n in enumerate(tokens_per_step) if n)
    assert tokens_per_step[first:] == [1] * 6  # a token every step from its first
    assert any(rows > 0 for rows in wide_rows[first + 1:])  # beside the wide search's rows
    _, outputs = finish(engine)
    alone = engine_of(tiny_llama_dir)
    alone.add_request("wide", prompt(1), BeamSearchParams(beam_width=8, max_new_tokens=12, min_new_tokens=12))
    assert_same_beams(outputs["wide"], finish(alone)[1]["wide"])


@pytest.mark.parametrize("how", ["preempt", "abort"])
def test_preemption_or_abort_between_two_parts_loses_nothing(tiny_llama_dir, how):
    engine = engine_of(tiny_llama_dir, max_num_batched_tokens=3)
    engine.add_request("r", prompt(1), WIDE)
    engine.step()
    request = engine.scheduler.running[0]
    while request.split is None or request.decoder.num_generated_tokens < 2:
        engine.step()
    assert request.split.num_done < 8  # between two parts of a round
    if how == "abort":
        engine.abort("r")
        assert not engine.has_unfinished()
        return
    assert engine.scheduler.preempt("r")
    _, outputs = finish(engine)
    alone = engine_of(tiny_llama_dir)
    alone.add_request("r", prompt(1), WIDE)
    assert_same_beams(outputs["r"], finish(alone)[1]["r"])
