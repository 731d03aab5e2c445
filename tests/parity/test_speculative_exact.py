"""Speculative decoding changes speed, never output: greedy and beam search give the same tokens
and scores as the same engine without speculation, whatever the draft (the target itself, a noisy
copy that is often wrong, prompt lookup) and however many tokens it drafts; every pool of both
workers is whole after every scenario. (Plain beam search equals transformers: test_beam_parity.)"""

from __future__ import annotations

import random

import pytest
from tiny_models import save_noisy_copy

from widebeam.engine import LLMEngine
from widebeam.params import BeamSearchParams, SamplingParams

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 9, 10, 5, 6], list(range(3, 20)), [3, 4, 50, 60, 3, 4, 50, 60, 3]]
OPTIONS = {"device": "cpu", "kv_cache_memory": "8MiB", "tokens_per_block": 4, "max_num_batched_tokens": 64,
           "max_beam_width": 8}
BEAM_VARIANTS = [
    {},
    {"length_penalty": 0.5, "early_stopping": True},
    {"length_penalty": 2.0, "early_stopping": "never"},
    {"min_new_tokens": 7},
]


@pytest.fixture(scope="module")
def noisy_draft_dir(tiny_llama_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-noisy")
    save_noisy_copy(tiny_llama_dir, path, noise=0.03)
    return path


@pytest.fixture(scope="module")
def engines(tiny_llama_dir, noisy_draft_dir):
    """Engines built on first use: "plain", and (draft, D) for draft in self / noisy / ngram."""
    cache = {}

    def get(draft: str = "plain", num_draft_tokens: int = 0, adaptive: bool = False) -> LLMEngine:
        # Drafting every round by default: the replay is what is under test, and the adaptive
        # policy would skip rounds where the noisy draft keeps missing.
        key = (draft, num_draft_tokens, adaptive)
        if key not in cache:
            speculative = {} if draft == "plain" else {"speculative_adaptive": adaptive}
            if draft == "ngram":
                speculative.update(speculative_method="ngram", num_speculative_tokens=num_draft_tokens)
            elif draft != "plain":
                model = tiny_llama_dir if draft == "self" else noisy_draft_dir
                speculative.update(speculative_model=str(model), num_speculative_tokens=num_draft_tokens)
            cache[key] = LLMEngine(str(tiny_llama_dir), **OPTIONS, **speculative)
        return cache[key]

    return get


def run(engine: LLMEngine, requests: list[tuple[list[int], object]]) -> list[list[tuple]]:
    """All requests in one engine at once; per request (tokens, finish reason, score or, for
    sampling, cumulative log-prob) per output.
    Checks every pool of every worker is back to its start."""
    free = engine.cache.num_free_blocks()
    ids = [f"r{i}" for i in range(len(requests))]
    for request_id, (prompt, params) in zip(ids, requests):
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    finals = {}
    while engine.has_unfinished():
        for delta in engine.step():
            assert delta.error is None, delta.error
            if delta.finished:
                finals[delta.request_id] = delta.output
    assert engine.cache.num_free_blocks() == free
    return [[(c.token_ids, c.finish_reason, c.cumulative_logprob if c.score is None else c.score)
             for c in finals[i].outputs] for i in ids]


def assert_same(expected, actual):
    for want, got in zip(expected, actual, strict=True):
        assert [(t, r) for t, r, _ in got] == [(t, r) for t, r, _ in want]
        for (_, _, want_score), (_, _, got_score) in zip(want, got):
            # float32: the verify pass batches other shapes than a decode step, so the last bits move
            assert got_score == pytest.approx(want_score, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("draft", ["self", "noisy", "ngram"])
@pytest.mark.parametrize("num_draft_tokens", [1, 3, 5])
def test_beam_search_is_exact(engines, draft, num_draft_tokens):
    """W in {1, 2, 4, 8} with length-penalty and early-stopping variants and min_new_tokens, all in
    one engine at once (mixed widths, prefills beside speculative rounds)."""
    requests = [(prompt, BeamSearchParams(beam_width=width, max_new_tokens=10, **variant))
                for width in (1, 2, 4, 8) for variant in BEAM_VARIANTS for prompt in PROMPTS[:2]]
    assert_same(run(engines(), requests), run(engines(draft, num_draft_tokens), requests))


@pytest.mark.parametrize("draft", ["self", "noisy", "ngram"])
def test_greedy_is_exact(engines, draft):
    requests = [(prompt, SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True))
                for prompt in PROMPTS]
    requests += [(PROMPTS[0], SamplingParams(temperature=0, max_new_tokens=12, min_new_tokens=5))]
    assert_same(run(engines(), requests), run(engines(draft, 4), requests))


@pytest.mark.parametrize("draft", ["self", "noisy", "ngram"])
@pytest.mark.parametrize("width", [1, 4])
def test_eos_inside_a_drafted_span(engines, draft, width):
    """A stop token the plain run emits mid-output ends the search at the same token, though the
    draft proposed (and the target scored) tokens past it."""
    make = (lambda **kw: SamplingParams(temperature=0, **kw)) if width == 1 else (
        lambda **kw: BeamSearchParams(beam_width=width, **kw))
    free_run = run(engines(), [(PROMPTS[1], make(max_new_tokens=16, ignore_eos=True))])
    stop_token = free_run[0][0][0][5]  # the best output's sixth token
    requests = [(PROMPTS[1], make(max_new_tokens=16, stop_token_ids=[stop_token]))]
    expected = run(engines(), requests)
    assert any(reason == "stop" for _, reason, _ in expected[0])
    assert_same(expected, run(engines(draft, 5), requests))


def test_speculation_actually_accepts(engines):
    """The exactness above is not the trivial kind (one step per round): a perfect draft's chain is
    accepted whole at W=1 (D + 1 steps per round), a noisy draft's in part; at W=4 the tree still
    covers whole beam-search steps more than once per round, and the counters say so."""

    def steps_per_round(draft, width):
        engine = engines(draft, 3)
        before = dict(engine.stats()["speculative"])
        run(engine, [(prompt, BeamSearchParams(beam_width=width, max_new_tokens=13)) for prompt in PROMPTS])
        after = engine.stats()["speculative"]
        return (after["steps"] - before["steps"]) / (after["rounds"] - before["rounds"])

    perfect, noisy = steps_per_round("self", 1), steps_per_round("noisy", 1)
    assert perfect > 3.5  # 4 steps per round but where max_new_tokens cuts a round short
    assert 1.2 < noisy < perfect
    assert steps_per_round("self", 4) > 1.2


@pytest.mark.parametrize(("draft", "max_refed_per_round"), [("ngram", 0), ("self", 1)])
def test_accepted_chains_keep_their_kv(engines, draft, max_refed_per_round):
    """At W=1 a draft is a chain, its node j sits where the (j+1)-th fed token would: accepted nodes
    keep the K/V the verify pass wrote and the next round feeds the last chosen token alone. A draft
    model never fed its chain's deepest node, so an accepted deepest node is fed again (one a round);
    prompt lookup has no such node. Outputs stay plain's."""
    engine = engines(draft, 4)
    requests = [(prompt, BeamSearchParams(beam_width=1, max_new_tokens=17)) for prompt in PROMPTS]
    before = dict(engine.stats()["speculative"])
    assert_same(run(engines(), requests), run(engine, requests))
    after = engine.stats()["speculative"]
    rounds = after["rounds"] - before["rounds"]
    accepted = after["accepted_tokens"] - before["accepted_tokens"]
    assert accepted > (rounds if draft == "self" else 0)  # chains were accepted (the target's own: whole)
    assert after["refed_tokens"] - before["refed_tokens"] <= max_refed_per_round * rounds


@pytest.mark.parametrize("speculative", [{"speculative_method": "ngram"}, {"speculative_model": "self"}])
def test_exact_on_sliding_window_models(tiny_gemma3_dir, speculative):
    """Gemma 3 (five sliding layers to one full): the window cuts into prompt and tree, the pools
    are self, sliding_w and, with a draft, draft and draft/sliding_w; outputs stay exact."""
    options = {**OPTIONS, "max_seq_len": 128}
    if speculative.get("speculative_model") == "self":
        speculative = {"speculative_model": str(tiny_gemma3_dir)}
    plain = LLMEngine(str(tiny_gemma3_dir), **options)
    engine = LLMEngine(str(tiny_gemma3_dir), num_speculative_tokens=4, **options, **speculative)
    if "speculative_model" in speculative:
        assert {"draft", "self"} <= set(engine.cache.managers) and any(
            name.startswith("draft/sliding_") for name in engine.cache.managers)
    prompts = [list(range(3, 23)), [5, 6, 7, 8, 5, 6, 7, 9, 10, 5, 6, 7, 8, 5, 6]]
    requests = [(prompt, params) for prompt in prompts for params in (
        SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True),
        BeamSearchParams(beam_width=4, max_new_tokens=14),
        BeamSearchParams(beam_width=2, max_new_tokens=14, length_penalty=0.0))]
    assert_same(run(plain, requests), run(engine, requests))


