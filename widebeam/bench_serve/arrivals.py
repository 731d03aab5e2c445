"""When each request is sent: offsets in seconds from the start of a run, drawn before it starts.

vLLM's convention (`vllm bench serve --request-rate R --burstiness B`): the gaps between arrivals are
gamma-distributed with shape B and scale 1 / (R * B), so the mean gap is 1/R whatever B is, and the
coefficient of variation of a gap is 1 / sqrt(B). B = 1 is a Poisson process (exponential gaps); B < 1
is burstier (clumps and lulls), B > 1 more regular (B -> infinity: a fixed gap of 1/R). R = inf sends
every request at once. The draws come from one seeded generator, so a seed gives the same schedule.
"""

from __future__ import annotations

import math

import numpy as np


def arrival_gaps_s(num_requests: int, request_rate: float, burstiness: float = 1.0,
                   seed: int = 0) -> np.ndarray:
    """The gap before each request but the first (num_requests - 1 values, seconds)."""
    if request_rate <= 0 or math.isnan(request_rate):
        raise ValueError(f"request_rate must be > 0 (inf: all at once), got {request_rate}")
    if burstiness <= 0 or not math.isfinite(burstiness):
        raise ValueError(f"burstiness must be a finite number > 0, got {burstiness}")
    num_gaps = max(num_requests - 1, 0)
    if math.isinf(request_rate):
        return np.zeros(num_gaps)
    rng = np.random.default_rng(seed)
    return rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_gaps)


def arrival_offsets_s(num_requests: int, request_rate: float, burstiness: float = 1.0,
                      seed: int = 0) -> np.ndarray:
    """Each request's send time from the start (the first at 0), nondecreasing."""
    gaps = arrival_gaps_s(num_requests, request_rate, burstiness, seed)
    if num_requests <= 0:
        return np.zeros(0)
    return np.concatenate([[0.0], np.cumsum(gaps)])
