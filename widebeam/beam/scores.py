"""A finished hypothesis' score as transformers computes it: the cumulative log-prob divided by
`generated_len ** length_penalty`, in float32 as HF divides (float64 only where float32 would overflow)."""

from __future__ import annotations

import torch


def length_normalizer(generated_len: int, length_penalty: float) -> float:
    """The divisor of a hypothesis' cumulative log-prob: `generated_len ** length_penalty`, a Python float.

    Finite for the lengths and penalties `BeamSearchParams` admits (|length_penalty| <= 10)."""
    return generated_len ** length_penalty


def divided_scores(values: torch.Tensor, normalizer: float) -> torch.Tensor:
    """`values / normalizer` in float32 as HF divides; where float32 overflows (a strongly negative
    length penalty on a long output), the float64 quotient, so no real score is infinite."""
    scores = values / normalizer
    overflow = torch.isinf(scores) & torch.isfinite(values)  # a masked (-inf) value stays -inf
    if bool(overflow.any()):
        scores = torch.where(overflow, values.double() / normalizer, scores.double())
    return scores


def hypothesis_score(cumulative_logprob: float, generated_len: int, length_penalty: float) -> float:
    """HF's score of a finished hypothesis: `cumulative_logprob / generated_len ** length_penalty`.

    `generated_len` is the number of generated tokens including the final EOS token, prompt excluded; it must
    be >= 1. The division is done like HF does it: a float32 tensor divided by a Python float, on the CPU.
    (`BeamSearchState` divides on the log-probs' device, as HF does, so on an accelerator the two may differ
    in the last bit.)
    """
    if generated_len < 1:
        raise ValueError(f"generated_len must be >= 1, got {generated_len}")
    value = torch.tensor([cumulative_logprob], dtype=torch.float32)
    return float(divided_scores(value, length_normalizer(generated_len, length_penalty))[0])
