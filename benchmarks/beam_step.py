"""One beam-search step over a 49,152-token vocabulary (SmolLM2's), without a model: the search's own
cost (`BeamSearchState.step`), as the engine runs it, on the raw logits (`normalize=True`: the ranking of
their log-softmax, beam/ranking.py), and A/B in one process with the C++ selection kernel
(`log_softmax_topk`, model/kernels/row_top.cpp) on and off. Moved here from the unit tests (#22: timing
belongs in benchmarks, not in tests).

    python benchmarks/beam_step.py [--widths 16 64 256 1024] [--vocab 49152] [--repeats 8]

Per width: the best seconds of a step with the kernel and with the torch path (chunked log-softmax, then
torch.topk), interleaved (benchmarks/interleaved.py), their ratio, the same candidates on both sides
checked, and the floor wide_step_breakdown.py gives the selection (3 reads of the W x V float32 logits at
this machine's bandwidth, measured here). Writes benchmarks/results/beam_step.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from interleaved import best_times
from tables import machine_info
from wide_step_breakdown import bandwidth_bytes_per_s

from widebeam.beam.search import BeamSearchState
from widebeam.model import kernels
from widebeam.params import BeamSearchParams

OUT = Path(__file__).resolve().parent / "results" / "beam_step.json"


def searcher(width: int, first: torch.Tensor, steps: int) -> BeamSearchState:
    """A search past its first step (`first`: the prompt's logits; then W live beams), ready for `steps`
    more."""
    state = BeamSearchState(BeamSearchParams(beam_width=width, max_new_tokens=steps + 2), steps + 2, {0, 1})
    state.step(first, normalize=True)
    return state


def step(state: BeamSearchState, logits: torch.Tensor, kernel: bool):
    kernels.SELECTION_ENABLED = kernel
    try:
        return state.step(logits, normalize=True)
    finally:
        kernels.SELECTION_ENABLED = True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[16, 64, 256, 1024])
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    if not kernels.selection_enabled():
        raise SystemExit("the C++ selection kernel is not built for this CPU: run `make setup`")
    torch.manual_seed(0)
    bandwidth = bandwidth_bytes_per_s()
    points = []
    for width in args.widths:
        logits = torch.randn(width, args.vocab) * 4
        first = torch.randn(1, args.vocab) * 4
        states = {side: searcher(width, first, args.repeats + 1) for side in ("kernel", "torch")}

        runs = {side: (lambda state=state, on=side == "kernel", x=logits: step(state, x, on))
                for side, state in states.items()}
        best, results = best_times(runs, args.repeats)
        same = (results["kernel"].parent_indices == results["torch"].parent_indices
                and results["kernel"].token_ids == results["torch"].token_ids)
        floor_s = 3 * 4 * width * args.vocab / bandwidth
        point = {"width": width, "vocab": args.vocab, "kernel_ms": 1e3 * best["kernel"],
                 "torch_ms": 1e3 * best["torch"], "torch_over_kernel": best["torch"] / best["kernel"],
                 "floor_ms": 1e3 * floor_s, "kernel_x_floor": best["kernel"] / floor_s,
                 "same_candidates": same}
        points.append(point)
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in point.items()}),
              flush=True)
    command = (f"python benchmarks/beam_step.py --widths {' '.join(map(str, args.widths))} "
               f"--vocab {args.vocab} --repeats {args.repeats}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine_info(torch.get_num_threads()), "command": command,
                                    "bandwidth_gb_s": bandwidth / 1e9, "points": points}, indent=1) + "\n")


if __name__ == "__main__":
    main()
