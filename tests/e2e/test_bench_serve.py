"""`widebeam bench serve` (the command, in its own process) against a real `widebeam serve` on loopback
(the tiny chat model): a short open-loop chat run and a short beam (genrec-shaped) run, their JSON with
vLLM's key names, every request completed; and a workload's body sent through the official `openai`
client, which answers it the same way."""

from __future__ import annotations

import json
import subprocess
import sys

import openai
import pytest

from widebeam.bench_serve.workloads import WorkloadConfig, build_requests

NUM_PROMPTS = 6
OUTPUT_LEN = 8
VLLM_KEYS = ("completed", "failed", "request_throughput", "output_throughput", "total_token_throughput",
             "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "std_ttft_ms", "mean_tpot_ms", "p99_tpot_ms",
             "mean_itl_ms", "p99_itl_ms", "mean_e2el_ms", "p99_e2el_ms", "request_goodput", "duration",
             "max_concurrency", "request_rate", "burstiness", "total_input_tokens", "total_output_tokens")


def bench_serve(server, tmp_path, *args: str) -> dict:
    command = [sys.executable, "-m", "widebeam", "bench", "serve", "--base-url", server.url,
               "--api-key", server.api_key or "", "--num-prompts", str(NUM_PROMPTS), "--output-len",
               str(OUTPUT_LEN), "--ignore-eos", "--disable-tqdm", "--save-result", "--result-dir",
               str(tmp_path), "--result-filename", "result.json", *args]
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr + done.stdout
    assert "Serving Benchmark Result" in done.stdout
    return json.loads((tmp_path / "result.json").read_text())


def counts(result: dict) -> tuple[int, int, int]:
    return result["completed"], result["failed"], result["rejected"]


def test_chat_run_completes_every_request_with_vllm_keys(server, tmp_path):
    result = bench_serve(server, tmp_path, "--workload", "chat", "--request-rate", "20", "--num-warmups", "1",
                         "--max-concurrency", "4", "--goodput", "e2el:60000", "--seed", "5")
    missing = [key for key in VLLM_KEYS if key not in result]
    assert not missing, missing
    assert counts(result) == (NUM_PROMPTS, 0, 0), result["errors"]
    assert result["model_id"] == "tiny-chat"
    assert result["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN  # usage's count, ignore_eos
    assert result["total_input_tokens"] > 0
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    assert result["mean_tpot_ms"] is not None and result["mean_itl_ms"] is not None  # streamed text
    assert result["request_rate"] == 20 and result["max_concurrency"] == 4
    server.wait_idle()


def test_beam_run_counts_beams(server, tmp_path):
    result = bench_serve(server, tmp_path, "--workload", "genrec", "--width-mix", "4:0.5,8:0.5", "--n", "2",
                         "--prefix-words", "40", "--history-items", "3")
    assert counts(result) == (NUM_PROMPTS, 0, 0), result["errors"]
    widths = [spec.beam_width for spec in build_requests(WorkloadConfig(
        workload="genrec", num_requests=NUM_PROMPTS, width_mix="4:0.5,8:0.5"))]
    assert result["beams_per_s"] == pytest.approx(sum(widths) / result["duration"])
    assert result["mean_tpot_ms"] is None  # beams arrive whole: no per-token time
    assert result["total_output_tokens"] == NUM_PROMPTS * 2 * OUTPUT_LEN  # n=2 beams of 8 tokens


def test_a_workload_body_through_the_openai_client(server):
    spec = build_requests(WorkloadConfig(workload="chat", num_requests=1, greedy_fraction=1.0,
                                         output_len=OUTPUT_LEN, ignore_eos=True, model="tiny-chat"))[0]
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0, timeout=60)
    body = {k: v for k, v in spec.body.items() if k not in ("stream", "stream_options")}
    standard = {k: body.pop(k) for k in ("model", "messages", "max_tokens", "temperature")}
    out = client.chat.completions.create(**standard, extra_body=body)
    assert out.usage.completion_tokens == OUTPUT_LEN
    streamed = client.chat.completions.create(**standard, extra_body=body, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == out.choices[0].message.content
