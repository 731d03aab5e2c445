"""`widebeam plan` and the engine on SmolLM2-135M at W=64, P=2,048, N=64 with each KV dtype (issue #44):
blocks per pool and requests at once, the engine started on the memory plan leaves once the weights are
loaded (tests/unit/test_layout_agreement.py's method, on the real model).

    python benchmarks/kv_plan_agreement.py
"""

from __future__ import annotations

import json

from widebeam import startup as startup_module
from widebeam.engine import LLMEngine
from widebeam.model.loading.arch import load_arch
from widebeam.plan import PlanInputs, plan

MODEL = "smollm2-135m-instruct"


def main() -> None:
    arch = load_arch(MODEL)
    for kv_cache_dtype in ("float32", "bfloat16", "int8"):
        inputs = PlanInputs(memory_bytes=2 << 30, beam_width=64, prompt_len=2048, max_new_tokens=64,
                            dtype="float32", kv_cache_dtype=kv_cache_dtype)
        result = plan(arch, inputs)
        available_bytes = inputs.memory_bytes - result["weight_bytes"]
        startup_module.available_memory_bytes = lambda device, left=available_bytes: left
        engine = LLMEngine(MODEL, device="cpu", dtype="float32", max_beam_width=64,
                           kv_cache_memory=inputs.memory_bytes, kv_cache_dtype=kv_cache_dtype)
        engine_blocks = {name: pool["total_blocks"] for name, pool in engine.stats()["pools"].items()}
        plan_blocks = {pool["name"]: pool["total_blocks"] for pool in result["pools"]}
        print(json.dumps({"kv_cache_dtype": kv_cache_dtype, "plan_blocks": plan_blocks,
                          "engine_blocks": engine_blocks, "equal": plan_blocks == engine_blocks,
                          "requests_at_once": result["max_concurrent_requests"]}))
        del engine


if __name__ == "__main__":
    main()
