"""The batch job on Ray Data (a local Ray instance with 2 CPUs): 2 engine replicas give the same
outputs as one engine in process, and a replica killed mid-run loses and duplicates nothing."""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import pytest
from batch_checks import DEFAULTS, ENGINE, assert_same_results, by_id, mixed_rows, write_jsonl

from widebeam.batch import read_output, run

ray = pytest.importorskip("ray", reason="Ray is installed by `make test` (the widebeam[ray] extra)")


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def rows_and_reference(tiny_llama_dir, tmp_path_factory):
    """200 mixed rows and their in-process results."""
    tmp = tmp_path_factory.mktemp("batch-ray")
    rows = mixed_rows(200, seed=5)
    source = write_jsonl(tmp / "in.jsonl", rows)
    run(source, tmp / "reference.jsonl", str(tiny_llama_dir), defaults=DEFAULTS, progress=False, **ENGINE)
    return source, by_id(read_output(tmp / "reference.jsonl"))


def test_two_replicas_give_the_in_process_outputs(local_ray, tiny_llama_dir, rows_and_reference, tmp_path):
    source, reference = rows_and_reference
    summary = run(source, tmp_path / "out.jsonl", str(tiny_llama_dir), defaults=DEFAULTS, replicas=2,
                  progress=False, **ENGINE)
    assert (summary.num_written == 200
            and summary.num_errors == sum(1 for r in reference.values() if r["error"]) > 0)
    assert_same_results(by_id(read_output(tmp_path / "out.jsonl")), reference)


def replica_pids() -> list[int]:
    return [p.pid for p in psutil.process_iter(["cmdline"])
            if "MapWorker" in " ".join(p.info["cmdline"] or [])]


def test_a_replica_killed_mid_run_loses_and_duplicates_nothing(local_ray, tiny_llama_dir, rows_and_reference,
                                                               tmp_path):
    source, reference = rows_and_reference
    out = tmp_path / "out.jsonl"
    killed: list[int] = []

    def kill_one_replica_once_results_flow():
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if out.exists() and out.read_text().count("\n") >= 16:
                pids = replica_pids()
                if pids:
                    os.kill(pids[0], signal.SIGKILL)
                    killed.append(pids[0])
                    return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_one_replica_once_results_flow, daemon=True)
    killer.start()
    # small batches: many are still to run when the first results are written
    summary = run(source, out, str(tiny_llama_dir), defaults=DEFAULTS, replicas=2, max_in_flight=8,
                  progress=False, **ENGINE)
    killer.join(timeout=5)
    assert killed, "no replica was killed while the job ran"
    records = read_output(out)
    assert summary.num_written == len(records) == 200
    assert_same_results(by_id(records), reference)  # by_id also checks every id appears once
