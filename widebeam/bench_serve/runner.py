"""One open-loop run: send each request at its arrival time (arrivals.py) whether or not earlier ones
have been answered, at most `max_concurrency` in flight (a semaphore: a request past it waits in the
client, and its timings start when it is sent, as vLLM's do), warm-up requests first and left out.

The HTTP pool allows as many connections as may be in flight, so the pool itself never becomes a hidden
concurrency bound (a closed loop in disguise).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from widebeam.bench_serve.arrivals import arrival_offsets_s
from widebeam.bench_serve.client import send_request
from widebeam.bench_serve.records import RequestRecord, RequestSpec


@dataclass(frozen=True)
class RunConfig:
    base_url: str
    request_rate: float = float("inf")
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    timeout_s: float = 600.0
    api_key: str | None = None
    show_progress: bool = True


@dataclass
class RunOutcome:
    records: list[RequestRecord]  # the measured requests, in the order they were built
    duration_s: float  # first send to last answer
    num_warmups: int


def make_client(config: RunConfig) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    limits = httpx.Limits(max_connections=config.max_concurrency, max_keepalive_connections=None)
    return httpx.AsyncClient(base_url=config.base_url.rstrip("/"), headers=headers, limits=limits,
                             timeout=httpx.Timeout(config.timeout_s))


async def run_load(specs: Sequence[RequestSpec], config: RunConfig,
                   warmups: Sequence[RequestSpec] = ()) -> RunOutcome:
    offsets_s = arrival_offsets_s(len(specs), config.request_rate, config.burstiness, config.seed)
    limit = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    async with make_client(config) as client:

        async def bounded(spec: RequestSpec) -> RequestRecord:
            async with limit if limit else contextlib.nullcontext():
                return await send_request(client, spec, config.timeout_s)

        if warmups:  # answered before the clock starts; their records are dropped
            await asyncio.gather(*(bounded(spec) for spec in warmups))
        progress = _progress_bar(len(specs), config)
        records: list[RequestRecord | None] = [None] * len(specs)

        async def at_arrival(index: int, spec: RequestSpec, send_at: float) -> None:
            await asyncio.sleep(max(send_at - time.perf_counter(), 0.0))
            records[index] = await bounded(spec)
            if progress is not None:
                progress.update(1)

        start = time.perf_counter()
        try:
            await asyncio.gather(*(at_arrival(i, spec, start + float(offset))
                                   for i, (spec, offset) in enumerate(zip(specs, offsets_s, strict=True))))
        finally:
            if progress is not None:
                progress.close()
        duration_s = time.perf_counter() - start
    return RunOutcome([r for r in records if r is not None], duration_s, len(warmups))


def _progress_bar(total: int, config: RunConfig):
    if not config.show_progress:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=f"rate {config.request_rate:g}/s", unit="req", leave=False)


def run(specs: Sequence[RequestSpec], config: RunConfig, warmups: Sequence[RequestSpec] = ()) -> RunOutcome:
    return asyncio.run(run_load(specs, config, warmups))
