"""What a lazy draft model is fed, counted exactly (`engine.drafting.drafter.stats()`), against values
derived by hand from the round protocol (speculative/round.py, `RequestDraft.plan_round`) for runs whose
every round is known: a greedy request with the target as its own draft (float32: it proposes what the
target picks, so a round with depth d takes d + 1 steps; test_speculative_lazy_draft checks that), D = 3.

Speed, not outputs, is at stake here (the outputs are plain decoding's whatever the draft is fed), so
only counts can catch a draft fed in a round that drafts nothing, a catch-up off by the step's budget,
or a prompt not fed again after a preemption.

Bookkeeping of one such request (P prompt tokens, N new ones, g generated so far, T = 4): the prompt's
last chunk chooses token 1; a round at g with the draft caught up feeds it the pending tokens, drafts a
chain of min(3, N - g - 1) nodes (feeding the draft every level but the deepest: `node_tokens`), and
a fully accepted round keeps the K/V of its first two nodes in both models, so the next round feeds 2
pending tokens (the deepest node's and the new one). A round that drafts nothing feeds the draft
nothing, and the next round that drafts first feeds it what it missed (`round_tokens` counts both),
within the step's token budget.
"""

from __future__ import annotations

import pytest
from test_speculative_lazy_draft import BackedOffLength, ScriptedLength

from widebeam.engine import LLMEngine
from widebeam.params import BeamSearchParams, SamplingParams

PROMPT = [5, 6, 7, 8, 5, 6, 7, 9, 10, 5, 6]  # P = 11
OPTIONS = {"device": "cpu", "kv_cache_memory": "16MiB", "tokens_per_block": 4, "max_beam_width": 4,
           "num_speculative_tokens": 3}
KEYS = ("prompt_tokens", "round_tokens", "node_tokens", "passes")


def self_draft_engine(model_dir, pattern=None, **options) -> LLMEngine:
    """The target as its own draft; drafting every round, or by `pattern` (1: draft, 0: do not)."""
    engine = LLMEngine(str(model_dir), **{**OPTIONS, **options}, speculative_model=str(model_dir),
                       speculative_adaptive=False)
    assert engine.drafting.lazy
    if pattern is not None:
        engine.drafting.shapes.new_length = lambda kind, width, max_nodes, adaptive=True, **_: ScriptedLength(
            max_nodes, pattern)
    return engine


def run_counting(engine: LLMEngine, prompt, params, preempt_before=()) -> list[dict]:
    """One request; after each step what that step fed the draft (KEYS) and what its round did
    (stats()["speculative"]: rounds, steps, drafted_tokens, refed_tokens), as differences."""
    engine.add_request("r", {"prompt_token_ids": list(prompt)}, params)
    per_step, step = [], 0

    def snapshot():
        spec = engine.stats()["speculative"]
        keys = ("rounds", "steps", "drafted_tokens", "refed_tokens")
        return {**engine.drafting.drafter.stats(), **{k: spec[k] for k in keys}}

    before = snapshot()
    while engine.has_unfinished():
        if step in preempt_before:
            assert engine.scheduler.preempt("r")
        step += 1
        for delta in engine.step():
            assert delta.error is None, delta.error
        after = snapshot()
        per_step.append({k: after[k] - before[k] for k in after})
        before = after
    return per_step


def column(per_step: list[dict], key: str) -> list[int]:
    return [step[key] for step in per_step]


def totals(per_step: list[dict]) -> dict:
    return {k: sum(step[k] for step in per_step) for k in per_step[0]}


def test_the_last_tokens_round_feeds_the_draft_nothing(tiny_llama_dir):
    """N = 10: rounds at g = 1 and g = 5 each draft a chain of 3 accepted whole (4 steps), landing on
    g = 9 = N - 1, whose round can draft nothing (one step is left): it runs the draft not at all,
    so the draft is fed the prompt, 1 + 2 pending tokens and 2 + 2 nodes, in 1 + 3 + 3 passes, and
    holds every token the target does but that last round's 2 pending ones."""
    engine = self_draft_engine(tiny_llama_dir)
    per_step = run_counting(engine, PROMPT, SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True))
    assert column(per_step, "steps") == [0, 4, 4, 1]
    assert column(per_step, "round_tokens") == [0, 1, 2, 0]
    assert column(per_step, "passes") == [1, 3, 3, 0]
    assert totals(per_step) == {"prompt_tokens": 11, "round_tokens": 3, "node_tokens": 4, "passes": 7,
                                "rounds": 3, "steps": 9, "drafted_tokens": 6, "refed_tokens": 2}
    kept_nodes = 2 + 2
    assert 11 + 3 + kept_nodes == len(PROMPT) + 10 - 1 - 2


@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_new_tokens=2, ignore_eos=True),
                                    BeamSearchParams(beam_width=4, max_new_tokens=2)],
                         ids=["greedy", "beam4"])
def test_a_two_token_request_runs_the_draft_for_its_prompt_only(tiny_llama_dir, params):
    """N = 2: the prompt chooses token 1 and the only round is the last token's, which drafts nothing:
    the draft model runs once, over the prompt."""
    engine = self_draft_engine(tiny_llama_dir)
    per_step = run_counting(engine, PROMPT, params)
    assert totals(per_step) == {"prompt_tokens": 11, "round_tokens": 0, "node_tokens": 0, "passes": 1,
                                "rounds": 1, "steps": 1, "drafted_tokens": 0, "refed_tokens": 0}


# the first round drafts, then `plain` rounds do not, then every round drafts
def lag_pattern(plain: int) -> list[int]:
    return [1] + [0] * plain + [1] * 40


