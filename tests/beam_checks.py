"""One comparison of widebeam's beams with transformers' `generate(..., return_dict_in_generate=True)`,
shared by the parity tests of every model family."""

from __future__ import annotations

import torch


def assert_beams_match(output, expected, start: int, pad: int, eos: int, beam_width: int, label: str) -> bool:
    """Each returned beam equals HF's sequence of the same rank from position `start` (the prompt's
    length, or 1 after an encoder-decoder's start token), and its score HF's `sequences_scores`
    (beam search proper, W > 1). Returns whether any beam ended with EOS."""
    saw_eos = False
    for rank, (beam, hf_sequence) in enumerate(zip(output.outputs, expected.sequences)):
        generated = hf_sequence[start:].tolist()
        n = len(beam.token_ids)
        assert beam.token_ids == generated[:n], f"{label} rank {rank}"
        # transformers pads a hypothesis that ended early (with pad, or with EOS itself)
        assert set(generated[n:]) <= {pad, eos} and (n == len(generated) or beam.token_ids[-1] == eos)
        saw_eos |= beam.token_ids[-1] == eos
        if beam_width > 1:
            torch.testing.assert_close(beam.score, float(expected.sequences_scores[rank]), atol=1e-4,
                                       rtol=1e-5)
    return saw_eos


def hf_beam_search(hf, prompt: list[int], params, eos: int, pad: int):
    """transformers' `generate` with the beam settings of `params` (a BeamSearchParams), scores included."""
    with torch.no_grad():
        return hf.generate(torch.tensor([prompt]), num_beams=params.beam_width, do_sample=False,
                           max_new_tokens=params.max_new_tokens, length_penalty=params.length_penalty,
                           early_stopping=params.early_stopping,
                           num_return_sequences=params.num_return_sequences,
                           min_new_tokens=params.min_new_tokens, eos_token_id=eos, pad_token_id=pad,
                           output_scores=True, return_dict_in_generate=True)


def assert_greedy_matches_transformers(llm, hf, prompts: list[list[int]], pad: int,
                                       max_new_tokens: int = 32) -> None:
    """widebeam's greedy tokens (EOS ignored) equal transformers' for every prompt, run as one batch."""
    from widebeam.params import SamplingParams

    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        with torch.no_grad():
            expected = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                                   eos_token_id=None, pad_token_id=pad)[0, len(prompt):].tolist()
        (completion,) = output.outputs
        assert len(expected) == max_new_tokens
        assert completion.token_ids == expected
        assert completion.finish_reason == "length"
