"""Preemption changes no output (issue #21): requests run through the public engine (`add_request`,
`step`, and `scheduler.preempt(request_id)` at chosen steps) give the tokens, texts, finish reasons
and scores of an unpreempted run, under both capacity policies: greedy, seeded sampling, beam search
up to W=32, an encoder-decoder (Marian) and sliding-window pools (Gemma 3). Preempted during the
prefill, right after it, mid-decode and twice. Every engine ends with all its blocks back (the
autouse check in tests/conftest.py)."""

from __future__ import annotations

import pytest
from tiny_models import TINY_MARIAN_EOS, save_tiny_model

from widebeam.llm import LLM
from widebeam.params import BeamSearchParams, SamplingParams

POLICIES = ["guaranteed_no_evict", "max_utilization"]
CHUNK = 8  # max_num_batched_tokens: a prompt of 20 takes 3 prefill steps

PROMPT = list(range(3, 23))  # 20 tokens


def requests_for(width_cap: int = 32, prompt=PROMPT, eos_free: bool = True):
    beam = {"ignore_eos": False}
    return {
        "greedy": (prompt, SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=eos_free)),
        "sampled": (prompt[:13], SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.95, seed=11)),
        "beam4": (prompt[2:], BeamSearchParams(beam_width=4, max_new_tokens=10, **beam)),
        f"beam{width_cap}": ([t + 60 for t in prompt[:17]],
                             BeamSearchParams(beam_width=width_cap, max_new_tokens=8,
                                                          num_return_sequences=3, **beam)),
    }


def state_of(request) -> str:
    if not request.prompt_done:
        return "prefill"
    if request.pending_token_ids and len(request.pending_token_ids[0]) > 1:
        return "re-feeding"
    generated = request.decoder.num_generated_tokens
    return "first token" if generated == 1 else "decode" if generated >= 3 else "early decode"


def run(llm, requests, preempt_at=None, plan=None):
    """Run `requests` (id -> (prompt ids, params)). Before step i, preempt the ids `preempt_at[i]`
    lists (those running then); and each request of `plan` (id -> states) when it is next found in
    the first state left on its list. Returns (outputs by id, [(id, state when preempted)], steps)."""
    engine = llm.engine
    preempt_at = preempt_at or {}
    plan = {request_id: list(states) for request_id, states in (plan or {}).items()}
    outputs = {}
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, {"prompt_token_ids": list(prompt)}, params)
    forced = []  # (id, the state it was preempted in)
    step = 0
    while engine.has_unfinished():
        chosen = list(preempt_at.get(step, ()))
        for request_id, states in plan.items():
            request = engine._requests.get(request_id)
            if states and request in engine.scheduler.running and state_of(request) == states[0]:
                states.pop(0)
                chosen.append(request_id)
        for request_id in chosen:
            request = engine._requests.get(request_id)
            state = None if request is None else state_of(request)
            if engine.scheduler.preempt(request_id):
                forced.append((request_id, state))
        for delta in engine.step():
            assert delta.error is None, delta.error
            if delta.finished:
                outputs[delta.request_id] = delta.output
        step += 1
        assert step < 2000, "the engine did not finish"
    assert not any(plan.values()), f"planned preemptions not made: {plan}"
    return outputs, forced, step


def assert_same(got, expected):
    assert got.keys() == expected.keys()
    for request_id, want in expected.items():
        have = got[request_id]
        assert [c.token_ids for c in have.outputs] == [c.token_ids for c in want.outputs], request_id
        assert [c.text for c in have.outputs] == [c.text for c in want.outputs], request_id
        assert [c.finish_reason for c in have.outputs] == [c.finish_reason for c in want.outputs], request_id
        # recomputed K/V in other batch shapes: float rounding in the last bits, nothing more
        assert [c.cumulative_logprob for c in have.outputs] == pytest.approx(
            [c.cumulative_logprob for c in want.outputs], abs=1e-4), request_id
        assert [c.score for c in have.outputs] == pytest.approx(
            [c.score for c in want.outputs], abs=1e-4), request_id
        assert all(have.peak_blocks[p] <= have.required_blocks[p] for p in have.required_blocks), request_id


