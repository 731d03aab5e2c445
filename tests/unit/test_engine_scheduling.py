"""The engine under load: admission that never spins, waiting instead of failing, mixed batches,
and a randomized soak that ends with every block back in its pool."""

from __future__ import annotations

import random

import pytest
from helpers import decode_request_ids, prefill_request_ids, record_schedules

from widebeam.errors import InvalidParameterError, RequestTooLargeError
from widebeam.llm import LLM
from widebeam.params import BeamSearchParams, SamplingParams

BYTES_PER_BLOCK = 4 * 2 * 2 * 2 * 16 * 4  # T=4 tokens x K,V x 2 layers x 2 kv heads x 16 head_dim x float32


def make_llm(path, num_blocks, **kwargs):
    kwargs = {"device": "cpu", "tokens_per_block": 4, "kv_cache_memory": num_blocks * BYTES_PER_BLOCK,
              "max_num_batched_tokens": 64, "max_beam_width": 64, **kwargs}
    llm = LLM(str(path), **kwargs)
    assert llm.stats()["pools"]["self"]["total_blocks"] == num_blocks
    return llm


def ids(tokens):
    return {"prompt_token_ids": tokens}


def run_all(engine, max_steps=10_000):
    outputs, steps = {}, 0
    while engine.has_unfinished():
        for delta in engine.step():
            if delta.finished:
                outputs[delta.request_id] = delta.output
        steps += 1
        assert steps < max_steps, "the engine did not finish"
    return outputs, steps


def test_oversized_request_is_rejected_while_running_ones_finish(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, 60)
    engine = llm.engine
    engine.add_request("small", ids([5] * 10),
                       SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True))
    engine.step()
    with pytest.raises(RequestTooLargeError) as info:
        engine.add_request("huge", ids([6] * 30), BeamSearchParams(beam_width=32, max_new_tokens=20))
    err = info.value
    assert (err.pool, err.prompt_len, err.max_new_tokens, err.beam_width) == ("self", 30, 20, 32)
    assert err.required_blocks == 7 + 6 * 32 and err.capacity_blocks == 60
    for fragment in ("'self'", str(7 + 6 * 32), "60", "prompt_len=30", "max_new_tokens=20", "beam_width=32"):
        assert fragment in str(err)
    outputs, _ = run_all(engine)
    assert len(outputs["small"].outputs[0].token_ids) == 8
    assert engine.stats()["rejected"] == 1 and engine.stats()["pools"]["self"]["free_blocks"] == 60


def test_request_waits_for_blocks_then_runs_and_no_step_is_empty(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, 40)
    engine = llm.engine
    # needs 5 + 4 * 8 = 37 of 40 blocks: the second can only start when the first is done
    params = BeamSearchParams(beam_width=8, max_new_tokens=16, ignore_eos=True)
    engine.add_request("first", ids([5] * 20), params)
    engine.add_request("second", ids([6] * 20), params)
    schedules = record_schedules(engine)
    outputs, steps = {}, 0
    while engine.has_unfinished():
        for delta in engine.step():
            if delta.finished:
                outputs[delta.request_id] = delta.output
        schedule = schedules[-1]
        assert schedule.scheduled, "a step ran with nothing scheduled while work was waiting"
        if "first" not in outputs:
            assert "second" not in prefill_request_ids(schedule) + decode_request_ids(schedule)
        steps += 1
    assert set(outputs) == {"first", "second"}
    assert steps == 2 * 16  # one after the other: the second starts the step after the first ends
    assert engine.stats()["pools"]["self"]["free_blocks"] == 40


def test_beam_and_greedy_requests_share_steps_and_match_running_alone(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, 200)
    engine = llm.engine
    requests = {
        "greedy": (ids([9, 8, 7, 6, 5]), SamplingParams(max_new_tokens=10, temperature=0)),
        "beam4": (ids(list(range(10, 31))), BeamSearchParams(beam_width=4, max_new_tokens=10)),
        "sampled": (ids([3] * 9), SamplingParams(max_new_tokens=10, temperature=0.8, seed=5)),
        "beam16": (ids([4, 40, 44] * 5),
                   BeamSearchParams(beam_width=16, max_new_tokens=8, num_return_sequences=3)),
    }
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    mixed_steps = 0
    together = {}
    schedules = record_schedules(engine)
    while engine.has_unfinished():
        for delta in engine.step():
            if delta.finished:
                together[delta.request_id] = delta.output
        decoding = set(decode_request_ids(schedules[-1]))
        mixed_steps += {"greedy", "beam4", "beam16"} <= decoding
    assert mixed_steps >= 5
    for request_id, (prompt, params) in requests.items():
        (alone,) = llm.generate([prompt], params, use_tqdm=False)
        mixed = together[request_id].outputs
        assert [c.token_ids for c in alone.outputs] == [c.token_ids for c in mixed], request_id
        # batch shapes change float rounding in the last bits, nothing more
        assert [c.score for c in alone.outputs] == pytest.approx([c.score for c in mixed], abs=1e-5)


def test_long_prompts_are_prefilled_in_chunks(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, 100, max_num_batched_tokens=16)
    engine = llm.engine
    prompt = list(range(3, 53))  # 50 tokens: 16 + 16 + 16 + 2
    engine.add_request("long", ids(prompt), SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True))
    chunks = []
    outputs = {}
    schedules = record_schedules(engine)
    while engine.has_unfinished():
        for delta in engine.step():
            if delta.finished:
                outputs[delta.request_id] = delta.output
        chunks += [s.num_prompt_tokens for s in schedules[-1].scheduled if s.num_prompt_tokens]
    assert chunks == [16, 16, 16, 2]
    unchunked = make_llm(tiny_llama_dir, 100)
    (reference,) = unchunked.generate([ids(prompt)],
                                      SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True),
                                      use_tqdm=False)
    assert outputs["long"].outputs[0].token_ids == reference.outputs[0].token_ids


