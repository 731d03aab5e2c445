"""A draft model that lags: a round that drafts nothing does not run the draft, and the next round
that drafts feeds each live sequence the tokens it missed (issue #34). Drafting is forced on and off
through the engine's policy factory (`engine.drafting.shapes.new_length`), so requests stop and resume
drafting while their beams fork and are pruned. Checked through the public engine:

- outputs equal plain decoding (greedy, W=4, W=16), with a perfect and a noisy draft and prompt lookup;
- the draft model runs in no plain round (its worker's `execute` is counted);
- the draft's K/V after every step equal the target's (a self-draft in float32 computes the same
  keys and values) for every position the request says the draft holds, in every live beam: a
  catch-up that missed or shifted one token fails here, though outputs would not change;
- a perfect draft's resumed rounds are accepted whole at W=1;
- every pool's peak stays within `required_blocks` and every block comes back.
"""

from __future__ import annotations

import pytest
import torch
from helpers import record_schedules
from tiny_models import save_noisy_copy

from widebeam.engine import LLMEngine
from widebeam.params import BeamSearchParams, SamplingParams
from widebeam.speculative.policy import DraftLength

OPTIONS = {"device": "cpu", "kv_cache_memory": "16MiB", "tokens_per_block": 4, "max_num_batched_tokens": 64,
           "max_beam_width": 16}
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 9, 10, 5, 6], list(range(3, 20))]
# 1: draft this round, 0: do not. Lags of 1 to 4 rounds, resumed in between.
PATTERN = [1, 0, 0, 1, 0, 1, 0, 0, 0, 0, 1, 1, 0]


class ScriptedLength(DraftLength):
    """Drafts D nodes or none by a fixed pattern; learns nothing."""

    def __init__(self, max_nodes: int, pattern: list[int]):
        super().__init__(max_nodes, adaptive=False)
        self.pattern = pattern
        self.num_rounds = 0

    def next_num_nodes(self) -> int:
        drafts = self.pattern[self.num_rounds % len(self.pattern)]
        self.num_rounds += 1
        return self.max_nodes if drafts else 0


@pytest.fixture(scope="module")
def noisy_draft_dir(tiny_llama_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-noisy-lazy")
    save_noisy_copy(tiny_llama_dir, path, noise=0.03)
    return path


def scripted_engine(model_dir, pattern=PATTERN, num_draft_tokens: int = 3, max_num_batched_tokens: int = 64,
                    **speculative) -> LLMEngine:
    options = {**OPTIONS, "max_num_batched_tokens": max_num_batched_tokens}
    engine = LLMEngine(str(model_dir), **options, num_speculative_tokens=num_draft_tokens, **speculative)
    engine.drafting.shapes.new_length = lambda kind, width, max_nodes, adaptive=True, **_: ScriptedLength(
        max_nodes, pattern)
    return engine


def run(engine: LLMEngine, requests, after_step=None, preempt_at=()):
    """All requests at once; per request the (tokens, score) of each output and its RequestOutput;
    every running request is preempted before each step in `preempt_at`. Checks every pool is back to
    its start."""
    free = engine.cache.num_free_blocks()
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
    finals = {}
    step = 0
    while engine.has_unfinished():
        if step in preempt_at:
            assert all(engine.scheduler.preempt(r.request_id) for r in list(engine.scheduler.running))
        step += 1
        deltas = engine.step()
        for delta in deltas:
            assert delta.error is None, delta.error
            if delta.finished:
                finals[delta.request_id] = delta.output
        if after_step is not None:
            after_step(engine)
    assert engine.cache.num_free_blocks() == free
    outputs = [finals[f"r{i}"] for i in range(len(requests))]
    return [[(c.token_ids, c.cumulative_logprob if c.score is None else c.score) for c in out.outputs]
            for out in outputs], outputs


def assert_same(expected, actual):
    for want, got in zip(expected, actual, strict=True):
        assert [t for t, _ in got] == [t for t, _ in want]
        for (_, want_score), (_, got_score) in zip(want, got):
            assert got_score == pytest.approx(want_score, rel=1e-5, abs=1e-6)


def mixed_requests():
    return ([(p, SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True)) for p in PROMPTS]
            + [(p, BeamSearchParams(beam_width=4, max_new_tokens=14)) for p in PROMPTS]
            + [(PROMPTS[1], BeamSearchParams(beam_width=16, max_new_tokens=10, length_penalty=0.5))])


@pytest.fixture(scope="module")
def plain_outputs(tiny_llama_dir):
    return run(LLMEngine(str(tiny_llama_dir), **OPTIONS), mixed_requests())[0]