def make(path, policy, **kwargs):
    settings = {"device": "cpu", "tokens_per_block": 4, "max_beam_width": 32, "max_num_batched_tokens": CHUNK,
                "kv_cache_memory": 4 * 1024 * 1024, "scheduling_policy": policy}
    settings.update(kwargs)
    return LLM(str(path), **settings)


# When to preempt each request: in the states listed, in order (a prompt of 20 is prefilled in 3
# chunks of 8, so every prompt but the shortest is seen mid-prefill).
ALL = ["greedy", "sampled", "beam4", "beam32"]
FORCED = {
    "during prefill": {"greedy": ["prefill"], "beam4": ["prefill"], "beam32": ["prefill"]},
    "right after prefill": {request_id: ["first token"] for request_id in ALL},
    "mid-decode": {request_id: ["decode"] for request_id in ALL},
    "twice": {"greedy": ["prefill", "decode"], "sampled": ["first token", "decode"],
              "beam4": ["decode", "decode"], "beam32": ["first token", "first token"]},
}


@pytest.fixture(scope="module")
def llama_reference(tiny_llama_dir):
    outputs, _, _ = run(make(tiny_llama_dir, "guaranteed_no_evict"), requests_for())
    return outputs


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("when", sorted(FORCED))
def test_forced_preemptions_change_no_output(tiny_llama_dir, llama_reference, policy, when):
    llm = make(tiny_llama_dir, policy)
    outputs, forced, _ = run(llm, requests_for(), plan=FORCED[when])
    assert sorted(forced) == sorted((i, state) for i, states in FORCED[when].items() for state in states)
    stats = llm.stats()["scheduling"]
    assert stats["policy"] == policy and stats["preemptions"] == len(forced)
    assert stats["recomputed_tokens"] > 0
    assert_same(outputs, llama_reference)


def test_a_request_preempted_every_few_steps_still_matches(tiny_llama_dir, llama_reference):
    """Preempted again and again, sometimes before its re-fed tokens are all back."""
    llm = make(tiny_llama_dir, "max_utilization", max_preemptions=100)
    schedule = {step: ["beam32", "sampled", "greedy", "beam4"] for step in range(2, 60, 3)}
    outputs, forced, _ = run(llm, requests_for(), schedule)
    assert len(forced) >= 10 and any(state == "re-feeding" for _, state in forced), forced
    assert_same(outputs, llama_reference)


# Four W=8 beam searches and two greedy requests, N=24: their worst cases (50-58 blocks each) run one at
# a time in a pool of 64 blocks under guaranteed_no_evict; max_utilization runs them together until the
# pool runs short, then preempts.
CROWD = {f"beam{i}": ([5 + 7 * i + j for j in range(8 + i)],
                      BeamSearchParams(beam_width=8, max_new_tokens=24, ignore_eos=True)) for i in range(4)}
CROWD.update({f"greedy{i}": ([90 + i] * 6, SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True))
              for i in range(2)})


