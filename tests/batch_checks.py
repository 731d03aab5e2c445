"""Rows and checks shared by the batch tests (in process and on Ray)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

ENGINE = {"device": "cpu", "kv_cache_memory": "1MiB", "tokens_per_block": 4}
DEFAULTS = {"max_new_tokens": 6, "temperature": 0.0}


def mixed_rows(num_rows: int, seed: int = 0) -> list[dict]:
    """Greedy, seeded sampling, beam widths 1-16, and a few rows that can never run."""
    rng = random.Random(seed)
    rows = []
    for i in range(num_rows):
        row = {"id": f"q{i}",
               "prompt_token_ids": [rng.randrange(5, 120) for _ in range(rng.randrange(2, 24))]}
        kind = i % 4
        if kind == 1:
            row.update(temperature=0.8, top_p=0.9, seed=i)
        elif kind == 2:
            row.update(beam_width=rng.randrange(1, 17), length_penalty=0.8)
        elif kind == 3 and i % 20 == 3:
            row["prompt_token_ids"] = [1] * 4000  # longer than max_seq_len: written with its error
        rows.append(row)
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def by_id(records: list[dict]) -> dict[str, dict]:
    ids = [r["id"] for r in records]
    assert len(ids) == len(set(ids)), "a row was written twice"
    return {r["id"]: r for r in records}


def assert_same_results(got: dict[str, dict], expected: dict[str, dict]):
    assert set(got) == set(expected)
    for row_id, record in expected.items():
        other = got[row_id]
        assert bool(other["error"]) == bool(record["error"]), row_id
        assert [o["token_ids"] for o in other["outputs"]] == \
               [o["token_ids"] for o in record["outputs"]], row_id
        for a, b in zip(other["outputs"], record["outputs"]):
            assert a["cumulative_logprob"] == pytest.approx(b["cumulative_logprob"], abs=1e-4)
