"""Beam-width schedules through every front end: `widebeam plan --beam-width-schedule` counts the
schedule's bound, `batch` takes a flag default and a row field (a list or a "64,256" cell), the HTTP
request's `beam_width_schedule` extra field becomes the engine's, and bad schedules are one error
naming the field or flag."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from widebeam.batch.rows import make_params
from widebeam.kv.budget import full_attention_blocks
from widebeam.kv.schedule_budget import scheduled_blocks
from widebeam.server.protocol import plan_request
from widebeam.server.schemas import ApiError, CompletionRequest


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "widebeam", *args], capture_output=True, text=True,
                          timeout=120, check=False)


def test_plan_counts_the_schedules_bound():
    proc = run_cli("plan", "--model", "smollm2-135m-instruct", "--memory", "2GiB", "--beam-width-schedule",
                   "1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,64", "--prompt-len", "100", "--max-new-tokens", "200",
                   "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    schedule = (1,) * 16 + (64,)
    assert result["request"]["beam_width"] == 64
    assert result["request"]["beam_width_schedule"] == list(schedule)
    (pool,) = result["pools"]
    assert pool["required_blocks"] == scheduled_blocks(100, 200, schedule, 16)
    assert pool["fixed_width_required_blocks"] == full_attention_blocks(100, 200, 64, 16)
    assert pool["required_blocks"] < pool["fixed_width_required_blocks"]


@pytest.mark.parametrize("command, args, fragment", [
    ("plan", ["--beam-width-schedule", "64,0"], "--beam-width-schedule"),
    ("plan", ["--beam-width-schedule", "64,x"], "--beam-width-schedule"),
    ("plan", ["--beam-width-schedule", "8,16", "--beam-width", "4"], "--beam-width"),
    ("plan", ["--beam-width-schedule", "8,16", "--beam-width", "1"], "--beam-width"),  # 1 is the default
    ("plan", ["--beam-width-schedule", "8,16,4", "--max-new-tokens", "2"], "--beam-width-schedule"),
    ("generate", ["hi", "--beam-width-schedule", "4,,8"], "--beam-width-schedule"),
    ("generate", ["hi", "--beam-width-schedule", "4,8", "--temperature", "0.5"], "--temperature"),
])
def test_bad_schedule_flags_are_one_line_exit_2(command, args, fragment):
    proc = run_cli(command, *args)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0] and "Traceback" not in proc.stderr


def test_batch_rows_take_a_schedule():
    params = make_params({"beam_width_schedule": "2,8,4", "max_new_tokens": 6})
    assert params.beam_width_schedule == (2, 8, 4) and params.beam_width == 8
    params = make_params({"max_new_tokens": 6}, {"beam_width_schedule": (3, 5)})
    assert params.beam_width_schedule == (3, 5) and params.num_return_sequences == 5


def test_batch_command_line_schedule_default(tiny_llama_dir, tmp_path, capsys):
    from widebeam.cli import main

    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"id": "a", "prompt_token_ids": [5, 6, 7]}) + "\n")
    argv = ["batch", str(source), str(tmp_path / "out.jsonl"), "--model", str(tiny_llama_dir),
            "--beam-width-schedule", "2,6,3", "--max-beam-width", "6", "--max-new-tokens", "5",
            "--device", "cpu", "--kv-cache-memory", "1MiB", "--no-progress"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["written"] == 1
    (record,) = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert len(record["outputs"]) == 3  # the schedule's last width


def test_http_extra_field_reaches_the_engine():
    plan = plan_request(CompletionRequest(prompt="x", use_beam_search=True, n=4,
                                          beam_width_schedule=[2, 8, 4], max_tokens=6))
    (params,) = plan.params
    assert params.beam_width_schedule == (2, 8, 4) and params.beam_width == 8
    assert params.num_return_sequences == 4


@pytest.mark.parametrize("fields, param", [
    ({"use_beam_search": True, "n": 5, "beam_width_schedule": [2, 8, 4]}, "n"),
    ({"use_beam_search": True, "beam_width_schedule": [2, 0]}, "beam_width_schedule"),
    ({"use_beam_search": True, "beam_width_schedule": [2, 8], "beam_width": 3}, "beam_width"),
    ({"beam_width_schedule": [2, 8]}, "beam_width_schedule"),
])
def test_http_schedule_errors_name_the_field(fields, param):
    with pytest.raises(ApiError) as error:
        plan_request(CompletionRequest(prompt="x", max_tokens=6, **fields))
    assert error.value.param == param