@pytest.mark.parametrize("max_preemptions", [0, 1, 3])
def test_max_utilization_on_a_small_pool_preempts_on_its_own_and_matches(tiny_llama_dir, max_preemptions):
    """No forced preemption: the policy preempts when the running requests' next steps do not fit,
    never one request more than K times (then it runs under its worst-case reservation), and the
    outputs are the reference's."""
    reference, _, reference_steps = run(make(tiny_llama_dir, "guaranteed_no_evict", kv_cache_memory=64 * 2048,
                                             max_num_batched_tokens=64), CROWD)
    llm = make(tiny_llama_dir, "max_utilization", kv_cache_memory=64 * 2048, max_num_batched_tokens=64,
               max_preemptions=max_preemptions)
    assert llm.stats()["pools"]["self"]["total_blocks"] == 64
    scheduler = llm.engine.scheduler
    preempted = []
    preempt = scheduler._preempt

    def spy(request):
        assert request not in scheduler.guaranteed, "a request under its reservation was preempted"
        preempted.append(request.request_id)
        preempt(request)

    scheduler._preempt = spy
    outputs, _, steps = run(llm, CROWD)
    stats = llm.stats()["scheduling"]
    assert stats["preemptions"] == len(preempted)
    if max_preemptions == 0:
        assert preempted == [] and steps == reference_steps  # K=0: every request reserves its worst case
    else:
        assert stats["preemptions"] > 0 and stats["recomputed_tokens"] > 0
        assert steps < reference_steps  # the point of the policy: more requests at once
        assert max(preempted.count(i) for i in set(preempted)) <= max_preemptions
    if max_preemptions == 1:
        assert stats["guaranteed_admissions"] > 0  # the starvation guard ran
    assert_same(outputs, reference)


@pytest.mark.parametrize("policy", POLICIES)
def test_encoder_decoder_outputs_survive_preemption(tiny_marian_dir, policy):
    source = [5, 17, 33, 9, 100, 3, 7, 7, 9, 11, 12, TINY_MARIAN_EOS]
    requests = {
        "greedy": (source, SamplingParams(max_new_tokens=10, temperature=0)),
        "sampled": (source[3:], SamplingParams(max_new_tokens=10, temperature=1.0, seed=3)),
        "beam8": (source, BeamSearchParams(beam_width=8, max_new_tokens=10, num_return_sequences=2)),
        "beam32": (source[1:], BeamSearchParams(beam_width=32, max_new_tokens=6)),
    }
    reference, _, _ = run(make(tiny_marian_dir, "guaranteed_no_evict"), requests)
    for plan in ({"greedy": ["first token"], "beam8": ["first token", "decode"], "beam32": ["decode"],
                  "sampled": ["first token"]},
                 {request_id: ["decode", "decode"] for request_id in requests}):
        llm = make(tiny_marian_dir, policy)
        outputs, forced, _ = run(llm, requests, plan=plan)
        assert len(forced) >= 3, forced
        assert_same(outputs, reference)


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-gemma3-preemption")
    save_tiny_model(path, "gemma3_text", num_hidden_layers=6, tie_word_embeddings=True, head_dim=16,
                    sliding_window=8, layer_types=["sliding_attention"] * 5 + ["full_attention"])
    return path


@pytest.mark.parametrize("policy", POLICIES)
def test_sliding_window_outputs_survive_preemption(gemma3_dir, policy):
    """Generations longer than the window: the re-fed tokens slide the window as the first run did."""
    prompt = list(range(3, 23))
    requests = {
        "greedy": (prompt, SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True)),
        "sampled": (prompt[:11], SamplingParams(max_new_tokens=16, temperature=1.0, seed=5, ignore_eos=True)),
        "beam4": (prompt, BeamSearchParams(beam_width=4, max_new_tokens=14, ignore_eos=True)),
        "beam16": (prompt[:6], BeamSearchParams(beam_width=16, max_new_tokens=12, num_return_sequences=2)),
    }
    reference, _, _ = run(make(gemma3_dir, "guaranteed_no_evict"), requests)
    for plan in ({"greedy": ["prefill"], "beam4": ["prefill", "decode"], "beam16": ["first token"],
                  "sampled": ["decode"]},
                 {request_id: ["decode", "decode"] for request_id in requests}):
        llm = make(gemma3_dir, policy)
        outputs, forced, _ = run(llm, requests, plan=plan)
        assert len(forced) >= 4, forced
        assert_same(outputs, reference)


