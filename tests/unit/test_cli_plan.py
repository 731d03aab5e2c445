"""`widebeam plan` as users run it: a real process, its JSON checked against the formula."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "widebeam", *args], capture_output=True, text=True,
                          timeout=120, check=False)


def test_plan_json_matches_the_formula():
    proc = run_cli("plan", "--model", "smollm2-135m-instruct", "--memory", "1GiB", "--beam-width", "256",
                   "--prompt-len", "4096", "--max-new-tokens", "64", "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    p, n, w, t = 4096, 64, 256, 16
    # SmolLM2-135M: 30 layers x 3 KV heads x 64 head dim, K and V, bfloat16
    bytes_per_token = 2 * 30 * 3 * 64 * 2
    assert result["bytes_per_token"] == bytes_per_token
    assert result["tokens_per_block"] == t
    assert result["weight_bytes"] == 134_515_008 * 2
    left = 2**30 - result["weight_bytes"] - result["activation_reserve_bytes"]
    assert result["kv_cache_bytes"] == int(left * 0.9)
    capacity = result["kv_cache_bytes"] // (bytes_per_token * t)
    assert result["capacity_blocks"] == capacity
    assert result["max_seq_len"] == min(8192, capacity * t)

    required = p // t + math.ceil((p % t + n) / t) * w
    (pool,) = result["pools"]
    assert (pool["name"], pool["required_blocks"], pool["capacity_blocks"]) == ("self", required, capacity)
    assert pool["fits"] is (required <= capacity) and result["fits"] is (required <= capacity)
    assert result["max_concurrent_requests"] == (capacity // required if required <= capacity else 0)

    naive = result["naive"]
    assert naive["required_blocks"] == math.ceil((p + n) / t) * w
    assert naive["max_seq_len"] == (capacity // w) * t
    assert naive["fits"] is False and naive["max_concurrent_requests"] == 0


def test_plan_fits_where_the_naive_model_cannot():
    proc = run_cli("plan", "--model", "llama-3-8b", "--memory", "141GiB", "--beam-width", "256",
                   "--prompt-len", "4096", "--max-new-tokens", "1024", "--json")
    result = json.loads(proc.stdout)
    assert result["fits"] and result["max_seq_len"] == 8192
    assert result["max_concurrent_requests"] >= 1
    assert result["naive"]["max_seq_len"] < 4096 + 1024 and not result["naive"]["fits"]


def test_plan_reads_a_config_json(tmp_path):
    config = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
              "max_position_embeddings": 512}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    proc = run_cli("plan", "--model", str(path), "--memory", "256MiB", "--prompt-len", "100",
                   "--max-new-tokens", "10", "--beam-width", "4", "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["bytes_per_token"] == 2 * 2 * 2 * 16 * 2
    assert result["pools"][0]["required_blocks"] == 6 + math.ceil((4 + 10 - 1) / 16) * 4


@pytest.mark.parametrize("beam_width", [1, 16])
def test_plan_encoder_decoder_shows_the_cross_pool_once_per_request(beam_width):
    proc = run_cli("plan", "--model", "opus-mt-en-de", "--memory", "4GiB", "--beam-width", str(beam_width),
                   "--encoder-len", "200", "--max-new-tokens", "128", "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["request"]["encoder_len"] == 200 and result["request"]["prompt_len"] == 1
    required = {pool["name"]: pool["required_blocks"] for pool in result["pools"]}
    # the decoder starts from one token (and writes N - 1 more); the source's K/V are held once,
    # whatever the width
    assert required == {"self": beam_width * math.ceil((1 + 128 - 1) / 16), "cross": math.ceil(200 / 16)}


def test_plan_table_shows_both_models():
    proc = run_cli("plan", "--model", "gemma3-270m", "--memory", "2GiB", "--beam-width", "16")
    assert proc.returncode == 0, proc.stderr
    for fragment in ("self", "sliding_512", "naive", "widebeam"):
        assert fragment in proc.stdout


@pytest.mark.parametrize(
    "args, names",
    [
        (["--prompt-len", "-5"], "--prompt-len"),
        (["--max-new-tokens", "-1"], "--max-new-tokens"),
        (["--beam-width", "0"], "--beam-width"),
        (["--tokens-per-block", "0"], "--tokens-per-block"),
        (["--memory", "lots"], "--memory"),
        (["--memory", "10MiB"], "--memory"),
        (["--memory", "1024TiB"], "--memory"),  # past any machine (2^50 bytes)
        (["--kv-cache-fraction", "1.5"], "--kv-cache-fraction"),
        (["--model", "no-such-model"], "--model"),
        (["--dtype", "int3"], "--dtype"),
    ],
)
def test_bad_input_is_one_line_exit_2(args, names):
    proc = run_cli("plan", *args)
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and names in lines[0]
    assert "Traceback" not in proc.stderr


def test_unreadable_config_is_one_line_exit_2(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("{not json")
    proc = run_cli("plan", "--model", str(path))
    assert proc.returncode == 2 and "cannot read model config" in proc.stderr
    path.write_text(json.dumps({"model_type": "llama"}))
    proc = run_cli("plan", "--model", str(path))
    assert proc.returncode == 2 and "lacks" in proc.stderr and "Traceback" not in proc.stderr