def test_a_catch_up_of_exactly_the_step_budget_is_fed_at_once(tiny_llama_dir):
    """Budget 8 tokens a step (the prompt takes chunks of 8 and 3). After the first round (g 1 -> 5, the
    draft holding 14 tokens) 7 plain rounds take g to 12 (the target holds 22): the draft missed 8, the
    whole budget, so the next round feeds those 8 and its pending one, then drafts (4 steps to 16); the
    last round feeds 2 pending tokens and drafts 3 (4 steps to 20)."""
    engine = self_draft_engine(tiny_llama_dir, lag_pattern(7), max_num_batched_tokens=8)
    per_step = run_counting(engine, PROMPT, SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True))
    assert column(per_step, "prompt_tokens") == [8, 3] + [0] * 10
    assert column(per_step, "steps") == [0, 0, 4] + [1] * 7 + [4, 4]
    assert column(per_step, "round_tokens") == [0, 0, 1] + [0] * 7 + [8 + 1, 2]
    assert column(per_step, "node_tokens") == [0, 0, 2] + [0] * 7 + [2, 2]
    assert column(per_step, "drafted_tokens") == [0, 0, 3] + [0] * 7 + [3, 3]


def test_a_catch_up_past_the_step_budget_takes_its_shared_blocks_first(tiny_llama_dir):
    """As above with 8 plain rounds (g to 13, the target holding 23): the draft missed 9 > 8. It catches
    up its whole blocks first, positions 14 .. 19 (6 tokens; 20 .. 22 sit in the block the next token is
    written to), in a round that drafts nothing (1 step: g 14, the target holding 24); the next round
    feeds the other 4 missed, its pending one, and drafts (4 steps to 18); the last, at g = 18, drafts
    one node (2 steps), feeding the draft no level."""
    engine = self_draft_engine(tiny_llama_dir, lag_pattern(8), max_num_batched_tokens=8)
    per_step = run_counting(engine, PROMPT, SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True))
    assert column(per_step, "steps") == [0, 0, 4] + [1] * 8 + [1, 4, 2]
    assert column(per_step, "round_tokens") == [0, 0, 1] + [0] * 8 + [6, 4 + 1, 2]
    assert column(per_step, "drafted_tokens") == [0, 0, 3] + [0] * 8 + [0, 3, 1]
    assert column(per_step, "passes") == [1, 1, 3] + [0] * 8 + [1, 3, 1]


def test_after_a_preemption_the_draft_is_fed_its_prompt_exactly_once_more(tiny_llama_dir):
    """Preempted after its first round (g = 5; the draft held the prompt and 3 generated tokens: the
    pending one it was fed and the 2 nodes kept), the request prefills its prompt again, into both
    models, and its next round feeds all 5 generated tokens at once (the draft caught up from the
    prompt) and drafts as the unpreempted run's does. Against that run: the draft is fed the prompt
    once more, the 3 generated tokens it lost once more, in one more pass; everything else the same."""
    params = SamplingParams(temperature=0, max_new_tokens=14, ignore_eos=True)
    options = {"enable_prefix_caching": False, "scheduling_policy": "max_utilization"}
    reference = run_counting(self_draft_engine(tiny_llama_dir, **options), PROMPT, params)
    preempted = run_counting(self_draft_engine(tiny_llama_dir, **options), PROMPT, params, preempt_before={2})
    assert column(preempted, "prompt_tokens") == [11, 0, 11] + [0] * (len(preempted) - 3)
    assert column(preempted, "round_tokens")[:4] == [0, 1, 0, 5]
    want, got = totals(reference), totals(preempted)
    assert {k: got[k] - want[k] for k in want} == {"prompt_tokens": 11, "round_tokens": 3, "node_tokens": 0,
                                                   "passes": 1, "rounds": 0, "steps": 0,
                                                   "drafted_tokens": 0, "refed_tokens": 3}


@pytest.mark.parametrize("first_backed_off", [False, True], ids=["hit-trusted", "hit-not-trusted"])
def test_a_prefix_hit_is_the_drafts_only_while_every_prompt_reached_it(tiny_llama_dir, first_backed_off):
    """A first request (N = 2: its only round drafts nothing) leaves its 17-token prompt cached; a second
    shares its 4 whole blocks (16 tokens) and computes 3 more. While every prompt reached the draft, the
    hit holds the draft's K/V too: the draft is fed the 3 computed prompt tokens, then 1 pending token.
    Once a request that started backed off skipped its prompt, no hit is trusted: the second request's
    draft is fed none of its prompt and its first round catches all 19 up, with the pending one."""
    engine = self_draft_engine(tiny_llama_dir)
    first_length = (BackedOffLength if first_backed_off else ScriptedLength)(3, [1])
    lengths = iter([first_length, ScriptedLength(3, [1])])
    engine.drafting.shapes.new_length = lambda *args, **kwargs: next(lengths)
    first = list(range(3, 20))
    run_counting(engine, first, SamplingParams(temperature=0, max_new_tokens=2, ignore_eos=True))
    assert engine.drafting.drafter.stats()["prompt_tokens"] == (0 if first_backed_off else 17)
    assert engine.drafting.prompts.whole is not first_backed_off
    per_step = run_counting(engine, first[:16] + [50, 51, 52],
                            SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True))
    assert per_step[0]["prompt_tokens"] == (0 if first_backed_off else 3)
    assert column(per_step, "round_tokens")[:2] == [0, 19 + 1 if first_backed_off else 1]
    assert column(per_step, "steps") == [0, 4, 1]
