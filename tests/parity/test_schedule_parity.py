"""Beam-width schedules through the whole engine (paged KV, forks and prunes at changing widths,
requests of different schedules in one step) against a per-step reference: the model-free beam state
(`widebeam/beam/search.py`) driven with transformers' log-probs of every live beam's full sequence
(no KV cache), so each step runs at its scheduled width. Sequences equal, scores to 1e-4, on three
families (Llama, Qwen2, Gemma 3 with a sliding-window pool); a mixed batch equals each request alone;
the held blocks never pass `required_blocks`."""

from __future__ import annotations

import pytest
import torch
from tiny_models import save_tiny_model

from widebeam.beam.search import BeamSearchState
from widebeam.kv.schedule_budget import scheduled_blocks
from widebeam.llm import LLM
from widebeam.params import BeamSearchParams

EOS = 2
PROMPTS = [[5, 17, 33, 9, 100, 3, 8], [7, 7, 9] * 4, [11, 12]]
# (schedule, length_penalty, early_stopping, num_return_sequences)
SCHEDULES = [
    ((2, 8, 4), 1.0, False, None),
    ((8, 2), 0.0, True, 2),
    ((1, 3, 6, 6, 2, 5), -1.0, "never", 3),
    ((5,), 1.0, False, None),
]
FAMILIES = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {"num_key_value_heads": 1, "tie_word_embeddings": True}),
    "gemma3": ("gemma3_text", {"num_hidden_layers": 3, "sliding_window": 8, "head_dim": 16,
                               "tie_word_embeddings": True,
                               "layer_types": ["sliding_attention", "sliding_attention", "full_attention"]}),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    model_type, overrides = FAMILIES[request.param]
    path = tmp_path_factory.mktemp(f"schedule-{request.param}")
    hf = save_tiny_model(path, model_type, **overrides)
    llm = LLM(str(path), dtype="float32", device="cpu", tokens_per_block=4, kv_cache_memory="16MiB",
              max_num_batched_tokens=64, max_beam_width=16)
    return llm, hf, path


def reference_search(hf, prompt: list[int], params: BeamSearchParams):
    """Step by step: every live beam's whole sequence through transformers, the scheduled width from
    the beam state; returns its hypotheses."""
    state = BeamSearchState(params, params.max_new_tokens, [EOS])
    rows = [prompt]
    while not state.done:
        with torch.no_grad():
            logits = hf(torch.tensor(rows)).logits[:, -1].float()
        result = state.step(torch.log_softmax(logits, dim=-1))
        if result.empty:
            break
        # HF keeps exactly w_k live beams (2 w_k candidates always hold w_k without EOS)
        assert len(result) == params.width_at_step(state.num_generated_tokens)
        rows = [prompt + tokens for tokens in state.live_token_ids]
    return state.finalize()


def assert_same(output, hypotheses, label):
    assert [beam.token_ids for beam in output.outputs] == [h.token_ids for h in hypotheses], label
    for beam, hypothesis in zip(output.outputs, hypotheses):
        torch.testing.assert_close(beam.score, hypothesis.score, atol=1e-4, rtol=1e-5)


def _params(schedule, length_penalty, early_stopping, num_return):
    return BeamSearchParams(beam_width_schedule=list(schedule), max_new_tokens=8,
                            length_penalty=length_penalty, early_stopping=early_stopping,
                            num_return_sequences=num_return)


@pytest.mark.parametrize("schedule, length_penalty, early_stopping, num_return", SCHEDULES)
def test_schedule_equals_per_step_reference(family, schedule, length_penalty, early_stopping, num_return):
    llm, hf, _ = family
    params = _params(schedule, length_penalty, early_stopping, num_return)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs):
        expected = reference_search(hf, prompt, params)
        assert len(output.outputs) == params.num_return_sequences
        assert_same(output, expected, f"{schedule} prompt {prompt[:3]}")
        for name, peak in output.peak_blocks.items():
            assert peak <= output.required_blocks[name]
        # admission counted the schedule's own worst case, not its widest step at every step
        assert output.required_blocks["self"] == scheduled_blocks(len(prompt), 8, schedule, 4)


def test_mixed_schedules_in_one_batch_equal_each_alone(family):
    """Requests of different schedules and a plain one share every decode step and come out as they
    do alone."""
    llm, _, _ = family
    engine = llm.engine
    requests = [(f"r{i}", PROMPTS[i % len(PROMPTS)], _params(*case)) for i, case in enumerate(SCHEDULES)]
    requests.append(("plain", PROMPTS[0], BeamSearchParams(beam_width=6, max_new_tokens=8)))
    alone = {}
    for request_id, prompt, params in requests:
        (alone[request_id],) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    for request_id, prompt, params in requests:
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    together, shared_steps = {}, 0
    while engine.has_unfinished():
        deltas = engine.step()
        shared_steps += len(deltas) == len(requests)
        together.update({d.request_id: d.output for d in deltas if d.finished})
    assert shared_steps >= 3, "the requests did not decode in the same steps"
    for request_id, output in alone.items():
        got = together[request_id]
        assert [b.token_ids for b in got.outputs] == [b.token_ids for b in output.outputs], request_id
        for a, b in zip(got.outputs, output.outputs):
            torch.testing.assert_close(a.score, b.score, atol=1e-4, rtol=1e-5)


def test_preempted_schedules_resume_unchanged_within_their_bound(family):
    """Under max_utilization a preempted request re-feeds every beam into blocks of its own; admission
    counts that (`beams_own_all`), and the outputs do not change."""
    _, _, path = family
    llm = LLM(str(path), dtype="float32", device="cpu", tokens_per_block=4, kv_cache_memory="16MiB",
              max_num_batched_tokens=64, max_beam_width=16, scheduling_policy="max_utilization")
    engine = llm.engine
    cases = {f"r{i}": (PROMPTS[i % len(PROMPTS)], _params(*case)) for i, case in enumerate(SCHEDULES)}
    alone = {rid: llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0]
             for rid, (p, params) in cases.items()}
    for rid, (prompt, params) in cases.items():
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    preempted, outputs = set(), {}
    while engine.has_unfinished():
        for request in list(engine.scheduler.running):
            if request.request_id not in preempted and request.prompt_done \
                    and request.decoder.num_generated_tokens >= 4:
                preempted.add(request.request_id)
                assert engine.scheduler.preempt(request.request_id)
        outputs.update({d.request_id: d.output for d in engine.step() if d.finished})
    assert len(preempted) >= 2
    for rid, (prompt, params) in cases.items():
        got, want = outputs[rid], alone[rid]
        assert [b.token_ids for b in got.outputs] == [b.token_ids for b in want.outputs], rid
        assert got.required_blocks["self"] == scheduled_blocks(len(prompt), 8, params.beam_width_schedule, 4,
                                                               beams_own_all=True)
        for name, peak in got.peak_blocks.items():
            assert peak <= got.required_blocks[name], (rid, name)
