"""The engine loop: one asyncio task owns the engine.

The engine is not thread-safe, so only `EngineLoop.run` calls `add_request`, `step` and `abort`, one
at a time, and the heavy calls (`step`, tokenizing in `add_request`) run in a worker thread so the
event loop keeps serving. Handlers hand it commands and wait on a future (admission: accepted, or the
engine's error, before any 200 is sent) and then on their group's queue of events (streamed text,
final outputs).

Only the engine's public API is used: each step's `RequestDelta`s say which requests produced their
first token, what text they added and which finished, so a step costs the loop work in proportion to
what changed, never a re-read of every request. A delta with `error` set is one request that failed
alone (the engine already aborted it): its call gets a 500 and the others go on. Only an exception
from `step()` itself (the shared forward pass) fails every request in flight.

Shutdown (`drain`, then `close`): new calls get 503 at once, the calls in flight get up to the
shutdown timeout to finish, the rest are aborted with a 503 error (a stream: an error event, then
`[DONE]`), and the owner task stops after its current step with every KV block free.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from widebeam.errors import QueueFullError
from widebeam.outputs import RequestDelta
from widebeam.response_format import GRAMMAR_COMPILE_TIMEOUT_S
from widebeam.sched.queue_bound import check_group_size
from widebeam.server import schemas as s
from widebeam.server.metrics import ServerMetrics
from widebeam.structured.grammars import NUM_COMPILE_WORKERS

log = logging.getLogger("widebeam.server")

SHUTTING_DOWN_CODE = "server_shutting_down"
DRAIN_POLL_S = 0.05


def shutting_down(message: str) -> s.ApiError:
    return s.ApiError(503, message, type="server_error", code=SHUTTING_DOWN_CODE)


class Group:
    """The engine requests of one API call and the queue their events arrive on:
    (index, "text", (new_text, new_token_ids, new_logprobs)) for streams (the text a step added, held back
    against stop strings by the engine, and with logprobs its tokens' entries), (index, "final",
    RequestOutput) and (index, "error", ApiError)."""

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


def engine_thread() -> ThreadPoolExecutor:
    """The one thread that runs every torch call of a served engine: its load and warm-up
    (`thread.submit(LLMEngine, ...)`), then each command and step. PyTorch's CPU thread pool (libgomp)
    keeps a team of threads per calling thread, and once a process holds more of them than CPUs it stops
    spinning between parallel regions, so every op pays a sleep and a wake-up: a greedy request's
    decode step from a second thread took 1.6-1.8x as long (SmolLM2-135M bfloat16, 2 cores: 32 tokens in
    1.1-1.2 s on the thread that built the engine, 1.9-2.1 s from another; the server's TPOT 57-61 ms
    against 37 ms offline, when steps went through `asyncio.to_thread`)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="widebeam-engine")


