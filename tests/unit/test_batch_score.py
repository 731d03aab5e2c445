"""`widebeam batch --score`: a file of (prompt, continuation) pairs scored in process, each record's
log-probs equal to `LLM.score`'s; rows with several `continuations`, CSV and Parquet outputs, and a
malformed row written with its error (the job goes on)."""

from __future__ import annotations

import pytest
import torch
from batch_checks import ENGINE, write_jsonl

from widebeam.batch import read_output, run
from widebeam.batch.cli import defaults_from
from widebeam.cli import build_parser
from widebeam.llm import LLM

PROMPT = [5, 17, 33, 9, 100, 3, 8]
ROWS = [{"id": "a", "prompt_token_ids": PROMPT, "continuation": [4, 5, 6]},
        {"id": "b", "prompt_token_ids": PROMPT, "continuation": [4, 9]},
        {"id": "c", "prompt_token_ids": [11, 12], "continuations": [[3], [3, 4]]},
        {"id": "d", "prompt_token_ids": PROMPT, "continuation": [4], "continuations": [[5]]},
        {"id": "e", "prompt_token_ids": PROMPT, "continuation": [4], "beam_width": 4}]


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".parquet"])
def test_batch_score_matches_llm_score(tiny_llama_dir, tmp_path, suffix):
    source = write_jsonl(tmp_path / "pairs.jsonl", ROWS)
    summary = run(source, tmp_path / f"out{suffix}", str(tiny_llama_dir), defaults={"score": True},
                  progress=False, **ENGINE)
    assert (summary.num_written, summary.num_errors) == (5, 2)
    records = {r["id"]: r for r in read_output(tmp_path / f"out{suffix}")}
    assert "continuation, continuations" in records["d"]["error"]
    assert "beam_width" in records["e"]["error"]
    llm = LLM(str(tiny_llama_dir), **ENGINE)
    for rid in "abc":
        row = next(r for r in ROWS if r["id"] == rid)
        continuations = row.get("continuations") or [row["continuation"]]
        expected = llm.score({"prompt_token_ids": row["prompt_token_ids"]}, continuations)
        outputs = records[rid]["outputs"]
        assert [o["token_ids"] for o in outputs] == [e.token_ids for e in expected]
        for output, want in zip(outputs, expected):
            torch.testing.assert_close(list(output["token_logprobs"]), want.token_logprobs, atol=1e-4,
                                       rtol=0)
            torch.testing.assert_close(output["score"], want.logprob, atol=1e-4, rtol=0)


def test_the_score_flag_makes_a_scoring_job():
    args = build_parser("batch").parse_args(["batch", "in.jsonl", "out.jsonl", "--score",
                                             "--max-input-length",
                                             "64", "--beam-width", "4"])
    assert defaults_from(args) == {"score": True, "max_input_length": 64}
