"""`widebeam batch` in process: rows in three formats, per-row parameters, bad rows written with
their error, incremental output, and resuming after a crash without losing or duplicating a row."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from batch_checks import DEFAULTS, ENGINE, assert_same_results, by_id, mixed_rows, write_jsonl

from widebeam.batch import read_output, run
from widebeam.batch.files import OutputWriter
from widebeam.batch.rows import make_params, parse_row
from widebeam.llm import LLM
from widebeam.params import BeamSearchParams, SamplingParams


def test_rows_choose_their_kind_and_defaults_fill_the_rest():
    beams = make_params({"beam_width": 8}, {"max_new_tokens": 5, "temperature": 0.0})
    assert isinstance(beams, BeamSearchParams) and beams.max_new_tokens == 5 and beams.beam_width == 8
    sampled = make_params({"seed": 3}, {"max_new_tokens": 5, "temperature": 0.0, "beam_width": 1})
    assert isinstance(sampled, SamplingParams) and sampled.seed == 3 and sampled.temperature == 0.0
    bad = parse_row({"prompt": "x", "beam_width": 4, "temperature": 0.5}, 0, {})
    assert bad.error and "temperature" in bad.error and bad.row_id == "row-0"
    assert "exactly one" in parse_row({"prompt": "a", "prompt_token_ids": [1]}, 2, {}).error
    csv_row = parse_row({"id": "c", "prompt_token_ids": "[1, 2, 3]", "beam_width": "2", "stop": "\n"}, 0, {})
    assert csv_row.error is None and csv_row.prompt == {"prompt_token_ids": [1, 2, 3]}
    assert csv_row.params.beam_width == 2 and csv_row.params.stop == ("\n",)


def test_a_job_writes_every_row_once_with_the_engines_outputs(tiny_llama_dir, tmp_path):
    rows = mixed_rows(40)
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    with open(source, "a") as f:
        f.write("{not json\n")  # a malformed line: written with its error
    summary = run(source, tmp_path / "out.jsonl", str(tiny_llama_dir), defaults=DEFAULTS, progress=False,
                  **ENGINE)
    records = by_id(read_output(tmp_path / "out.jsonl"))
    assert summary.num_written == len(records) == 41
    assert "not valid JSON" in records["row-40"]["error"]
    assert "max_seq_len" in records["q3"]["error"]
    assert summary.num_errors == sum(1 for r in records.values() if r["error"]) == 3  # q3, q23, the bad line
    # each row's results are the engine's own for that row's parameters
    llm = LLM(str(tiny_llama_dir), **ENGINE)
    for row in rows[:8]:
        if row["id"] in ("q3",):
            continue
        parsed = parse_row(row, 0, DEFAULTS)
        (expected,) = llm.generate([parsed.prompt], parsed.params, use_tqdm=False)
        got = records[row["id"]]["outputs"]
        assert [o["token_ids"] for o in got] == [c.token_ids for c in expected.outputs]
        assert len(got) == (parsed.params.beam_width if isinstance(parsed.params, BeamSearchParams) else 1)
    # a rerun finds every row written and does nothing
    again = run(source, tmp_path / "out.jsonl", str(tiny_llama_dir), defaults=DEFAULTS, progress=False,
                **ENGINE)
    assert again.num_written == 0 and again.num_skipped == 41


@pytest.mark.parametrize("suffix", ["csv", "parquet"])
def test_csv_and_parquet_in_and_out(tiny_llama_dir, tmp_path, suffix):
    import pandas as pd

    rows = mixed_rows(12, seed=1)
    frame = pd.DataFrame([{**row, "prompt_token_ids": json.dumps(row["prompt_token_ids"])} for row in rows])
    if suffix == "csv":
        frame.to_csv(tmp_path / "in.csv", index=False)
    else:
        frame["prompt_token_ids"] = [row["prompt_token_ids"] for row in rows]
        frame.to_parquet(tmp_path / "in.parquet")
    summary = run(tmp_path / f"in.{suffix}", tmp_path / f"out.{suffix}", str(tiny_llama_dir),
                  defaults=DEFAULTS, progress=False, **ENGINE)
    expected = by_id(read_output(_jsonl_reference(tiny_llama_dir, tmp_path, rows)))
    assert summary.num_written == 12
    assert_same_results(by_id(read_output(tmp_path / f"out.{suffix}")), expected)


def _jsonl_reference(model_dir, tmp_path, rows) -> Path:
    out = tmp_path / "reference.jsonl"
    run(write_jsonl(tmp_path / "reference-in.jsonl", rows), out, str(model_dir), defaults=DEFAULTS,
        progress=False, **ENGINE)
    return out


def test_parquet_parts_are_whole_or_absent(tmp_path):
    writer = OutputWriter(tmp_path / "out.parquet", flush_rows=2)
    for i in range(5):
        writer.write({"id": f"r{i}", "error": None, "outputs": [], "num_prompt_tokens": 3,
                      "num_cached_tokens": 0})
    (tmp_path / "out.parquet" / "part-00009.parquet.tmp").write_bytes(b"half a part")  # a crash mid-write
    assert writer.done_ids() == {"r0", "r1", "r2", "r3"}  # the fifth is still buffered
    writer.close()
    assert OutputWriter(tmp_path / "out.parquet").done_ids() == {f"r{i}" for i in range(5)}


JOB = """
import sys
from widebeam.batch import run
run(sys.argv[1], sys.argv[2], sys.argv[3], defaults={"max_new_tokens": 24, "temperature": 0.0},
    progress=False, max_in_flight=4, device="cpu", kv_cache_memory="1MiB", tokens_per_block=4)