class DraftKVCheck:
    """After every step: each running request's draft K/V equal the target's at the positions the
    draft holds, in every live sequence; tracks the largest lag seen and the catch-ups."""

    def __init__(self):
        self.max_lag_tokens = 0
        self.num_checked = 0
        self.num_caught_up = 0
        self._last = {}

    def __call__(self, engine: LLMEngine) -> None:
        target, draft = engine.workers[0].runner, engine.workers[1].runner
        for request in engine.scheduler.running:
            if not request.prompt_done or not request.pending_token_ids:
                continue
            kv, held = request.kv, request.draft.tokens
            for i in range(kv.num_sequences):
                assert held <= kv.num_tokens(i)
                self.max_lag_tokens = max(self.max_lag_tokens, kv.num_tokens(i) - held)
                want = target.kv_tensors["self"][:, :, kv.written_slots(i, 0, held, ["self"])["self"]]
                got = draft.kv_tensors["self"][:, :, kv.written_slots(i, 0, held, ["draft"])["draft"]]
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
                self.num_checked += 1
            if held > self._last.get(request.request_id, held) + 1:
                self.num_caught_up += 1  # more than one token in one step: missed ones came back
            self._last[request.request_id] = held


def test_lagging_self_draft_holds_the_targets_kv_and_is_exact(tiny_llama_dir, plain_outputs):
    engine = scripted_engine(tiny_llama_dir, speculative_model=str(tiny_llama_dir))
    assert engine.drafting.lazy
    check = DraftKVCheck()
    got, outputs = run(engine, mixed_requests(), after_step=check)
    assert_same(plain_outputs, got)
    assert check.max_lag_tokens >= 4 and check.num_caught_up >= 5 and check.num_checked > 100
    for out in outputs:
        assert set(out.peak_blocks) == {"self", "draft"}
        for name, peak in out.peak_blocks.items():
            assert 0 < peak <= out.required_blocks[name], (out.request_id, name)


@pytest.mark.parametrize("draft", ["noisy", "ngram"])
def test_stop_and_resume_drafting_is_exact(tiny_llama_dir, noisy_draft_dir, plain_outputs, draft):
    speculative = ({"speculative_method": "ngram"} if draft == "ngram"
                   else {"speculative_model": str(noisy_draft_dir)})
    assert_same(plain_outputs, run(scripted_engine(tiny_llama_dir, **speculative), mixed_requests())[0])


def test_catch_up_over_several_rounds(tiny_llama_dir, plain_outputs):
    """A lag past the step's token budget (16 tokens: a W=16 request misses 16 a round) is caught up
    over rounds that draft nothing; the draft's K/V stay the target's and outputs stay exact."""
    engine = scripted_engine(tiny_llama_dir, pattern=[1, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1],
                             max_num_batched_tokens=16, speculative_model=str(tiny_llama_dir))
    check = DraftKVCheck()
    assert_same(plain_outputs, run(engine, mixed_requests(), after_step=check)[0])
    assert check.max_lag_tokens >= 6


def test_draft_pass_stays_within_the_step_budget(tiny_llama_dir):
    """Every draft pass holds at most the step's token budget (prompt chunks and caught-up tokens)
    beyond what in-sync sequences feed (at most 1 + D each): the draft's activation reserve is sized
    for that, however far several requests lag."""
    budget, d = 16, 3
    engine = scripted_engine(tiny_llama_dir, pattern=[1, 0, 0, 0, 0, 0, 0, 0, 1, 1], num_draft_tokens=d,
                             max_num_batched_tokens=budget, speculative_model=str(tiny_llama_dir))
    calls, _ = draft_calls(engine, [
        (PROMPTS[1], BeamSearchParams(beam_width=16, max_new_tokens=14)),
        (PROMPTS[0], BeamSearchParams(beam_width=4, max_new_tokens=16)),
        (list(range(3, 40)), SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True))])
    assert any(sum(sizes) > budget for sizes in calls)  # the bound is reached, not idle
    for sizes in calls:
        assert sum(sizes) <= budget + len(sizes) * (1 + d), sizes


def test_preempted_lagging_requests_catch_up_from_their_prompt(tiny_llama_dir, plain_outputs):
    """Preempted while the draft lags and again mid-catch-up: the prompt comes back in both models,
    the re-fed tokens only in the target's (a re-feed round drafts nothing), and the next drafting
    round catches each sequence up from its prompt."""
    engine = scripted_engine(tiny_llama_dir, scheduling_policy="max_utilization", max_preemptions=10,
                             speculative_model=str(tiny_llama_dir))
    check = DraftKVCheck()
    got, outputs = run(engine, mixed_requests(), after_step=check, preempt_at={5, 9, 14})
    assert_same(plain_outputs, got)
    assert engine.stats()["scheduling"]["preemptions"] >= 9
    assert check.max_lag_tokens >= 6
    for out in outputs:
        assert all(peak <= out.required_blocks[name] for name, peak in out.peak_blocks.items())


def draft_calls(engine: LLMEngine, requests) -> tuple[list[list[int]], list[tuple[bool, int]]]:
    """Run `requests`, counting the draft worker's passes: (tokens per sequence of each pass, per step
    (whether it ran prompt chunks, passes so far))."""
    draft_worker, execute = engine.workers[1], engine.workers[1].execute
    calls = []

    def counted(seqs, **kwargs):
        calls.append([len(seq.token_ids) for seq in seqs])
        return execute(seqs, **kwargs)

    draft_worker.execute = counted
    steps = []
    schedules = record_schedules(engine)
    run(engine, requests, after_step=lambda engine: steps.append(
        (any(item.num_prompt_tokens for item in schedules[-1].scheduled), len(calls))))
    return calls, steps


