"""One engine over a stream of batch rows: continuous batching kept full, one record per row.

Rows are added to the engine as it has room for them (`max_in_flight` queued or running), so its
scheduler always has work to admit; each finished request becomes a record at once. A row the
engine refuses (too long, infeasible for the KV cache, a bad parameter) or one that fails while
running becomes a record with its error; the job goes on. The same loop runs in-process
(`widebeam batch`) and inside every Ray replica (`batch/ray_runner.py`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable

from widebeam.batch.rows import BatchRow
from widebeam.heap import freeze_startup_heap
from widebeam.outputs import RequestOutput
from widebeam.score_params import ScoreParams

DEFAULT_MAX_IN_FLIGHT = 256


def result_record(row_id: str, output: RequestOutput | None = None, error: str | None = None,
                  scoring: bool = False) -> dict:
    """The output record of one row: every returned sequence (beams best first) or the error."""
    outputs = []
    if output is not None:
        outputs = [{"index": c.index, "text": c.text, "token_ids": list(c.token_ids), "score": c.score,
                    "cumulative_logprob": c.cumulative_logprob, "finish_reason": c.finish_reason}
                   for c in output.outputs]
        if scoring:  # each continuation's tokens' log-probs (their sum is its score)
            for record, c in zip(outputs, output.outputs):
                record["token_logprobs"] = [entry[t].logprob for t, entry in zip(c.token_ids, c.logprobs)]
    return {"id": row_id, "error": error, "outputs": outputs,
            "num_prompt_tokens": len(output.prompt_token_ids) if output is not None else None,
            "num_cached_tokens": output.num_cached_tokens if output is not None else None}


class BatchEngine:
    """An engine that turns batch rows into records."""

    def __init__(self, model: str, **engine_kwargs):
        from widebeam.llm import LLM

        self.llm = LLM(model, **engine_kwargs)
        freeze_startup_heap()  # a long-lived batch process (widebeam/heap.py)
        self._ids = itertools.count()

    def run(self, rows: Iterable[BatchRow], emit: Callable[[dict], None],
            max_in_flight: int = DEFAULT_MAX_IN_FLIGHT) -> None:
        """Run every row; `emit(record)` once per row, in completion order."""
        engine = self.llm.engine
        in_flight: dict[str, tuple[str, bool]] = {}  # engine request id -> (row id, scoring)
        pending = iter(rows)
        exhausted = False
        while True:
            while not exhausted and len(in_flight) < max_in_flight:
                row = next(pending, None)
                if row is None:
                    exhausted = True
                elif row.error is not None:
                    emit(result_record(row.row_id, error=row.error))
                else:
                    request_id = f"batch-{next(self._ids)}"
                    try:
                        engine.add_request(request_id, self._prompt(row), row.params)
                    except ValueError as exc:  # refused at admission: nothing was queued
                        emit(result_record(row.row_id, error=f"{type(exc).__name__}: {exc}"))
                        continue
                    in_flight[request_id] = (row.row_id, isinstance(row.params, ScoreParams))
            if not in_flight:
                return
            for delta in engine.step():
                if delta.finished:
                    rid, scoring = in_flight.pop(delta.request_id)
                    emit(result_record(rid, delta.output, delta.error, scoring))

    def _prompt(self, row: BatchRow):
        if isinstance(row.prompt, dict) and "messages" in row.prompt:
            tokenizer = self.llm.tokenizer
            if tokenizer is None or not getattr(tokenizer, "chat_template", None):
                raise ValueError("messages need a model with a chat template")
            return tokenizer.apply_chat_template(row.prompt["messages"], tokenize=False,
                                                 add_generation_prompt=True)
        return row.prompt
