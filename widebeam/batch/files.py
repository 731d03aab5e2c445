"""Batch input and output files: JSONL, CSV and Parquet, written incrementally and resumable.

Output is in the input's format family, chosen by the output path's suffix:
- `.jsonl` / `.json`: one JSON object per line, appended and flushed row by row;
- `.csv`: one record per row (`outputs` as JSON text), appended and flushed row by row;
- `.parquet`: a directory of part files, each written whole to a temporary name and renamed, so a
  part either exists complete or not at all.

Resuming reads the ids already written and skips those rows. A crash can leave at most a partial
last line (JSONL/CSV: cut off on resume) or a temporary part (Parquet: ignored), so a rerun loses
nothing and duplicates nothing.
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def file_format(path: str | Path) -> str:
    suffix = Path(path).suffix.lower()
    formats = {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".parquet": "parquet"}
    if suffix not in formats:
        raise ValueError(f"{path}: unknown format {suffix!r}; use .jsonl, .csv or .parquet")
    return formats[suffix]


class MalformedRow(dict):
    """An input record that could not be read (a bad JSON line): written out with its error."""

    def __init__(self, error: str):
        super().__init__()
        self.error = error


def read_rows(path: str | Path) -> Iterator[tuple[int, Any]]:
    """(index, raw row) for every record of the input, in order; index is the record's position."""
    fmt = file_format(path)
    if fmt == "jsonl":
        with open(path, encoding="utf-8") as f:
            index = 0
            for line in f:
                if not line.strip():
                    continue
                try:
                    yield index, json.loads(line)
                except ValueError as exc:
                    yield index, MalformedRow(f"line {index + 1} is not valid JSON: {exc}")
                index += 1
    elif fmt == "csv":
        with open(path, encoding="utf-8", newline="") as f:
            yield from enumerate(csv.DictReader(f))
    else:
        import pyarrow.parquet as pq

        index = 0
        for batch in pq.ParquetFile(path).iter_batches():
            for row in batch.to_pylist():
                yield index, row
                index += 1


CSV_COLUMNS = ["id", "error", "num_prompt_tokens", "num_cached_tokens", "outputs"]


class OutputWriter:
    """Appends result records to the output and knows which ids it already holds."""

    def __init__(self, path: str | Path, flush_rows: int = 64):
        self.path = Path(path)
        self.format = file_format(path)
        self.flush_rows = flush_rows  # Parquet: records per part file
        self._pending: list[dict] = []
        self._file = None
        self._csv = None

    def done_ids(self) -> set[str]:
        """Ids already written (repairing a partial last line left by a crash)."""
        if self.format == "parquet":
            if not self.path.is_dir():
                return set()
            import pyarrow.parquet as pq

            return {str(i) for part in sorted(self.path.glob("part-*.parquet"))
                    for i in pq.read_table(part, columns=["id"]).column("id").to_pylist()}
        if not self.path.exists():
            return set()
        _cut_partial_last_line(self.path)
        if self.format == "jsonl":
            with open(self.path, encoding="utf-8") as f:
                return {str(json.loads(line)["id"]) for line in f if line.strip()}
        with open(self.path, encoding="utf-8", newline="") as f:
            return {row["id"] for row in csv.DictReader(f)}

    def write(self, record: dict) -> None:
        if self.format == "parquet":
            self._pending.append(record)
            if len(self._pending) >= self.flush_rows:
                self.flush()
            return
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            new = not self.path.exists() or self.path.stat().st_size == 0
            self._file = open(self.path, "a", encoding="utf-8", newline="")  # noqa: SIM115
            if self.format == "csv":
                self._csv = csv.DictWriter(self._file, CSV_COLUMNS)
                if new:
                    self._csv.writeheader()
        if self.format == "jsonl":
            self._file.write(json.dumps(record, ensure_ascii=False) + "\n")
        else:
            self._csv.writerow({**record, "outputs": json.dumps(record["outputs"], ensure_ascii=False)})
        self._file.flush()

    def flush(self) -> None:
        if self.format == "parquet" and self._pending:
            import pyarrow as pa
            import pyarrow.parquet as pq

            self.path.mkdir(parents=True, exist_ok=True)
            number = len(list(self.path.glob("part-*.parquet")))
            final = self.path / f"part-{number:05d}.parquet"
            tmp = final.with_suffix(".parquet.tmp")
            pq.write_table(pa.Table.from_pylist(self._pending, schema=_parquet_schema()), tmp)
            os.replace(tmp, final)
            self._pending = []
        elif self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())

    def close(self) -> None:
        self.flush()
        if self._file is not None:
            self._file.close()
            self._file = None


def read_output(path: str | Path) -> list[dict]:
    """Every record of an output written by `OutputWriter` (tests and users)."""
    path = Path(path)
    fmt = file_format(path)
    if fmt == "parquet":
        import pyarrow.parquet as pq

        return [row for part in sorted(path.glob("part-*.parquet"))
                for row in pq.read_table(part).to_pylist()]
    if fmt == "jsonl":
        with open(path, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    with open(path, encoding="utf-8", newline="") as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        row["outputs"] = json.loads(row["outputs"]) if row["outputs"] else []
        row["error"] = row["error"] or None
        for name in ("num_prompt_tokens", "num_cached_tokens"):
            row[name] = int(row[name]) if row[name] else None
    return rows


def _cut_partial_last_line(path: Path) -> None:
    """A crash mid-write leaves a last line without its newline: drop it (that row is redone)."""
    with open(path, "rb+") as f:
        data = f.read()
        if data and not data.endswith(b"\n"):
            f.truncate(data.rfind(b"\n") + 1)


def _parquet_schema():
    import pyarrow as pa

    output = pa.struct([("index", pa.int64()), ("text", pa.string()), ("token_ids", pa.list_(pa.int64())),
                        ("score", pa.float64()), ("cumulative_logprob", pa.float64()),
                        ("finish_reason", pa.string()), ("token_logprobs", pa.list_(pa.float64()))])
    return pa.schema([("id", pa.string()), ("error", pa.string()), ("num_prompt_tokens", pa.int64()),
                      ("num_cached_tokens", pa.int64()), ("outputs", pa.list_(output))])
