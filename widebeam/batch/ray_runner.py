"""The batch job on Ray Data: `map_batches` over an actor pool of engine replicas.

Each replica is an actor holding one engine (one GPU where there are GPUs, `cpus_per_replica` CPU
slots otherwise) that runs its batch of rows through `BatchEngine` (continuous batching inside the
batch) and returns one record per row. The driver writes the records as they stream back, through
the same writer as an in-process job, so resuming works the same way.

Every row appears exactly once: a replica that dies is restarted by Ray and its batch is run again
from the start (the dead attempt returned nothing), and only the driver writes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from typing import Any


class EngineReplica:
    """A Ray Data actor: one engine; a batch of raw rows in, their records out."""

    def __init__(self, model: str, engine_kwargs: dict, defaults: dict, max_in_flight: int, num_threads: int):
        import torch

        from widebeam.batch.local import BatchEngine

        if not torch.cuda.is_available():
            torch.set_num_threads(num_threads)  # the actor's CPU slots, not the whole host
        self.engine = BatchEngine(model, **engine_kwargs)
        self.defaults = defaults
        self.max_in_flight = max_in_flight

    def __call__(self, batch: dict) -> dict:
        from widebeam.batch.rows import BatchRow, parse_row, row_id

        rows = []
        for index, raw_text, error in zip(batch["index"], batch["raw"], batch["error"]):
            raw = json.loads(raw_text)
            if error:
                rows.append(BatchRow(row_id(raw, int(index)), error=str(error)))
            else:
                rows.append(parse_row(raw, int(index), self.defaults))
        records: list[str] = []
        self.engine.run(rows, lambda record: records.append(json.dumps(record)), self.max_in_flight)
        return {"record": records}


def run_on_ray(pending: Sequence[tuple[int, Any, str | None]], model: str, engine_kwargs: dict,
               defaults: dict, replicas: int, emit: Callable[[dict], None], *, ray_address: str | None = None,
               max_in_flight: int = 256, cpus_per_replica: int = 1) -> None:
    """Run `pending` rows, (index, raw row, read error or None), on `replicas` engine actors;
    `emit(record)` on the driver for each row as results stream back."""
    import ray
    import torch

    if not pending:
        return
    if not ray.is_initialized():
        ray.init(address=ray_address, ignore_reinit_error=True, log_to_driver=False)
    items = [{"index": index, "raw": json.dumps(raw, default=_jsonable), "error": error or ""}
             for index, raw, error in pending]
    # Two or more batches per replica keep every replica busy; no batch is larger than the number
    # of requests one engine keeps in flight.
    batch_size = max(1, min(max_in_flight, math.ceil(len(items) / (2 * replicas))))
    resources = {"num_gpus": 1} if torch.cuda.is_available() else {"num_cpus": cpus_per_replica}
    dataset = ray.data.from_items(items).map_batches(
        EngineReplica,
        fn_constructor_kwargs={"model": model, "engine_kwargs": engine_kwargs, "defaults": defaults,
                               "max_in_flight": max_in_flight, "num_threads": cpus_per_replica},
        batch_size=batch_size, batch_format="numpy", compute=ray.data.ActorPoolStrategy(size=replicas),
        **resources)  # Ray Data restarts a replica that dies and runs its batch again (its default)
    for batch in dataset.iter_batches(batch_size=None, batch_format="numpy"):
        for record in batch["record"]:
            emit(json.loads(str(record)))


def _jsonable(value):
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"cannot send {type(value).__name__} to a replica")
