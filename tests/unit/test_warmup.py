"""The warm-up measures a real activation peak, and the engine sizes its pools from it.

On a CPU the measure is the process's peak RSS over the largest prefill chunk and decode step; a
process that already freed memory of that size can serve the steps from it and measure less, so the
engine is built in a fresh process, at the default step sizes (2,048-token chunks, 256 beams).
"""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = """
import json, sys, torch
torch.set_num_threads(1)
from widebeam.llm import LLM
from widebeam.model.activation import estimate_activation_peak_bytes
llm = LLM(sys.argv[1], device="cpu", tokens_per_block=16)
engine = llm.engine
print(json.dumps({"measured": engine.activation_peak_bytes,
                  "estimate": estimate_activation_peak_bytes(engine.arch, 2048, engine.max_beam_width)}))
"""


def test_warm_up_measures_a_real_activation_peak(tiny_llama_dir):
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_llama_dir)], capture_output=True,
                            text=True, timeout=120, check=True)
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    # measured ~0.5x the shape-based bound here (the bound counts every large tensor at once); zero
    # would leave the pools no room for the activations
    assert figures["measured"] >= figures["estimate"] // 8 > 0