"""


def test_a_killed_job_resumes_without_losing_or_duplicating_a_row(tiny_llama_dir, tmp_path):
    rows = mixed_rows(60, seed=2)
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    job = subprocess.Popen([sys.executable, "-c", JOB, str(source), str(out), str(tiny_llama_dir)], env=env)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and job.poll() is None:
        if out.exists() and out.read_text().count("\n") >= 10:
            job.send_signal(signal.SIGKILL)  # no clean-up of any kind
            break
        time.sleep(0.05)
    job.wait(timeout=60)
    written_before = out.read_text().count("\n")
    assert job.returncode == -signal.SIGKILL and 10 <= written_before < 60, "the job was not killed mid-run"
    with open(out, "a") as f:
        f.write('{"id": "q59", "err')  # and the crash cut a line in half
    summary = run(source, out, str(tiny_llama_dir), defaults={"max_new_tokens": 24, "temperature": 0.0},
                  progress=False, **ENGINE)
    assert summary.num_skipped == written_before and summary.num_written == 60 - written_before
    resumed = by_id(read_output(out))
    fresh = tmp_path / "fresh.jsonl"
    run(source, fresh, str(tiny_llama_dir), defaults={"max_new_tokens": 24, "temperature": 0.0},
        progress=False, **ENGINE)
    assert_same_results(resumed, by_id(read_output(fresh)))


def test_the_command_line_runs_a_job_with_flag_defaults(tiny_llama_dir, tmp_path, capsys):
    from widebeam.cli import main

    source = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt_token_ids": [5, 6, 7]},
                                                 {"id": "b", "prompt_token_ids": [5, 6, 7], "beam_width": 1,
                                                  "ignore_eos": True}])  # sampled: EOS could come first
    argv = ["batch", str(source), str(tmp_path / "out.jsonl"), "--model", str(tiny_llama_dir), "--beam-width",
            "3", "--max-new-tokens", "4", "--device", "cpu", "--kv-cache-memory", "1MiB", "--no-progress"]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["written"] == 2 and summary["errors"] == 0
    records = by_id(read_output(tmp_path / "out.jsonl"))
    assert len(records["a"]["outputs"]) == 3  # the flag's beam width
    # the row's
    assert len(records["b"]["outputs"]) == 1 and len(records["b"]["outputs"][0]["token_ids"]) == 4
    assert main(argv) == 0 and json.loads(capsys.readouterr().out.strip().splitlines()[-1])["skipped"] == 2


def test_rows_name_a_catalogue_registered_for_the_job(tiny_llama_dir, tmp_path, capsys):
    from widebeam.cli import main

    items = [[11, 12, 13], [11, 14], [20, 21, 22]]
    (tmp_path / "items.jsonl").write_text("".join(json.dumps(item) + "\n" for item in items))
    source = write_jsonl(tmp_path / "in.jsonl", [
        {"id": "named", "prompt_token_ids": [5, 6, 7], "beam_width": 3, "catalogue": "items"},
        {"id": "default", "prompt_token_ids": [8, 9], "beam_width": 2},
        {"id": "unknown", "prompt_token_ids": [8, 9], "beam_width": 2, "catalogue": "nope"},
    ])
    argv = ["batch", str(source), str(tmp_path / "out.jsonl"), "--model", str(tiny_llama_dir), "--device",
            "cpu", "--kv-cache-memory", "1MiB", "--catalogue", f"items={tmp_path / 'items.jsonl'}",
            "--default-catalogue", "items", "--no-progress"]
    assert main(argv) == 0
    records = by_id(read_output(tmp_path / "out.jsonl"))
    for row_id, width in (("named", 3), ("default", 2)):
        beams = [o["token_ids"] for o in records[row_id]["outputs"]]
        assert len(beams) == width and all(beam[:-1] in items for beam in beams), beams  # an item, then EOS
    assert "nope" in records["unknown"]["error"]


def test_a_repeated_id_is_a_counted_named_skip_on_every_run(tiny_llama_dir, tmp_path, caplog):
    """The second row with an id never runs (an output holds one record per id), and the job says so:
    counted, named with its row, logged; a rerun reports it again rather than calling it written."""
    rows = [{"id": "a", "prompt_token_ids": [5, 6, 7]}, {"id": "b", "prompt_token_ids": [8, 9]},
            {"id": "a", "prompt_token_ids": [10, 11]}, {"prompt_token_ids": [12]}]  # the last: row-3
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    with caplog.at_level("WARNING", logger="widebeam"):
        summary = run(source, tmp_path / "out.jsonl", str(tiny_llama_dir), defaults=DEFAULTS, progress=False,
                      **ENGINE)
    records = by_id(read_output(tmp_path / "out.jsonl"))
    assert set(records) == {"a", "b", "row-3"} and summary.num_written == 3
    assert records["a"]["num_prompt_tokens"] == 3  # the first row with that id
    assert (summary.num_duplicates, summary.duplicates, summary.num_skipped) == (1, ["a (row 2)"], 0)
    assert "1 input rows skipped: their id repeats an earlier row's" in caplog.text
    assert "a (row 2)" in caplog.text
    again = run(source, tmp_path / "out.jsonl", str(tiny_llama_dir), defaults=DEFAULTS, progress=False,
                **ENGINE)
    assert (again.num_written, again.num_skipped, again.num_duplicates) == (0, 3, 1)


def test_the_command_line_warns_of_repeated_ids(tiny_llama_dir, tmp_path, capsys):
    from widebeam.cli import main

    source = write_jsonl(tmp_path / "in.jsonl", [{"id": "x", "prompt_token_ids": [5, 6]},
                                                 {"id": "x", "prompt_token_ids": [7, 8]}])
    argv = ["batch", str(source), str(tmp_path / "out.jsonl"), "--model", str(tiny_llama_dir),
            "--max-new-tokens", "2", "--device", "cpu", "--kv-cache-memory", "1MiB", "--no-progress"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    summary = json.loads(out.strip().splitlines()[-1])
    assert (summary["written"], summary["duplicates"], summary["first_duplicates"]) == (1, 1, ["x (row 1)"])
    assert "warning: 1 rows skipped, their id repeats an earlier row's: x (row 1)" in err


def test_a_bad_csv_cell_names_its_row_and_column(tiny_llama_dir, tmp_path):
    source = tmp_path / "in.csv"
    source.write_text("id,prompt_token_ids,beam_width,temperature,stop_token_ids,use_beam_search\n"
                      "ok,\"[5, 6]\",2,,,\n"
                      "w,\"[5, 6]\",abc,,,\n"
                      "t,\"[5, 6]\",,hot,,\n"
                      "s,\"[5, 6]\",,,\"[1,\",\n"
                      "u,\"[5, 6]\",,,,maybe\n")
    run(source, tmp_path / "out.csv", str(tiny_llama_dir), defaults=DEFAULTS, progress=False, **ENGINE)
    records = by_id(read_output(tmp_path / "out.csv"))
    assert records["ok"]["error"] is None and len(records["ok"]["outputs"]) == 2
    for rid, row, column in (("w", 1, "beam_width"), ("t", 2, "temperature"), ("s", 3, "stop_token_ids"),
                             ("u", 4, "use_beam_search")):
        assert records[rid]["error"].startswith(f"row {row}, column {column}: "), records[rid]["error"]