@pytest.mark.parametrize("pattern", [[0], [0, 0, 0, 1]])
def test_draft_model_does_not_run_in_plain_rounds(tiny_llama_dir, pattern):
    """Never drafting after the prompt: the draft worker runs only in steps with prompt chunks.
    Drafting every fourth round: it runs in those rounds only, whose first pass feeds each sequence
    the tokens it missed (3 after 3 plain rounds of one step) and its pending one."""
    engine = scripted_engine(tiny_llama_dir, pattern=pattern, speculative_model=str(tiny_llama_dir))
    calls, steps = draft_calls(engine, [
        (PROMPTS[0], SamplingParams(temperature=0, max_new_tokens=13, ignore_eos=True)),
        (PROMPTS[1], BeamSearchParams(beam_width=4, max_new_tokens=13))])
    counts = [0] + [n for _, n in steps]
    round_steps = [i for i, (prompt, _) in enumerate(steps) if not prompt]
    drafting_steps = [i for i in round_steps if counts[i + 1] > counts[i]]
    if pattern == [0]:
        assert drafting_steps == [] and len(round_steps) >= 12
    else:
        assert 2 <= len(drafting_steps) <= len(round_steps) // 4 + 1
        first_passes = [calls[counts[i]] for i in drafting_steps]
        # 1 greedy sequence and 4 beams; after a round that accepted s steps, s + 2 missed ones
        assert first_passes[0] == [4] * 5 and all(min(sizes) >= 4 for sizes in first_passes), first_passes


def test_resumed_perfect_draft_is_accepted_whole(tiny_llama_dir):
    """At W=1 a self-draft whose cache was caught up proposes what the target picks: every resumed
    round takes D + 1 steps (a wrong catch-up would draft from the wrong context)."""
    engine = scripted_engine(tiny_llama_dir, pattern=[0, 0, 0, 1], num_draft_tokens=4,
                             speculative_model=str(tiny_llama_dir))
    steps = []

    def note(engine):
        for request in engine.scheduler.running:
            if request.draft.length.num_rounds and request.draft.length.num_rounds % 4 == 0:
                steps.append(request.last_round_steps)

    run(engine, [(PROMPTS[1], SamplingParams(temperature=0, max_new_tokens=41, ignore_eos=True))],
        after_step=note)
    assert len(steps) >= 4 and all(s == 5 for s in steps), steps


class BackedOffLength(ScriptedLength):
    """Starts backed off, as a new request of a shape where drafting lost does: the draft skips its
    prompt, and catches it up in the request's first drafting round."""

    @property
    def backed_off(self) -> bool:
        return self.num_rounds == 0


def backed_off_engine(model_dir, pattern, **options) -> LLMEngine:
    engine = LLMEngine(str(model_dir), **{**OPTIONS, **options}, num_speculative_tokens=3,
                       speculative_model=str(model_dir))
    engine.drafting.shapes.new_length = lambda kind, width, max_nodes, adaptive=True, **_: BackedOffLength(
        max_nodes, pattern)
    return engine


def test_a_request_that_starts_backed_off_costs_the_draft_no_prompt(tiny_llama_dir, plain_outputs):
    """Its prompt never reaches the draft model; the first round that drafts catches the prompt up
    (over rounds when it is past the step's budget), the draft's K/V equal the target's wherever the
    request says the draft holds them, and outputs are plain decoding's."""
    engine = backed_off_engine(tiny_llama_dir, [0, 0, 0, 1, 1, 0, 1], max_num_batched_tokens=16)
    check = DraftKVCheck()
    _, steps = draft_calls(engine, mixed_requests())
    assert not any(prompt and n > before for (prompt, n), before in zip(steps, [0] + [n for _, n in steps]))
    engine = backed_off_engine(tiny_llama_dir, [0, 0, 0, 1, 1, 0, 1], max_num_batched_tokens=16)
    assert_same(plain_outputs, run(engine, mixed_requests(), after_step=check)[0])
    assert check.num_caught_up >= 3 and check.num_checked > 50


def test_beams_catch_up_their_shared_prompt_once(tiny_llama_dir):
    """At W=4 the prompt's whole blocks are every beam's (and so are later ones while every beam
    descends from one): the first drafting round feeds them to the draft once (with beam 0), the rest
    of each beam's missed tokens per beam."""
    engine = backed_off_engine(tiny_llama_dir, [0, 0, 1])
    prompt = list(range(3, 14))  # 11 tokens: two whole blocks of 4 shared, the third copied per beam
    calls, _ = draft_calls(engine, [(prompt, BeamSearchParams(beam_width=4, max_new_tokens=8))])
    first = calls[0]
    shared = first[0] - first[1]  # whole blocks every beam holds: the prompt's two at least
    assert len(first) == 4 and len(set(first[1:])) == 1 and shared >= 8 and shared % 4 == 0, first
