#!/usr/bin/env bash
# The prepared GPU check (one CUDA device, under 8 minutes): the cuda-marked parity tests, the default
# KV sizing with its warm-up (no kv_cache_memory given: the engine measures its activation peak and sizes
# the pools from what the device has free), and `widebeam bench` at W = 1, 16, 256 against transformers
# on the same device. Writes benchmarks/results/gpu/{bench.json,bench.png,sizing.json,check.log}.
#
#     make setup && bash benchmarks/gpu_check.sh            # from the repository root
#     OUT=/some/dir bash benchmarks/gpu_check.sh            # results elsewhere
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-benchmarks/results/gpu}
mkdir -p "$OUT"
LOG="$OUT/check.log"
: > "$LOG"
status=0

step() {  # step NAME SECONDS COMMAND...: one part, bounded, logged; a failure is recorded, the rest runs
    local name=$1 limit=$2
    shift 2
    echo "== $name ($(date -u +%T))" | tee -a "$LOG"
    local start=$SECONDS
    timeout "$limit" "$@" >> "$LOG" 2>&1
    local rc=$?
    echo "== $name: rc=$rc in $((SECONDS - start)) s" | tee -a "$LOG"
    [ "$rc" -eq 0 ] || status=1
}

"$PY" -c "import torch, sys; ok = torch.cuda.is_available(); print('cuda', ok, torch.cuda.get_device_name(0) if ok else ''); sys.exit(0 if ok else 1)" \
    | tee -a "$LOG" || { echo "no CUDA device: nothing to check" | tee -a "$LOG"; exit 2; }
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv >> "$LOG" 2>&1 || true
echo "CPU-only paths, not run here: the C++ kernels of widebeam/model/kernels/ (the tiled prompt read, the" \
    "few-row and cross-attention reads, T5's position-biased groups, the K/V row copies, the int8 row" \
    "quantizer, norms, rotary, selection and its in-place deeper rows);" \
    "on CUDA the torch path serves every one of them (the cuda tests below run it)" | tee -a "$LOG"

step "cuda tests" 150 "$PY" -m pytest -q -m cuda tests
step "default sizing with warm-up" 90 "$PY" - "$OUT/sizing.json" <<'EOF'
import json, sys, time
from widebeam.llm import LLM
from widebeam.params import BeamSearchParams
start = time.perf_counter()
llm = LLM("smollm2-135m-instruct", device="cuda", max_beam_width=64)  # no kv_cache_memory: measured
built_s = time.perf_counter() - start
(out,) = llm.generate(["The capital of France is"], BeamSearchParams(beam_width=16, max_new_tokens=16),
                      use_tqdm=False)
engine = llm.engine
stats = engine.stats()
result = {"build_s": built_s, "activation_peak_bytes": engine.activation_peak_bytes,
          "pools": stats["pools"], "best": out.outputs[0].text, "required_blocks": out.required_blocks,
          "peak_blocks": out.peak_blocks}
assert all(p["free_blocks"] == p["total_blocks"] for p in stats["pools"].values()), stats["pools"]
json.dump(result, open(sys.argv[1], "w"), indent=2)
print(json.dumps(result, indent=2))
EOF
step "bench W=1,16,256 vs transformers" 300 "$PY" -m widebeam bench --device cuda --dtype bfloat16 \
    --peers transformers --widths 1 16 256 --prompt-lens 512 --max-new-tokens 32 --no-wide \
    --kv-cache-memory 8GiB --settle-s 0 --out "$OUT/bench.json"
echo "done: status $status; results in $OUT" | tee -a "$LOG"
exit $status
