"""The engine loop: one asyncio task owns the engine.

The engine is not thread-safe, so only `EngineLoop.run` calls `add_request`, `step` and `abort`, one
at a time, and the heavy calls (`step`, tokenizing in `add_request`) run in a worker thread so the
event loop keeps serving. Handlers hand it commands and wait on a future (admission: accepted, or the
engine's error, before any 200 is sent) and then on their group's queue of events (streamed text,
final outputs).

Only the engine's public API is used: each step's `RequestDelta`s say which requests produced their
first token, what text they added and which finished, so a step costs the loop work in proportion to
what changed, never a re-read of every request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from widebeam.outputs import RequestDelta
from widebeam.server import protocol as p
from widebeam.server.metrics import ServerMetrics

log = logging.getLogger("widebeam.server")


class Group:
    """The engine requests of one API call and the queue their events arrive on:
    (index, "text", new_text) for streams (the text a step added, held back against stop strings by the
    engine), (index, "final", RequestOutput) and (index, "error", ApiError)."""

    def __init__(self, request_ids: list[str], stream: bool):
        self.request_ids = request_ids
        self.stream = stream
        self.queue: asyncio.Queue = asyncio.Queue()


@dataclass
class _Tracked:
    group: Group
    index: int
    arrival: float
    first_token_at: float | None = None


@dataclass
class _Add:
    group: Group
    entries: list  # (prompt, params) per request id
    future: asyncio.Future
    arrival: float = field(default_factory=time.monotonic)


class EngineLoop:
    def __init__(self, engine, metrics: ServerMetrics | None = None):
        self.engine = engine
        self.metrics = metrics
        self.snapshot: dict = engine.stats()
        self.failure: BaseException | None = None
        self._commands: list = []
        self._wake = asyncio.Event()
        self._tracked: dict[str, _Tracked] = {}

    # handler side (event-loop thread) ------------------------------------------------------------
    async def submit(self, request_ids: list[str], entries: list, stream: bool) -> Group:
        """Admit all of `entries` or none; raises the engine's ValueError (or ApiError) if one is refused."""
        if self.failure is not None:
            raise p.ApiError(503, f"the engine loop has stopped: {self.failure}", type="server_error")
        group = Group(request_ids, stream)
        future = asyncio.get_running_loop().create_future()
        self._commands.append(_Add(group, entries, future))
        self._wake.set()
        await future
        return group

    def abort(self, request_ids: list[str]) -> None:
        self._commands.append(("abort", list(request_ids)))
        self._wake.set()

    # the owner task ------------------------------------------------------------------------------
    async def run(self) -> None:
        try:
            while True:
                if not self._commands and not self.engine.has_unfinished():
                    self._wake.clear()
                    await self._wake.wait()
                commands, self._commands = self._commands, []
                if commands:
                    results = await asyncio.to_thread(self._apply, commands)
                    self._settle(commands, results)
                    self.snapshot = self.engine.stats()
                if self.engine.has_unfinished():
                    try:
                        deltas = await asyncio.to_thread(self.engine.step)
                    except Exception as exc:  # a bug: fail the requests in flight, keep serving
                        log.exception("engine step failed")
                        self._fail_all(exc)
                    else:
                        self._after_step(deltas, time.monotonic())
                    self.snapshot = self.engine.stats()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            log.exception("engine loop stopped")
            self.failure = exc
            self._fail_all(exc)
            for command in self._commands:
                if isinstance(command, _Add) and not command.future.done():
                    command.future.set_exception(p.ApiError(503, "the engine loop has stopped", type="server_error"))
            raise

    def _apply(self, commands: list) -> list:
        """Runs in the worker thread: the engine calls of a batch of commands, in order."""
        results = []
        for command in commands:
            if isinstance(command, _Add):
                results.append(self._add(command))
            else:
                for request_id in command[1]:
                    self.engine.abort(request_id)
                results.append(None)
        return results

    def _add(self, command: _Add):
        added, num_prompt_tokens = [], []
        try:
            for request_id, (prompt, params) in zip(command.group.request_ids, command.entries):
                prompt_token_ids = self.engine.add_request(request_id, prompt, params)
                added.append(request_id)
                num_prompt_tokens.append(len(prompt_token_ids))
        except Exception as exc:
            for request_id in added:
                self.engine.abort(request_id)
            if isinstance(exc, ValueError):
                return exc
            log.exception("add_request failed")
            return p.ApiError(500, f"internal error while admitting the request: {exc}", type="server_error")
        return num_prompt_tokens

    def _settle(self, commands: list, results: list) -> None:
        for command, result in zip(commands, results):
            if not isinstance(command, _Add):
                for request_id in command[1]:
                    if self._tracked.pop(request_id, None) is not None and self.metrics:
                        self.metrics.aborted.inc()
                continue
            if isinstance(result, Exception):
                if not command.future.done():
                    command.future.set_exception(result)
                continue
            if command.future.done():  # the handler went away while waiting for admission
                for request_id in command.group.request_ids:
                    self.engine.abort(request_id)
                if self.metrics:
                    self.metrics.aborted.inc(len(command.group.request_ids))
                continue
            for index, request_id in enumerate(command.group.request_ids):
                self._tracked[request_id] = _Tracked(command.group, index, command.arrival)
            if self.metrics:
                self.metrics.prompt_tokens.inc(sum(result))
            command.future.set_result(None)

    def _after_step(self, deltas: list[RequestDelta], now: float) -> None:
        for delta in deltas:
            tracked = self._tracked.get(delta.request_id)
            if tracked is None:  # aborted, or its handler left before admission settled
                continue
            if delta.first_token and tracked.first_token_at is None:
                tracked.first_token_at = now
                if self.metrics:
                    self.metrics.time_to_first_token.observe(now - tracked.arrival)
            if tracked.group.stream and delta.new_text:
                tracked.group.queue.put_nowait((tracked.index, "text", delta.new_text))
            if not delta.finished:
                continue
            del self._tracked[delta.request_id]
            output = delta.output
            if self.metrics and output.outputs:
                self.metrics.finished.labels(output.outputs[0].finish_reason or "unknown").inc()
                self.metrics.generated_tokens.inc(sum(len(c.token_ids) for c in output.outputs))
                num_tokens = max(len(c.token_ids) for c in output.outputs)
                if tracked.first_token_at is not None and num_tokens > 1:
                    self.metrics.time_per_output_token.observe((now - tracked.first_token_at) / (num_tokens - 1))
            tracked.group.queue.put_nowait((tracked.index, "final", output))

    def _fail_all(self, exc: BaseException) -> None:
        error = p.ApiError(500, f"the engine failed while running this request: {exc}", type="server_error")
        for request_id, tracked in self._tracked.items():
            tracked.group.queue.put_nowait((tracked.index, "error", error))
            try:
                self.engine.abort(request_id)
            except Exception:
                log.exception("abort after a failed step")
        if self.metrics:
            self.metrics.aborted.inc(len(self._tracked))
        self._tracked.clear()