def test_logprobs_and_catalogue_beams_survive_preemption(tiny_llama_dir):
    """Per-token log-probs, prompt log-probs (recomputed with the prompt) and catalogue-constrained beams
    (per-beam trie state, untouched while tokens are re-fed) come out as without preemption."""
    catalogue = [[5, 6, 7, 8], [5, 6, 9, 10], [5, 11, 12, 13], [14, 15, 16, 17], [14, 15, 18, 19],
                 [20, 21, 22, 23]]
    requests = {
        "logprobs": (PROMPT, SamplingParams(max_new_tokens=8, temperature=0, logprobs=3, prompt_logprobs=2,
                                            ignore_eos=True)),
        "catalogue": (PROMPT[5:], BeamSearchParams(beam_width=4, catalogue="items", num_return_sequences=4)),
    }
    outputs = {}
    for plan in (None, {"logprobs": ["prefill", "decode"], "catalogue": ["first token", "early decode"]}):
        llm = make(tiny_llama_dir, "max_utilization")
        llm.register_catalogue("items", catalogue)
        outputs[plan is None], forced, _ = run(llm, requests, plan=plan)
        assert len(forced) == (0 if plan is None else 4), forced
    reference, got = outputs[True], outputs[False]
    assert_same(got, reference)
    assert all(c.token_ids[:-1] in catalogue or c.token_ids in catalogue for c in got["catalogue"].outputs)

    def assert_same_entries(have, want):
        # the same tokens ranked; their log-probs within float rounding (recomputed in other batch shapes)
        assert ([None if e is None else list(e) for e in have]
                == [None if e is None else list(e) for e in want])
        for h, w in zip(have, want):
            if w is not None:
                assert [lp.logprob for lp in h.values()] == pytest.approx([lp.logprob for lp in w.values()],
                                                                          abs=1e-4)

    assert_same_entries(got["logprobs"].prompt_logprobs, reference["logprobs"].prompt_logprobs)
    assert_same_entries(got["logprobs"].outputs[0].logprobs, reference["logprobs"].outputs[0].logprobs)


@pytest.mark.parametrize("state", ["prefill", "waiting", "re-feeding"])
def test_aborting_a_preempted_request_frees_everything(tiny_llama_dir, state):
    # no prefix cache: the prompt is prefilled again in chunks (a hit would take it in one step)
    llm = make(tiny_llama_dir, "max_utilization", max_num_batched_tokens=8, enable_prefix_caching=False)
    engine = llm.engine
    engine.add_request("a", {"prompt_token_ids": PROMPT}, BeamSearchParams(beam_width=8, max_new_tokens=12,
                                                                           ignore_eos=True))
    engine.add_request("b", {"prompt_token_ids": PROMPT[:5]}, SamplingParams(max_new_tokens=30, temperature=0,
                                                                             ignore_eos=True))
    request = engine._requests["a"]
    for _ in range(100):
        if request.prompt_done and request.decoder.num_generated_tokens >= 4:
            break
        engine.step()
    assert engine.scheduler.preempt("a")
    if state != "waiting":
        for _ in range(100):
            if state_of(request) == state and request in engine.scheduler.running:
                break
            engine.step()
        assert state_of(request) == state and request in engine.scheduler.running
    engine.abort("a")
    assert request not in engine.scheduler.running and request not in engine.scheduler.waiting
    while engine.has_unfinished():
        engine.step()
    assert all(p["free_blocks"] == p["total_blocks"] for p in llm.stats()["pools"].values())


def test_sliding_window_pools_preempt_on_their_own_and_match(gemma3_dir):
    """max_utilization on Gemma 3 pools small enough to preempt (the sliding pool: 39 blocks, a W=8
    request's windowed worst case 24): outputs equal guaranteed_no_evict's, nothing held past a bound."""
    sizing = {"kv_cache_memory": 480 * 1024, "max_num_batched_tokens": 64}
    reference, _, _ = run(make(gemma3_dir, "guaranteed_no_evict", **sizing), CROWD)
    llm = make(gemma3_dir, "max_utilization", **sizing)
    outputs, _, _ = run(llm, CROWD)
    stats = llm.stats()["scheduling"]
    assert stats["preemptions"] > 0 and stats["guaranteed_admissions"] > 0
    assert_same(outputs, reference)
