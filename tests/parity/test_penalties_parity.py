"""Penalties through the whole engine against transformers on a tiny Llama: `repetition_penalty` as
`generate(..., repetition_penalty=p)` (greedy, and beam search at W 1 and 4 with the same sequences
and scores: HF runs its `RepetitionPenaltyLogitsProcessor` on each beam's log-softmax with that beam's
own prompt + generated tokens); `presence_penalty` / `frequency_penalty` (no transformers processor)
against a plain reference decoding loop over the HF model."""

from __future__ import annotations

import pytest
import torch
from beam_checks import assert_beams_match
from transformers import AutoModelForCausalLM

from widebeam.llm import LLM
from widebeam.params import BeamSearchParams, SamplingParams

PAD = 0
EOS = 2
PROMPTS = [[5, 17, 33, 9, 100, 3, 8], [7, 7, 9] * 6, list(range(3, 40)), [11, 12]]
MAX_NEW = 12


@pytest.fixture(scope="module")
def models(tiny_llama_dir):
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", tokens_per_block=4, kv_cache_memory="16MiB",
              max_num_batched_tokens=64, max_beam_width=16)
    return llm, hf


def _hf(hf, prompt, **kwargs):
    with torch.no_grad():
        return hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=EOS,
                           pad_token_id=PAD, output_scores=True, return_dict_in_generate=True, **kwargs)


@pytest.mark.parametrize("penalty", [1.3, 5.0, 0.7])
def test_greedy_repetition_penalty_matches_transformers(models, penalty):
    llm, hf = models
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0, repetition_penalty=penalty)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    changed = False
    for prompt, output in zip(PROMPTS, outputs):
        expected = _hf(hf, prompt, repetition_penalty=penalty).sequences[0, len(prompt):].tolist()
        plain = _hf(hf, prompt).sequences[0, len(prompt):].tolist()
        tokens = output.outputs[0].token_ids
        assert tokens == expected[:len(tokens)] and set(expected[len(tokens):]) <= {PAD, EOS}
        changed |= expected != plain
    assert changed, "the penalty changed no output: the test would not see a wrong one"


@pytest.mark.parametrize("beam_width, penalty, num_return",
                         [(1, 1.5, 1), (4, 1.5, 4), (4, 3.0, 2), (4, 0.8, 4),
                                                              (16, 2.0, 8)])
def test_beam_search_repetition_penalty_matches_transformers(models, beam_width, penalty, num_return):
    llm, hf = models
    params = BeamSearchParams(beam_width=beam_width, max_new_tokens=MAX_NEW, repetition_penalty=penalty,
                              num_return_sequences=num_return)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    changed = False
    for prompt, output in zip(PROMPTS, outputs):
        expected = _hf(hf, prompt, num_beams=beam_width, repetition_penalty=penalty,
                       num_return_sequences=num_return)
        plain = _hf(hf, prompt, num_beams=beam_width, num_return_sequences=num_return)
        assert len(output.outputs) == num_return
        assert_beams_match(output, expected, len(prompt), PAD, EOS, beam_width,
                           f"prompt {prompt[:4]} p={penalty}")
        changed |= expected.sequences.tolist() != plain.sequences.tolist()
    assert changed, "the penalty changed no beam: the test would not see a wrong one"
    pool = llm.stats()["pools"]["self"]
    assert pool["free_blocks"] == pool["total_blocks"]


def _reference_greedy(hf, prompt, presence, frequency, repetition=1.0, max_new=MAX_NEW):
    """OpenAI / vLLM: logits[t] -= frequency * count(t in output) + presence * (t in output), after the
    repetition penalty over prompt + output; then argmax. A plain loop, one token at a time."""
    ids = list(prompt)
    out = []
    for _ in range(max_new):
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1].clone()
        for t in set(ids):
            logits[t] = logits[t] / repetition if logits[t] > 0 else logits[t] * repetition
        for t in set(out):
            logits[t] -= frequency * out.count(t) + presence
        token = int(logits.argmax())
        out.append(token)
        ids.append(token)
        if token == EOS:
            break
    return out


@pytest.mark.parametrize("presence, frequency, repetition",
                         [(1.5, 0.0, 1.0), (0.0, 0.8, 1.0), (0.5, 0.5, 1.2),
                                                             (-1.0, 0.3, 1.0), (0.4, -0.6, 1.0)])
def test_greedy_presence_frequency_match_a_reference(models, presence, frequency, repetition):
    llm, hf = models
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0, presence_penalty=presence,
                            frequency_penalty=frequency, repetition_penalty=repetition)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    changed = False
    for prompt, output in zip(PROMPTS, outputs):
        expected = _reference_greedy(hf, prompt, presence, frequency, repetition)
        assert output.outputs[0].token_ids == expected, f"prompt {prompt[:4]}"
        changed |= expected != _reference_greedy(hf, prompt, 0.0, 0.0, repetition)
    assert changed, "the penalties changed no output: the test would not see a wrong one"


def test_strong_presence_penalty_never_repeats_a_generated_token(models):
    llm, _ = models
    plain = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                         SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True), use_tqdm=False)
    assert any(len(set(o.outputs[0].token_ids)) < len(o.outputs[0].token_ids) for o in plain), \
        "greedy output never repeats here: the test would prove nothing"
    params = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True, presence_penalty=2.0,
                            frequency_penalty=2.0)
    # the tiny model's logits span a few units: +-4 is a wall in practice, checked by the assertion below
    for output in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False):
        tokens = output.outputs[0].token_ids
        assert len(set(tokens)) == len(tokens), tokens


def test_beam_search_presence_frequency_follow_each_beam(models):
    """Beam search at W=4 with presence / frequency: against a reference beam search in the test with
    the same per-beam penalty on each beam's log-softmax (HF's beam search with a custom processor)."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class PresenceFrequency(LogitsProcessor):
        def __init__(self, prompt_len, presence, frequency):
            self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

        def __call__(self, input_ids, scores):
            for row in range(scores.shape[0]):
                generated = input_ids[row, self.prompt_len:].tolist()
                for t in set(generated):
                    scores[row, t] -= self.frequency * generated.count(t) + self.presence
            return scores

    llm, hf = models
    presence, frequency = 0.7, 0.4
    params = BeamSearchParams(beam_width=4, max_new_tokens=MAX_NEW, presence_penalty=presence,
                              frequency_penalty=frequency, repetition_penalty=1.2)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    changed = False
    for prompt, output in zip(PROMPTS, outputs):
        processors = LogitsProcessorList([PresenceFrequency(len(prompt), presence, frequency)])
        expected = _hf(hf, prompt, num_beams=4, repetition_penalty=1.2, logits_processor=processors)
        plain = _hf(hf, prompt, num_beams=4, repetition_penalty=1.2)
        assert_beams_match(output, expected, len(prompt), PAD, EOS, 4, f"prompt {prompt[:4]}")
        changed |= expected.sequences.tolist() != plain.sequences.tolist()
    assert changed, "the penalties changed no beam: the test would not see a wrong one"
