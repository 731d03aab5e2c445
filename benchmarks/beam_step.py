"""One beam-search step at width 256 over a 49,152-token vocabulary (SmolLM2's): the host-side cost
of `BeamSearchState.step` alone, without a model. Moved here from the unit tests (#22: timing belongs
in benchmarks, not in tests).

    python benchmarks/beam_step.py [--width 256] [--vocab 49152] [--repeats 8]

Prints one JSON line: the step times in seconds (best and median), measured ~tens of ms on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from widebeam.beam.search import BeamSearchState
from widebeam.params import BeamSearchParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--repeats", type=int, default=8)
    args = parser.parse_args()
    torch.manual_seed(0)
    state = BeamSearchState(BeamSearchParams(beam_width=args.width, max_new_tokens=args.repeats + 2),
                            args.repeats + 2, {0, 1})
    state.step(torch.log_softmax(torch.randn(1, args.vocab), dim=-1))
    logprobs = torch.log_softmax(torch.randn(args.width, args.vocab), dim=-1)
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        state.step(logprobs)
        times.append(time.perf_counter() - start)
    print(json.dumps({"width": args.width, "vocab": args.vocab, "threads": torch.get_num_threads(),
                      "best_s": round(min(times), 5), "median_s": round(statistics.median(times), 5)}))


if __name__ == "__main__":
    main()
