"""The engine's memory of drafting per request shape (speculative/policy.py, `DraftShapes`): a new
request of a shape where drafting lost starts backed off, now and then one probes at once (as often as
keeps the probes' loss a small share of the requests' time), a probe that pays brings the shape back,
and other shapes are untouched."""

from __future__ import annotations

import math

from widebeam.engine import LLMEngine
from widebeam.params import BeamSearchParams, SamplingParams
from widebeam.speculative import policy
from widebeam.speculative.policy import DraftShapes, StepShare, width_bucket


def lose(length, rounds: int = 6) -> None:
    """Rounds where drafting takes twice a plain round's time and gains nothing."""
    for _ in range(rounds):
        num_nodes = length.next_num_nodes()
        length.record(num_nodes, 1, 0.2 if num_nodes else 0.1)


def test_width_buckets():
    assert [width_bucket(w) for w in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == [1, 2, 4, 4, 8, 8, 16, 16, 32]


def test_a_new_request_of_a_losing_shape_starts_backed_off_and_probes_now_and_then():
    shapes = DraftShapes()
    first = shapes.new_length("draft", 4, 4)
    assert first.next_num_nodes() == 4  # nothing known: optimistic
    first.record(4, 1, 0.2)
    lose(first)
    assert shapes.shapes[("draft", 4)].loses()
    # A probe here loses a plain round's time (a drafting round costs 2 and gains nothing): requests
    # probe at once when those started backed off since the last probe hold 1 / _PROBE_COST_SHARE
    # plain rounds' time, every fifth request of 10 tokens, every request of as many tokens as that.
    gap = math.ceil(1.0 / policy._PROBE_COST_SHARE)
    for max_new_tokens, every in ((gap // 5, 5), (gap, 1)):
        starts = []
        for _ in range(2 * every):
            length = shapes.new_length("draft", 3, 4, max_new_tokens=max_new_tokens)  # width 3: same bucket
            starts.append(length.next_num_nodes())
        assert [i for i, n in enumerate(starts) if n] == [every - 1, 2 * every - 1], max_new_tokens
    # a backed-off request probes after as many plain rounds as keep the probes' loss at
    # `_PROBE_COST_SHARE` of the time: a drafting round here costs 2 plain rounds and gains nothing
    length = shapes.new_length("draft", 4, 4)
    backoff = math.ceil(1.0 / policy._PROBE_COST_SHARE)
    assert backoff > policy._MAX_BACKOFF_ROUNDS
    assert length.backed_off  # so a lazy draft skips its prompt (test_speculative_lazy_draft.py)
    assert [length.next_num_nodes() for _ in range(backoff)] == [0] * backoff
    assert length.next_num_nodes() == 4
    # other shapes and a non-adaptive request know nothing of it
    assert shapes.new_length("draft", 8, 4).next_num_nodes() == 4
    assert shapes.new_length("ngram", 4, 4).next_num_nodes() == 4
    assert shapes.new_length("draft", 4, 4, adaptive=False).next_num_nodes() == 4


def test_a_probe_that_pays_brings_the_shape_back():
    shapes = DraftShapes()
    lose(shapes.new_length("ngram", 4, 4), rounds=8)
    shape = shapes.shapes[("ngram", 4)]
    assert shape.loses()
    assert shapes.new_length("ngram", 4, 4, max_new_tokens=1).next_num_nodes() == 0
    probe = shapes.new_length("ngram", 4, 4, max_new_tokens=10_000)  # enough rounds to probe at once
    for _ in range(12):  # a copy task: every round takes 5 steps at 1.2 plain rounds' time
        num_nodes = probe.next_num_nodes()
        probe.record(num_nodes, 5 if num_nodes else 1, 0.12 if num_nodes else 0.1)
    assert not shape.loses()
    assert shapes.new_length("ngram", 4, 4).next_num_nodes() == 4


def test_greedy_prompt_lookup_always_tries_but_one_losing_round_ends_the_try():
    """W=1 prompt lookup is accepted when the request's own text recurs: a losing shape does not hold a
    new request back, but one round gaining nothing backs it off for long; one that gains keeps it."""
    shapes = DraftShapes()
    lose(shapes.new_length("ngram", 1, 4), rounds=8)
    assert shapes.shapes[("ngram", 1)].loses()
    failing = shapes.new_length("ngram", 1, 4)
    assert failing.next_num_nodes() == 4
    failing.record(4, 1, 0.2)
    backoff = policy._MAX_BACKOFF_ROUNDS
    assert [failing.next_num_nodes() for _ in range(backoff)] == [0] * backoff
    copying = shapes.new_length("ngram", 1, 4)
    drafted = []
    for _ in range(8):  # rounds of 3 steps at 1.1 plain rounds' time (one plain round is measured)
        num_nodes = copying.next_num_nodes()
        copying.record(num_nodes, 3 if num_nodes else 1, 0.11 if num_nodes else 0.1)
        drafted.append(num_nodes)
    assert drafted[:2] == [4, 4] and drafted.count(4) >= 7, drafted


def test_engine_requests_share_their_shape(tiny_llama_dir):
    engine = LLMEngine(str(tiny_llama_dir), device="cpu", kv_cache_memory="8MiB", tokens_per_block=4,
                       max_beam_width=4, speculative_method="ngram", num_speculative_tokens=3)
    engine.add_request("a", {"prompt_token_ids": list(range(3, 20))},
                       BeamSearchParams(beam_width=4, max_new_tokens=8))
    while engine.has_unfinished():
        engine.step()
    shape = engine.drafting.shapes.shapes[("ngram", 4)]
    assert shape.gained_steps is not None and shape.plain_round_s is not None


def test_a_losing_shape_where_trying_is_cheap_still_lets_requests_try_at_once():
    """Prompt lookup at W=4 on free text: a drafting round costs 1.1 plain rounds and gains nothing.
    New requests start backed off, but a probe loses so little that each one's rounds pay for one:
    each still finds out for itself (maybe it copies its prompt). Where a probe costs two plain
    rounds, one request in several probes at once."""
    def first_rounds(draft_round_s: float) -> list[int]:
        shapes = DraftShapes()
        length = shapes.new_length("ngram", 4, 4)
        for _ in range(8):
            num_nodes = length.next_num_nodes()
            length.record(num_nodes, 1, draft_round_s if num_nodes else 0.1)
        assert shapes.shapes[("ngram", 4)].starts_off()
        return [shapes.new_length("ngram", 4, 4, max_new_tokens=16).next_num_nodes() for _ in range(10)]

    assert first_rounds(0.11) == [4] * 10
    assert 0 < sum(1 for n in first_rounds(0.2) if n) <= 5


def test_a_lookup_that_finds_nothing_is_a_plain_round(tiny_llama_dir):
    """Prompt lookup with no recurring n-gram drafts nothing: such a round is a plain step at a plain
    step's cost, so the shape learns nothing about drafting from it (counted as a drafting round that
    gained nothing, free text would make the shape 'lose' and hold back the next request, which may
    copy its prompt)."""
    engine = LLMEngine(str(tiny_llama_dir), device="cpu", kv_cache_memory="16MiB", speculative_method="ngram",
                       num_speculative_tokens=3)
    # the tiny model's greedy continuation of these ids repeats nothing of its history in 6 tokens
    engine.add_request("r", {"prompt_token_ids": list(range(3, 15))},
                       SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    counts = engine.stats()["speculative"]
    assert counts["rounds"] >= 5 and counts["drafted_tokens"] == 0
    shape = engine.drafting.shapes.shapes[("ngram", 1)]
    assert shape.gained_steps is None and not shape.loses()


def test_a_plain_round_is_measured_in_a_step_where_nobody_drafts(tiny_llama_dir):
    """In a batch a step's time is everyone's: a request measuring its plain round while others draft
    would time their drafting as its plain round (and keep drafting where it loses). So a step in which
    any request is due for a measured plain round drafts nothing for anyone."""
    engine = LLMEngine(str(tiny_llama_dir), device="cpu", kv_cache_memory="16MiB", tokens_per_block=4,
                       speculative_model=str(tiny_llama_dir), num_speculative_tokens=3)
    for i, length in enumerate((5, 9, 13, 17)):  # prompts of other lengths: the requests start apart
        engine.add_request(f"r{i}", {"prompt_token_ids": list(range(3, 3 + length))},
                           SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True))
    measured_steps = 0
    while engine.has_unfinished():
        due = any(request.draft.wants_plain_round() for request in engine.scheduler.running)
        drafted = engine.stats()["speculative"]["drafted_tokens"]
        engine.step()
        if due:
            measured_steps += 1
            assert engine.stats()["speculative"]["drafted_tokens"] == drafted
    assert measured_steps > 0


def test_requests_batched_with_others_probe_at_once_as_much_more_rarely():
    """A probe's loss is the whole step's, while a request batched with five others holds a sixth of
    each step's time: such requests probe at once six times rarer than requests alone in their steps
    (their share: their beams over those of every request in the engine when they came)."""
    def num_probes(sequences_share: float) -> int:
        shapes = DraftShapes()
        lose(shapes.new_length("draft", 4, 4))  # drafting costs 2 plain steps and gains nothing
        return sum(bool(shapes.new_length("draft", 4, 4, max_new_tokens=10,
                                          sequences_share=sequences_share).next_num_nodes())
                   for _ in range(60))

    alone, batched = num_probes(1.0), num_probes(1 / 6)
    assert alone >= 10 and 0 < batched * 4 < alone, (alone, batched)


def test_a_shape_where_not_even_a_whole_accepted_draft_pays_is_not_probed_at_once():
    """A draft as big as the target on a CPU: a round costs 6.3 plain rounds, more than the 1 + D = 5
    steps a draft accepted whole gives. New requests never probe on their first round (whatever they
    would accept, it loses); one long enough still probes after its gap, so the shape can come back."""
    shapes = DraftShapes()
    first = shapes.new_length("draft", 1, 4)
    for _ in range(6):
        num_nodes = first.next_num_nodes()
        first.record(num_nodes, 5 if num_nodes else 1, 0.252 if num_nodes else 0.040)
    assert shapes.shapes[("draft", 1)].starts_off()
    assert not any(shapes.new_length("draft", 1, 4, max_new_tokens=64).next_num_nodes() for _ in range(200))
    long_request = shapes.new_length("draft", 1, 4, max_new_tokens=10_000)
    assert any(long_request.next_num_nodes() for _ in range(300))


def test_a_greedy_lookup_try_that_fails_in_a_batch_waits_as_long_as_its_share_asks():
    """W=1 prompt lookup from a losing shape tries once at once; failing, it waits as long as keeps such
    tries a small share of its time, by what the shape measured (a try costs 0.3 of a plain step of
    everyone's): one of six requests in its steps waits far longer than the doubling back-off's 16."""
    shapes = DraftShapes()
    lose_cheaply = shapes.new_length("ngram", 1, 4)
    for _ in range(8):
        num_nodes = lose_cheaply.next_num_nodes()
        lose_cheaply.record(num_nodes, 1, 0.13 if num_nodes else 0.1)
    trying = shapes.new_length("ngram", 1, 4, max_new_tokens=64, sequences_share=1 / 6)
    assert trying.next_num_nodes() == 4
    trying.record(4, 1, 0.13, StepShare(1 / 6, 1.0))
    assert not any(trying.next_num_nodes() for _ in range(60))


def test_hopeless_means_past_the_most_steps_a_round_of_that_width_can_take():
    """A draft model's tree at W > 4 branches 4 ways: D = 4 nodes are one level, a round takes 2 steps
    at most. There a drafting round of 3 plain rounds can never pay (no at-once probes), while at W=1
    (a chain of 4: 5 steps) it could, so there requests still probe at once now and then."""
    def num_at_once_probes(width: int) -> int:
        shapes = DraftShapes()
        first = shapes.new_length("draft", width, 4)
        for _ in range(6):  # 1.5 steps a round at 3 plain rounds' time: losing at either width
            num_nodes = first.next_num_nodes()
            first.record(num_nodes, 2 if num_nodes else 1, 0.3 if num_nodes else 0.1)
        return sum(bool(shapes.new_length("draft", width, 4, max_new_tokens=64).next_num_nodes())
                   for _ in range(40))

    assert num_at_once_probes(8) == 0 and num_at_once_probes(1) > 0
