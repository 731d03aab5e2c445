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
            torch.testing.assert_close(beam.score, float(expected.sequences_scores[rank]), atol=1e-4, rtol=1e-5)
    return saw_eos
