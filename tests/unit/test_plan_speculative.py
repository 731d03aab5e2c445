"""`widebeam plan` with speculative decoding: the draft model's pools beside the target's, one memory
budget for both, D tokens reserved per sequence in every per-sequence pool, and still no torch."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from widebeam import layout
from widebeam.config import SpeculativeConfig
from widebeam.defaults import DEFAULT_MAX_NUM_BATCHED_TOKENS
from widebeam.kv.budget import sliding_window_blocks
from widebeam.layout import activation_rows, scoped_pool_name
from widebeam.model.activation import estimate_activation_peak_bytes
from widebeam.model.loading.arch import load_arch
from widebeam.plan import PlanError, PlanInputs, plan

SMOLLM2 = "smollm2-135m-instruct"
P, N, W, T = 1000, 64, 8, 16


def required(p: int, n: int, w: int, t: int, d: int = 0) -> int:
    """The prompt once, and per beam its partial block, N - 1 written tokens and D draft slots."""
    return p // t + math.ceil((p % t + n - 1 + d) / t) * w


def inputs(speculative: SpeculativeConfig | None = None, memory: int = 2**31, **kwargs) -> PlanInputs:
    return PlanInputs(memory_bytes=memory, beam_width=W, prompt_len=P, max_new_tokens=N, tokens_per_block=T,
                      speculative=speculative, **kwargs)


def draft(d: int, model: str = SMOLLM2) -> SpeculativeConfig:
    return SpeculativeConfig("draft", model, d)


def by_name(result: dict) -> dict[str, dict]:
    return {p["name"]: p for p in result["pools"]}


def reserve(arch, d: int = 0, dtype: str = "bfloat16") -> int:
    """One worker's activation estimate for an engine whose widest step is W beams of 1 + 2D rows."""
    return estimate_activation_peak_bytes(arch, DEFAULT_MAX_NUM_BATCHED_TOKENS, activation_rows(W, d), dtype)


