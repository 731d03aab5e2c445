"""`widebeam batch INPUT OUTPUT` and `widebeam.batch.run(...)`: beam search over a dataset.

In-process by default (one engine, a progress bar with rows/s, tokens/s and ETA); with
`replicas=N` the same job runs on Ray Data over N engine replicas (`batch/ray_runner.py`), on a
local Ray instance or the cluster at `ray_address`. Either way the output is written incrementally
and the job is resumable: rows already in the output are skipped (`batch/files.py`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from widebeam.batch.files import MalformedRow, OutputWriter, read_rows
from widebeam.batch.local import DEFAULT_MAX_IN_FLIGHT, BatchEngine
from widebeam.batch.rows import BatchRow, parse_row, row_id
from widebeam.defaults import DEFAULT_MODEL

log = logging.getLogger("widebeam")


@dataclass
class BatchSummary:
    """What a job did: rows written this run, how many with an error, rows skipped as already
    written, rows skipped because their id repeats an earlier row's (never run: an output holds one
    record per id), generated tokens (every returned sequence), seconds."""

    num_written: int = 0
    num_errors: int = 0
    num_skipped: int = 0
    num_duplicates: int = 0
    duplicates: list[str] = field(default_factory=list)  # the first few, "id (row N)", for the console
    num_generated_tokens: int = 0
    elapsed_s: float = 0.0
    errors: list[str] = field(default_factory=list)  # the first few, for the console


def run(input_path: str | Path, output_path: str | Path, model: str = DEFAULT_MODEL, *,
        defaults: dict | None = None, replicas: int = 0, ray_address: str | None = None,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT, cpus_per_replica: int = 1, progress: bool = True,
        **engine_kwargs) -> BatchSummary:
    """Run every row of `input_path` not yet in `output_path`; returns a `BatchSummary`.

    `defaults`: parameter values for rows that do not set them (`max_new_tokens`, `beam_width`,
    ...). `replicas`: 0 runs one engine in this process; N >= 1 runs N replicas on Ray Data.
    `engine_kwargs`: what `LLM(...)` takes (kv_cache_memory, dtype, ...)."""
    defaults = dict(defaults or {})
    writer = OutputWriter(output_path)
    done = writer.done_ids()
    summary = BatchSummary()
    pending: list[tuple[int, object, str | None]] = []
    seen: set[str] = set()  # ids of this input so far: a repeat is a duplicate on every run, resumed or not
    for index, raw in read_rows(input_path):
        if isinstance(raw, MalformedRow):
            rid, error = f"row-{index}", raw.error
        else:
            rid, error = row_id(raw, index), None
        if rid in seen:
            summary.num_duplicates += 1
            if len(summary.duplicates) < 5:
                summary.duplicates.append(f"{rid} (row {index})")
            continue
        seen.add(rid)
        if rid in done:
            summary.num_skipped += 1
            continue
        pending.append((index, raw, error))
    if summary.num_duplicates:
        log.warning("%d input rows skipped: their id repeats an earlier row's (an output holds one record "
                    "per id): %s", summary.num_duplicates, ", ".join(summary.duplicates))
    bar = _progress(len(pending)) if progress else None
    start = time.monotonic()

    def emit(record: dict) -> None:
        writer.write(record)
        summary.num_written += 1
        summary.num_generated_tokens += sum(len(o["token_ids"]) for o in record["outputs"])
        if record["error"]:
            summary.num_errors += 1
            if len(summary.errors) < 5:
                summary.errors.append(f"{record['id']}: {record['error']}")
        if bar is not None:
            elapsed = max(time.monotonic() - start, 1e-9)
            bar.set_postfix(tokens_per_s=f"{summary.num_generated_tokens / elapsed:.1f}",
                            errors=summary.num_errors)
            bar.update(1)

    try:
        if replicas:
            from widebeam.batch.ray_runner import run_on_ray

            run_on_ray(pending, model, engine_kwargs, defaults, replicas, emit, ray_address=ray_address,
                       max_in_flight=max_in_flight, cpus_per_replica=cpus_per_replica)
        elif pending:
            rows = (BatchRow(row_id({}, index) if error else row_id(raw, index), error=error) if error
                    else parse_row(raw, index, defaults) for index, raw, error in pending)
            BatchEngine(model, **engine_kwargs).run(rows, emit, max_in_flight)
    finally:
        writer.close()
        if bar is not None:
            bar.close()
    summary.elapsed_s = time.monotonic() - start
    return summary


def _progress(total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc="rows", unit="row", smoothing=0.1)