def test_mixed_requests_in_one_engine(engines):
    """Greedy, seeded sampling and beam search of several widths decoding at once in one
    speculative engine (the adaptive draft length on: some requests draft, some back off), prompts
    prefilled beside rounds: greedy and beams as plain, sampled requests run to their length,
    every pool whole after."""
    requests = [(PROMPTS[0], SamplingParams(temperature=0, max_new_tokens=15, ignore_eos=True)),
                (PROMPTS[1], BeamSearchParams(beam_width=4, max_new_tokens=12)),
                (PROMPTS[2], SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_new_tokens=14,
                                            ignore_eos=True)),
                (PROMPTS[1], BeamSearchParams(beam_width=8, max_new_tokens=9, length_penalty=0.7)),
                (PROMPTS[2], SamplingParams(temperature=0, max_new_tokens=6, min_new_tokens=4))]
    expected, got = run(engines(), requests), run(engines("noisy", 3, adaptive=True), requests)
    deterministic = [i for i, (_, params) in enumerate(requests) if not isinstance(params, SamplingParams)
                     or params.temperature == 0]
    assert_same([expected[i] for i in deterministic], [got[i] for i in deterministic])
    assert len(got[2][0][0]) == 14


@pytest.mark.parametrize("draft", ["ngram", "self"])
@pytest.mark.parametrize("beam", [False, True])
def test_prompt_logprobs_are_the_same_with_speculation(engines, draft, beam):
    """One step loop for plain and speculative decoding: the prefill's prompt log-probs (every
    prompt position's logits from the same pass) come out as without speculation."""
    make = BeamSearchParams if beam else SamplingParams
    params = make(max_new_tokens=6, prompt_logprobs=3, logprobs=2,
                  **({"beam_width": 3} if beam else {"temperature": 0.0}))

    def prompt_entries(engine: LLMEngine) -> list:
        engine.add_request("p", {"prompt_token_ids": PROMPTS[0]}, params)
        while engine.has_unfinished():
            for delta in engine.step():
                assert delta.error is None, delta.error
                if delta.finished:
                    output = delta.output
        return output.prompt_logprobs, [c.token_ids for c in output.outputs]

    want_entries, want_tokens = prompt_entries(engines())
    got_entries, got_tokens = prompt_entries(engines(draft, 3))
    assert got_tokens == want_tokens
    assert len(got_entries) == len(PROMPTS[0]) and got_entries[0] is None
    for want, got in zip(want_entries[1:], got_entries[1:], strict=True):
        assert list(got) == list(want)  # the same tokens, ranks first
        for token, entry in got.items():
            assert entry.rank == want[token].rank
            assert entry.logprob == pytest.approx(want[token].logprob, rel=1e-5, abs=1e-6)


def test_beam_search_is_exact_where_each_beam_drafts_its_own_tree(engines):
    """W > 1 with a deep perfect draft (D = 16, the target itself) over varied prompts: every beam
    drafts a tree of its own (its own context), rounds often stay inside the trees for three steps and
    more, and by the second step a beam's row in the step is no longer its old sequence's (beams reorder).
    The replay must follow each chosen node in its own sequence's tree; a lookup in another sequence's
    tree scores the wrong context (or leaves the tree early) and the tokens differ from plain's."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 128) for _ in range(rng.randrange(3, 20))] for _ in range(24)]
    requests = [(prompt, BeamSearchParams(beam_width=width, max_new_tokens=24))
                for width in (2, 3, 8) for prompt in prompts]
    engine = engines("self", 16)
    before = dict(engine.stats()["speculative"])
    assert_same(run(engines(), requests), run(engine, requests))
    after = engine.stats()["speculative"]
    assert after["steps"] - before["steps"] > 1.8 * (after["rounds"] - before["rounds"])  # deep rounds
