"""widebeam vs Hugging Face transformers beam search, side by side in one run.

The same as `widebeam bench` (the code lives in `widebeam/bench.py`); see `--help`.

    python benchmarks/beam_vs_hf.py                       # both sweeps (long: tens of minutes)
    python benchmarks/beam_vs_hf.py --widths 1 4 --prompt-lens 512 --max-new-tokens 32 --no-wide
"""

from __future__ import annotations

import argparse

from widebeam import bench

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench.add_arguments(parser)
    bench.run(parser.parse_args())
