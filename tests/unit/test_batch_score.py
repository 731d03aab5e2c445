"""`widebeam batch --score`: a file of (prompt, continuation) pairs scored in process, each record's
log-probs held to transformers' log-softmax of the forced sequence on the same weights (an independent
reference: `LLM.score` shares the scoring code); rows with several `continuations`, CSV and Parquet
outputs, and a malformed row written with its error (the job goes on)."""

from __future__ import annotations

import pytest
import torch
from batch_checks import ENGINE, write_jsonl
from transformers import AutoModelForCausalLM

from widebeam.batch import read_output, run
from widebeam.batch.cli import defaults_from
from widebeam.cli import build_parser

PROMPT = [5, 17, 33, 9, 100, 3, 8]
ROWS = [{"id": "a", "prompt_token_ids": PROMPT, "continuation": [4, 5, 6]},
        {"id": "b", "prompt_token_ids": PROMPT, "continuation": [4, 9]},
        {"id": "c", "prompt_token_ids": [11, 12], "continuations": [[3], [3, 4], [7, 4, 4, 2]]},
        {"id": "d", "prompt_token_ids": PROMPT, "continuation": [4], "continuations": [[5]]},
        {"id": "e", "prompt_token_ids": PROMPT, "continuation": [4], "beam_width": 4}]


def reference_logprobs(hf, prompt: list[int], continuation: list[int]) -> list[float]:
    """transformers: each continuation token's log-softmax given the prompt and the tokens before it,
    one full forward pass of prompt + continuation."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + continuation])).logits[0].float()
    positions = torch.arange(len(prompt) - 1, len(prompt) + len(continuation) - 1)
    return torch.log_softmax(logits, -1)[positions, torch.tensor(continuation)].tolist()


@pytest.fixture(scope="module")
def hf(tiny_llama_dir):
    return AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".parquet"])
def test_batch_score_matches_transformers(tiny_llama_dir, hf, tmp_path, suffix):
    source = write_jsonl(tmp_path / "pairs.jsonl", ROWS)
    summary = run(source, tmp_path / f"out{suffix}", str(tiny_llama_dir), defaults={"score": True},
                  progress=False, dtype="float32", **ENGINE)
    assert (summary.num_written, summary.num_errors) == (5, 2)
    records = {r["id"]: r for r in read_output(tmp_path / f"out{suffix}")}
    assert "continuation, continuations" in records["d"]["error"]
    assert "beam_width" in records["e"]["error"]
    for rid in "abc":
        row = next(r for r in ROWS if r["id"] == rid)
        continuations = row.get("continuations") or [row["continuation"]]
        outputs = records[rid]["outputs"]
        assert [list(o["token_ids"]) for o in outputs] == continuations
        for output, continuation in zip(outputs, continuations):
            expected = reference_logprobs(hf, row["prompt_token_ids"], continuation)
            torch.testing.assert_close(list(output["token_logprobs"]), expected, atol=1e-4, rtol=0)
            torch.testing.assert_close(output["score"], sum(expected), atol=1e-4, rtol=0)


def test_the_score_flag_makes_a_scoring_job():
    args = build_parser("batch").parse_args(["batch", "in.jsonl", "out.jsonl", "--score",
                                             "--max-input-length",
                                             "64", "--beam-width", "4"])
    assert defaults_from(args) == {"score": True, "max_input_length": 64}