def test_startup_max_seq_len_does_not_depend_on_max_beam_width(tiny_llama_dir):
    narrow = make_llm(tiny_llama_dir, 50, max_beam_width=1)
    wide = make_llm(tiny_llama_dir, 50, max_beam_width=256, max_num_batched_tokens=256)
    assert narrow.max_seq_len == wide.max_seq_len == 200
    with pytest.raises(ValueError, match=r"max_seq_len=300.*200 tokens"):
        make_llm(tiny_llama_dir, 50, max_seq_len=300)


def test_beam_width_limits_and_mixed_parameters_are_clear_errors(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, 50, max_beam_width=8)
    with pytest.raises(InvalidParameterError, match=r"beam_width must be in \[1, 8\]"):
        llm.generate([ids([5, 6])], BeamSearchParams(beam_width=9), use_tqdm=False)
    with pytest.raises(InvalidParameterError, match="beam_width"):
        BeamSearchParams(beam_width=0)
    with pytest.raises(InvalidParameterError, match="num_return_sequences"):
        BeamSearchParams(beam_width=4, num_return_sequences=5)
    with pytest.raises(TypeError, match="temperature"):
        BeamSearchParams(beam_width=4, temperature=0.7)


def test_randomized_soak_returns_every_block(tiny_llama_dir):
    rng = random.Random(1234)
    num_blocks = 160
    llm = make_llm(tiny_llama_dir, num_blocks)
    engine = llm.engine
    admitted, rejected, aborted = set(), set(), set()
    abort_at: dict[str, int] = {}
    step_bound = 0
    for n in range(220):
        request_id = f"r{n}"
        prompt = [rng.randrange(3, 128) for _ in range(rng.randint(1, 60))]
        kind = rng.random()
        max_new = rng.randint(1, 24)
        if kind < 0.3:
            params = SamplingParams(max_new_tokens=max_new, temperature=0)
        elif kind < 0.5:
            params = SamplingParams(max_new_tokens=max_new, temperature=1.0, top_p=0.9, seed=n)
        else:
            params = BeamSearchParams(beam_width=rng.choice([1, 2, 3, 4, 8, 16, 32, 64]),
                                      max_new_tokens=max_new,
                                      length_penalty=rng.choice([0.0, 1.0]),
                                      early_stopping=rng.choice([True, False]))
        try:
            engine.add_request(request_id, ids(prompt), params)
        except (RequestTooLargeError, InvalidParameterError):
            rejected.add(request_id)
            continue
        admitted.add(request_id)
        step_bound += len(prompt) + max_new + 1
        if rng.random() < 0.1:
            abort_at[request_id] = rng.randint(0, 40)
    assert len(rejected) >= 10 and len(admitted) >= 150
    outputs, steps = {}, 0
    while engine.has_unfinished():
        for request_id, at in list(abort_at.items()):
            if steps == at and request_id not in outputs:
                engine.abort(request_id)
                aborted.add(request_id)
                del abort_at[request_id]
        for delta in engine.step():
            if delta.finished:
                outputs[delta.request_id] = delta.output
        steps += 1
        assert steps <= step_bound
        for out in outputs.values():
            assert all(out.peak_blocks[p] <= out.required_blocks[p] for p in out.peak_blocks)
    assert set(outputs) | aborted == admitted
    assert all(len(o.outputs) >= 1 and o.finished for o in outputs.values())
    assert engine.stats()["pools"]["self"]["free_blocks"] == num_blocks
    assert engine.stats()["running"] == engine.stats()["waiting"] == 0


def test_default_sizing_runs_the_warm_up_and_stays_modest_on_cpu(tiny_llama_dir):
    from widebeam.defaults import DEFAULT_CPU_KV_CACHE_BYTES

    llm = LLM(str(tiny_llama_dir), device="cpu", tokens_per_block=4, max_num_batched_tokens=64,
              max_beam_width=8)
    pool = llm.stats()["pools"]["self"]
    assert 0 < pool["total_blocks"] * BYTES_PER_BLOCK <= DEFAULT_CPU_KV_CACHE_BYTES
    assert llm.engine.activation_peak_bytes >= 0
    assert llm.max_seq_len == 512  # the model's limit: the pool holds far more tokens


def test_attention_backend_is_chosen_once_for_the_engine(tiny_llama_dir):
    """The plain-PyTorch reference and the fast default give the same beams through the engine; an
    unknown name is refused at start-up, naming the ones there are."""
    params = BeamSearchParams(beam_width=6, max_new_tokens=10, ignore_eos=True)
    outs = {name: make_llm(tiny_llama_dir, 200, attention_backend=name).generate(ids(list(range(3, 40))),
                                                                                 params)[0]
            for name in ("reference", "sdpa")}
    for ref, fast in zip(outs["reference"].outputs, outs["sdpa"].outputs, strict=True):
        assert ref.token_ids == fast.token_ids
        assert ref.score == pytest.approx(fast.score, abs=1e-4)
    with pytest.raises(ValueError, match="unknown attention backend 'flash'.*reference"):
        make_llm(tiny_llama_dir, 200, attention_backend="flash")