@pytest.mark.parametrize("d", [1, 4, 17])
def test_draft_row_follows_the_formula_with_d(d):
    arch = load_arch(SMOLLM2)
    result = plan(arch, inputs(draft(d)), arch)
    pools = by_name(result)
    assert list(pools) == ["self", "draft"]
    draft_pool = pools["draft"]
    # the draft (SmolLM2-135M too): 30 layers x 3 KV heads x 64 head dim, K and V, bfloat16
    assert draft_pool["kind"] == "full" and draft_pool["num_layers"] == 30
    assert draft_pool["bytes_per_token"] == 2 * 30 * 3 * 64 * 2
    assert draft_pool["required_blocks"] == required(P, N, W, T, d)
    assert pools["self"]["required_blocks"] == required(P, N, W, T, d)
    assert result["speculative"] == {"method": "draft", "model": SMOLLM2, "num_speculative_tokens": d,
                                     "draft_model": SMOLLM2,
                                     "draft_weight_bytes": arch.weight_bytes("bfloat16"),
                                     "draft_activation_reserve_bytes":
                                         result["activation_reserve_bytes"] // 2}


def test_d_increases_the_targets_required_blocks():
    arch = load_arch(SMOLLM2)
    plain = by_name(plan(arch, inputs()))["self"]["required_blocks"]
    assert plain == required(P, N, W, T)
    # P mod T = 8: 8 + 63 = 71 tokens per beam take 5 blocks (80 slots); D = 9 still fits them, D = 10 a sixth
    for d, extra_blocks_per_beam in ((1, 0), (9, 0), (10, 1), (25, 1), (26, 2), (64, 4)):
        with_d = by_name(plan(arch, inputs(SpeculativeConfig("ngram", None, d))))["self"]["required_blocks"]
        assert with_d == required(P, N, W, T, d) == plain + extra_blocks_per_beam * W


def test_both_models_share_one_memory_budget():
    arch = load_arch(SMOLLM2)
    alone = plan(arch, inputs())
    both = plan(arch, inputs(draft(4)), arch)
    # the draft's weights and activation reserve come off the same memory; each worker's reserve is
    # sized for the widest speculative step, W x (1 + 2D) rows of logits, as the engine sizes it
    assert both["weight_bytes"] == 2 * alone["weight_bytes"]
    assert alone["activation_reserve_bytes"] == reserve(arch) and alone["activation_rows"] == W
    assert both["activation_reserve_bytes"] == 2 * reserve(arch, 4) and both["activation_rows"] == W * 9
    left = both["memory_bytes"] - both["weight_bytes"] - both["activation_reserve_bytes"]
    assert both["kv_cache_bytes"] == int(left * both["kv_cache_fraction"])
    # two identical models: size_pools gives each half of the KV bytes
    bytes_per_block = 2 * 30 * 3 * 64 * 2 * T
    pools = by_name(both)
    assert pools["self"]["capacity_blocks"] == pools["draft"]["capacity_blocks"] \
        == int(both["kv_cache_bytes"] / 2) // bytes_per_block
    assert both["bytes_per_token"] == 2 * alone["bytes_per_token"]
    assert both["max_concurrent_requests"] == min(p["max_concurrent_requests"] for p in both["pools"])


def test_ngram_adds_no_draft_pool_and_no_draft_weights():
    arch = load_arch(SMOLLM2)
    alone = plan(arch, inputs())
    ngram = plan(arch, inputs(SpeculativeConfig("ngram", None, 5)))
    assert [p["name"] for p in ngram["pools"]] == ["self"]
    assert ngram["speculative"] == {"method": "ngram", "model": None, "num_speculative_tokens": 5}
    assert ngram["weight_bytes"] == alone["weight_bytes"]
    # no draft model, but the target's widest step still scores W x (1 + 2D) rows: a larger reserve
    assert ngram["activation_reserve_bytes"] == reserve(arch, 5) > alone["activation_reserve_bytes"]
    left = ngram["memory_bytes"] - ngram["weight_bytes"] - ngram["activation_reserve_bytes"]
    assert ngram["kv_cache_bytes"] == int(left * ngram["kv_cache_fraction"]) <= alone["kv_cache_bytes"]
    assert ngram["pools"][0]["required_blocks"] == required(P, N, W, T, 5)


def test_without_speculation_the_plan_is_unchanged():
    arch = load_arch(SMOLLM2)
    result = plan(arch, inputs())
    assert "speculative" not in result and [p["name"] for p in result["pools"]] == ["self"]


def test_sliding_draft_pools_are_scoped_and_reserve_d_and_the_refeed():
    arch = load_arch("gemma3-270m")
    d = 6
    result = plan(arch, inputs(draft(d, "gemma3-270m")), arch)
    pools = by_name(result)
    assert list(pools) == ["self", "sliding_512", "draft", "draft/sliding_512"]
    chunk = DEFAULT_MAX_NUM_BATCHED_TOKENS  # the prefill chunk the plan sizes sliding pools for
    for name in ("sliding_512", "draft/sliding_512"):
        assert pools[name]["kind"] == "sliding"
        assert pools[name]["required_blocks"] == sliding_window_blocks(P, N, W, T, 512, chunk, extra_tokens=d,
                                                                       refeed_tokens=d)
    for name in ("self", "draft"):
        assert pools[name]["required_blocks"] == required(P, N, W, T, d)


def test_scoped_pool_name_is_the_workers_rule():
    worker = pytest.importorskip("widebeam.worker")
    assert worker.scoped_specs is layout.scoped_specs  # one rule (layout.py), the workers' and plan's
    names = {(prefix, local): scoped_pool_name(prefix, local) for prefix in ("", "draft")
             for local in ("self", "sliding_512", "cross")}
    assert names == {("", "self"): "self", ("", "sliding_512"): "sliding_512", ("", "cross"): "cross",
                     ("draft", "self"): "draft", ("draft", "sliding_512"): "draft/sliding_512",
                     ("draft", "cross"): "draft/cross"}


def test_draft_method_needs_the_draft_arch():
    with pytest.raises(ValueError, match="draft_arch"):
        plan(load_arch(SMOLLM2), inputs(draft(4)))


def test_memory_too_small_counts_the_draft():
    arch = load_arch(SMOLLM2)
    alone = plan(arch, inputs())
    memory = alone["weight_bytes"] + alone["activation_reserve_bytes"] + 2**20  # room for the target alone
    plan(arch, inputs(memory=memory))
    with pytest.raises(PlanError, match="target and draft"):
        plan(arch, inputs(draft(4), memory=memory), arch)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "widebeam", *args], check=False, capture_output=True,
                          text=True, timeout=120)


def test_plan_json_has_the_speculative_entry_and_the_draft_rows():
    proc = run_cli("plan", "--model", SMOLLM2, "--speculative-model", SMOLLM2, "--num-speculative-tokens",
                   "3", "--memory", "1GiB", "--beam-width", str(W), "--prompt-len", str(P),
                   "--max-new-tokens", str(N), "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert {k: result["speculative"][k] for k in ("method", "model", "num_speculative_tokens")} == \
        {"method": "draft", "model": SMOLLM2, "num_speculative_tokens": 3}
    assert [(p["name"], p["required_blocks"]) for p in result["pools"]] == \
        [("self", required(P, N, W, T, 3)), ("draft", required(P, N, W, T, 3))]


def test_plan_ngram_json_and_table():
    proc = run_cli("plan", "--model", SMOLLM2, "--speculative-method", "ngram", "--num-speculative-tokens",
                   "9", "--beam-width", str(W), "--prompt-len", str(P), "--max-new-tokens", str(N), "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["speculative"] == {"method": "ngram", "model": None, "num_speculative_tokens": 9}
    assert [(p["name"], p["required_blocks"]) for p in result["pools"]] == [("self", required(P, N, W, T, 9))]
    table = run_cli("plan", "--model", "gemma3-270m", "--speculative-model", "gemma3-270m", "--memory",
                    "2GiB")
    assert table.returncode == 0, table.stderr
    for fragment in ("draft/sliding_512", "incl. draft", "+4 speculative per sequence",
                     "draft gemma3-270m, D=4"):
        assert fragment in table.stdout


def test_plan_with_a_draft_stays_torch_free():
    code = ("import sys, contextlib, io; from widebeam.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    main(['plan', '--model', 'gemma3-270m', '--speculative-model', 'gemma3-270m',"
            " '--num-speculative-tokens', '4', '--json'])\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.strip() == "False", out.stderr