class EngineLoop:
    def __init__(self, engine, metrics: ServerMetrics | None = None,
                 thread: ThreadPoolExecutor | None = None):
        """`thread`: the engine's own thread (`engine_thread`), best the one that built it; every engine
        call runs there."""
        self.engine = engine
        self._engine_thread = thread or engine_thread()
        self.metrics = metrics
        self.snapshot: dict = engine.stats()
        self.failure: BaseException | None = None
        self.draining = False  # set by drain() and close(): new calls are refused with 503
        self._commands: list = []
        # threads that wait for a grammar's worker process, one per process (see _compile_grammars)
        self._compile_executor = ThreadPoolExecutor(max_workers=NUM_COMPILE_WORKERS,
                                                    thread_name_prefix="widebeam-grammar")
        self._applying: list = []  # the commands the worker thread is applying now
        self._wake = asyncio.Event()
        self._tracked: dict[str, _Tracked] = {}
        self._abort_all: s.ApiError | None = None  # set by drain(): the owner task fails everything in flight
        self._abort_now = False  # a second signal: stop waiting for the calls in flight
        self._closing = False
        self._task: asyncio.Task | None = None

    # lifecycle (event-loop thread) ---------------------------------------------------------------
    def start(self) -> asyncio.Task:
        self._task = asyncio.create_task(self.run(), name="widebeam-engine-loop")
        return self._task

    def abort_now(self) -> None:
        """Cut a drain short (a second SIGTERM or SIGINT). Only sets a flag: safe in a signal handler."""
        self._abort_now = True

    @property
    def busy(self) -> bool:
        """Engine requests in flight, or calls waiting for admission."""
        return bool(self._tracked or self._applying or any(isinstance(c, _Add) for c in self._commands))

    async def drain(self, timeout_s: float) -> int:
        """Stop admitting (new calls get 503), wait up to `timeout_s` for the calls in flight to finish,
        then fail the rest with a 503. Returns how many engine requests were aborted."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        if self.busy:
            log.warning("shutting down: new requests get 503; waiting up to %g s for %d request(s) in flight",
                        timeout_s, len(self._tracked))
        while self.busy and self._running and loop.time() < deadline and not self._abort_now:
            await asyncio.sleep(DRAIN_POLL_S)
        if not self.busy or not self._running:
            return 0
        num_aborted = len(self._tracked)
        reason = ("a second signal came" if self._abort_now
                  else f"the shutdown timeout of {timeout_s:g} s ran out")
        self._abort_all = shutting_down(f"the server shut down before this request finished: {reason}")
        self._wake.set()
        while self.busy and self._running:  # the owner task fails them after its current step
            await asyncio.sleep(DRAIN_POLL_S)
        log.warning("shutting down: %s; aborted %d request(s) still running", reason, num_aborted)
        return num_aborted

    async def close(self) -> None:
        """Stop the owner task after its current step; fail whatever is left with a 503 and free its
        blocks."""
        self.draining = True
        self._closing = True
        self._wake.set()
        if self._task is not None:
            await asyncio.wait({self._task})  # never raises: a loop failure was logged when it happened
        self._fail_all(shutting_down("the server shut down before this request finished"), failed=False)
        for command in self._commands:
            if isinstance(command, _Add) and not command.future.done():
                command.future.set_exception(shutting_down("the server is shutting down"))
        self._commands = []
        self._compile_executor.shutdown(wait=False, cancel_futures=True)
        self._engine_thread.shutdown(wait=False)
        grammars = getattr(self.engine, "grammars", None)
        if grammars is not None:  # kill the grammar worker processes (a compile in flight ends)
            grammars.close()
        if self.failure is None:
            self.snapshot = self.engine.stats()

    @property
    def _running(self) -> bool:
        return self._task is None or not self._task.done()

    # handler side (event-loop thread) ------------------------------------------------------------
    async def submit(self, request_ids: list[str], entries: list, stream: bool) -> Group:
        """Admit all of `entries` or none; raises the engine's ValueError (or ApiError) if one is refused."""
        if self.failure is not None:
            raise s.ApiError(503, f"the engine loop has stopped: {self.failure}", type="server_error")
        if self.draining:
            raise shutting_down("the server is shutting down and admits no new requests")
        await self._compile_grammars(entries)
        group = Group(request_ids, stream)
        future = asyncio.get_running_loop().create_future()
        self._commands.append(_Add(group, entries, future))
        self._wake.set()
        await future
        return group

    async def _compile_grammars(self, entries: list) -> None:
        """Compile each `response_format` before the request reaches the engine (whose `add_request`
        then finds it compiled), never on the engine's thread. A schema not compiled before goes to a
        worker process (structured/grammars.py), which is killed past GRAMMAR_COMPILE_TIMEOUT_S of its
        own compile time (the request gets a 400), so a refused compile costs nothing after its 400.
        `json_object` and schemas compiled before skip the workers' queue: another client's compiles
        never hold them up."""
        formats = {}
        for _, params in entries:
            response_format = getattr(params, "response_format", None)
            if response_format is not None:
                formats[repr(response_format)] = response_format
        if not formats:
            return
        loop = asyncio.get_running_loop()
        grammars = self.engine.grammars
        for response_format in formats.values():
            # a quick one takes the default executor (milliseconds); the rest wait for a worker here
            executor = None if grammars.is_quick(response_format) else self._compile_executor
            await loop.run_in_executor(executor, grammars.compile, response_format, GRAMMAR_COMPILE_TIMEOUT_S)

    def abort(self, request_ids: list[str]) -> None:
        self._commands.append(("abort", list(request_ids)))
        self._wake.set()

    # the owner task ------------------------------------------------------------------------------
    async def run(self) -> None:
        try:
            while not self._closing:
                if not self._commands and not self.engine.has_unfinished() and self._abort_all is None:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                commands, self._commands = self._commands, []
                if commands:
                    self._applying = commands
                    try:
                        results = await asyncio.get_running_loop().run_in_executor(
                            self._engine_thread, self._apply, commands)
                        self._settle(commands, results)
                    finally:
                        self._applying = []
                    self.snapshot = self.engine.stats()
                if self._abort_all is not None:
                    error, self._abort_all = self._abort_all, None
                    self._fail_all(error, failed=False)
                    self.snapshot = self.engine.stats()
                if self.engine.has_unfinished() and not self._closing:
                    try:
                        deltas = await asyncio.get_running_loop().run_in_executor(
                            self._engine_thread, self.engine.step)
                    except Exception as exc:  # a bug: fail the requests in flight, keep serving
                        log.exception("engine step failed")
                        self._fail_all(s.ApiError(500, f"the engine failed while running this request: {exc}",
                                                  type="server_error"))
                    else:
                        self._after_step(deltas, time.monotonic())
                    self.snapshot = self.engine.stats()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            log.exception("engine loop stopped")
            self.failure = exc
            self._fail_all(s.ApiError(500, f"the engine failed while running this request: {exc}",
                                      type="server_error"))
            for command in self._commands:
                if isinstance(command, _Add) and not command.future.done():
                    command.future.set_exception(s.ApiError(503, "the engine loop has stopped",
                                                            type="server_error"))
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
            # the engine's public stats name the bound (None: unbounded, or an engine without one)
            check_group_size(len(command.entries), self.snapshot.get("queue", {}).get("max_waiting_requests"))
            for request_id, (prompt, params) in zip(command.group.request_ids, command.entries):
                prompt_token_ids = self.engine.add_request(request_id, prompt, params)
                added.append(request_id)
                num_prompt_tokens.append(len(prompt_token_ids))
        except Exception as exc:
            for request_id in added:
                self.engine.abort(request_id)
            if isinstance(exc, ValueError):
                return exc
            if isinstance(exc, QueueFullError):  # the bounded queue: a 429 naming what is full, never a wait
                return s.ApiError(429, str(exc), param=exc.setting, code="queue_full",
                                  type="rate_limit_error", headers={"Retry-After": str(exc.retry_after_s)})
            log.exception("add_request failed")
            return s.ApiError(500, f"internal error while admitting the request: {exc}", type="server_error")
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
            if delta.error is not None:  # this request failed alone; the engine has aborted it
                del self._tracked[delta.request_id]
                log.error("request %s failed in the engine: %s", delta.request_id, delta.error)
                if self.metrics:
                    self.metrics.failed.inc()
                tracked.group.queue.put_nowait((tracked.index, "error", s.ApiError(
                    500, f"the engine failed while running this request: {delta.error}", type="server_error",
                    code="engine_error")))
                continue
            if delta.first_token and tracked.first_token_at is None:
                tracked.first_token_at = now
                if self.metrics:
                    self.metrics.time_to_first_token.observe(now - tracked.arrival)
            if tracked.group.stream and (delta.new_text or delta.new_logprobs):
                tracked.group.queue.put_nowait((tracked.index, "text", (delta.new_text, delta.new_token_ids,
                                                                        delta.new_logprobs)))
            if not delta.finished:
                continue
            del self._tracked[delta.request_id]
            output = delta.output
            if self.metrics and output.outputs:
                self.metrics.finished.labels(output.outputs[0].finish_reason or "unknown").inc()
                self.metrics.generated_tokens.inc(sum(len(c.token_ids) for c in output.outputs))
                num_tokens = max(len(c.token_ids) for c in output.outputs)
                if tracked.first_token_at is not None and num_tokens > 1:
                    self.metrics.time_per_output_token.observe(
                        (now - tracked.first_token_at) / (num_tokens - 1))
            tracked.group.queue.put_nowait((tracked.index, "final", output))

    def _fail_all(self, error: s.ApiError, failed: bool = True) -> None:
        """Answer every tracked request with `error` and abort it in the engine (called between steps).
        `failed`: count them as failed (an engine error), else as aborted (shutdown)."""
        for request_id, tracked in self._tracked.items():
            tracked.group.queue.put_nowait((tracked.index, "error", error))
            try:
                self.engine.abort(request_id)
            except Exception:
                log.exception("abort of %s failed", request_id)
        if self.metrics:
            (self.metrics.failed if failed else self.metrics.aborted).inc(len(self._tracked))
        self._tracked.clear()
