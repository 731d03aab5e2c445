"""Grammar compiles in worker processes that can be killed: the server's bounded compile.

xgrammar cannot stop a compile once begun, so a compile run on a thread and refused at its time bound
kept its thread (and a core) until it finished (the QA pass: three heavy regex schemas held the one
compile thread for 18.5 s after their 400s). Here each schema is first compiled in a child process
(`python -m widebeam.structured.compile_worker`, which imports xgrammar and nothing of the engine); past
its bound the child is killed at once and a fresh one is started in its place, so a refused compile
costs nothing after its refusal. A child that dies mid-compile (xgrammar crashing on a schema) is
replaced the same way, and the schema is refused.

A compile that finished in time answers with the grammar's text (EBNF, the schema-to-grammar work done),
and the parent compiles that text itself: the same work, now known to end. The compiled grammar is not
sent back: `CompiledGrammar.serialize_json()` of a schema near the caps (9 MB in memory) is 373 MB of
JSON, 17.6 s to write and 7.7 s to read here, where compiling it again takes 0.16 s.

The parent sends the tokenizer's `TokenizerInfo.serialize_json()` once, then one JSON schema per compile.
Frames on the child's stdin/stdout: an 8-byte big-endian length, then the bytes; an answer's first byte
says what it is (`K` compiled, `E` refused).
"""

from __future__ import annotations

import logging
import os
import queue
import re
import select
import struct
import subprocess
import sys
import threading
import time

log = logging.getLogger("widebeam.server")

# xgrammar 0.2.9 writes a string with minLength / maxLength as `"\"" chars{m, n} "\""` whose character
# class lets raw control characters through (invalid JSON: json.loads refuses "a<TAB>b"); its other strings
# exclude them. The class is narrowed to JSON's in the grammar's text before it is compiled.
_LENGTH_LIMITED_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\\r\n]'

# A child's start is mostly `import xgrammar` (which imports torch): ~2 s here, more on a loaded host.
# It is not a schema's cost, so it has a bound of its own.
WORKER_START_TIMEOUT_S = 120.0
_HEADER = struct.Struct(">Q")
_READY = b"R"
_COMPILED = b"K"
_REFUSED = b"E"


class CompileRefused(Exception):
    """xgrammar refused the schema (or crashed on it); the message is one line, for the client."""


class WorkerGone(RuntimeError):
    """The worker was dead before the schema reached it: not the schema's doing."""

    def __init__(self):
        super().__init__("the grammar compiler process died before the schema reached it")


class CompileTimeout(Exception):
    """The compile ran past its bound; its worker process was killed."""


def grammar_of(schema: str) -> str:
    """The EBNF grammar xgrammar compiles for a JSON schema (no free whitespace, JSON's string
    characters), or RuntimeError/ValueError from xgrammar."""
    import xgrammar

    grammar = str(xgrammar.Grammar.from_json_schema(schema, any_whitespace=False))
    return grammar.replace(_LENGTH_LIMITED_CHAR, _JSON_STRING_CHAR)


def one_line_reason(exc: BaseException) -> str:
    """xgrammar's error as one line, without its source location or stack trace."""
    reason = re.sub(r"^\[[^\]]*\] [^:]*:\d+: ", "", str(exc).strip())
    reason = re.sub(r"\S+\.(?:cc|cpp|h|hpp|py):\d+:?\s*", "", reason)
    return (reason.splitlines() or ["xgrammar refused it"])[0]


def _write_frame(stream, payload: bytes) -> None:
    data = memoryview(_HEADER.pack(len(payload)) + payload)
    while data:  # an unbuffered pipe may take part of it (a signal mid-write)
        data = data[stream.write(data) or 0:]
    stream.flush()


def _read_exactly(stream, num_bytes: int) -> bytes:
    chunks = []
    while num_bytes:  # a pipe read may return less than asked
        chunk = stream.read(num_bytes)
        if not chunk:
            raise EOFError("the other end closed the pipe")
        chunks.append(chunk)
        num_bytes -= len(chunk)
    return b"".join(chunks)


def _read_frame(stream) -> bytes:
    (num_bytes,) = _HEADER.unpack(_read_exactly(stream, _HEADER.size))
    return _read_exactly(stream, num_bytes)


class CompileWorker:
    """One child process; used by one thread at a time (CompileWorkers hands them out)."""

    def __init__(self, tokenizer_info_json: bytes):
        self._tokenizer_info_json = tokenizer_info_json
        self._ready = False
        # Started now, used later: the child imports xgrammar while the parent goes on.
        self.proc = subprocess.Popen([sys.executable, "-m", "widebeam.structured.compile_worker",
                                      str(os.getpid())], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     bufsize=0)  # unbuffered: select() sees every byte not yet read

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _wait_readable(self, timeout_s: float) -> bool:
        readable, _, _ = select.select([self.proc.stdout], [], [], max(timeout_s, 0.0))
        return bool(readable)

    def _ensure_ready(self) -> None:
        if self._ready:
            return
        try:
            _write_frame(self.proc.stdin, self._tokenizer_info_json)
            if not self._wait_readable(WORKER_START_TIMEOUT_S) or _read_frame(self.proc.stdout) != _READY:
                raise EOFError
        except (OSError, ValueError, EOFError, struct.error):  # ValueError: closed by close()
            self.kill()
            raise RuntimeError("the grammar compiler process did not start "
                               f"(exit code {self.proc.returncode})") from None
        self._ready = True

    def compile(self, schema: str, timeout_s: float) -> str:
        """The schema's grammar (`grammar_of`), once it compiled in the child within `timeout_s`. The
        clock starts once the child is ready. Raises CompileRefused (the child may have died on it: then
        it is dead, see `alive`), CompileTimeout (the child is killed), WorkerGone (it was dead already)
        or RuntimeError (it did not start)."""
        self._ensure_ready()
        began = time.monotonic()
        try:
            _write_frame(self.proc.stdin, schema.encode())
        except (OSError, ValueError):  # it died before this schema reached it
            self.kill()
            raise WorkerGone from None
        try:
            if not self._wait_readable(began + timeout_s - time.monotonic()):
                self.kill()
                raise CompileTimeout
            answer = _read_frame(self.proc.stdout)
        except (OSError, ValueError, EOFError, struct.error):
            self.kill()
            raise CompileRefused(f"crashed the grammar compiler (exit code {self.proc.returncode})") from None
        if answer[:1] == _COMPILED:
            return answer[1:].decode()
        raise CompileRefused(answer[1:].decode(errors="replace"))

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """End the child now (SIGKILL: a compile in C++ would not see a gentler signal) and reap it."""
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL is not refused
            pass
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass


class CompileWorkers:
    """`num_workers` child processes, all started at once (made on a server's first schema) and each
    replaced as soon as it is killed or found dead. `compile` is thread-safe; a caller waits for a free
    worker (not counted in its bound)."""

    def __init__(self, tokenizer_info_json: bytes, num_workers: int = 2):
        self._tokenizer_info_json = tokenizer_info_json
        self._lock = threading.Lock()
        self._workers: set[CompileWorker] = set()
        self._closed = False
        self.num_killed = 0  # compiles past their bound: each one's worker killed
        # last in, first out: the worker that compiled last (warm in the caches) goes first
        self._idle: queue.LifoQueue = queue.LifoQueue()
        for _ in range(num_workers):
            self._idle.put(self._start())

    def _start(self) -> CompileWorker | None:
        """A new worker, or None once closed."""
        with self._lock:
            if self._closed:
                return None
            worker = CompileWorker(self._tokenizer_info_json)
            self._workers.add(worker)
            return worker

    def _alive(self, worker: CompileWorker | None) -> CompileWorker:
        """`worker`, or a fresh one in its place when it is dead."""
        if worker is not None and worker.alive:
            return worker
        if worker is not None:
            self._retire(worker)
        fresh = self._start()
        if fresh is None:
            raise RuntimeError("the grammar compiler is shut down")
        return fresh

    def _retire(self, worker: CompileWorker) -> None:
        worker.kill()
        with self._lock:
            self._workers.discard(worker)

    def compile(self, schema: str, timeout_s: float) -> str:
        """See CompileWorker.compile; a worker killed or dead is replaced before this returns."""
        worker = self._idle.get()
        try:
            worker = self._alive(worker)
            try:
                return worker.compile(schema, timeout_s)
            except WorkerGone:  # found dead (not this schema's doing): once more, on a fresh one
                worker = self._alive(worker)
                return worker.compile(schema, timeout_s)
        except CompileTimeout:
            with self._lock:
                self.num_killed += 1
            log.warning("a grammar compile ran past %g s: its worker process (pid %d) was killed",
                        timeout_s, worker.pid)
            raise
        finally:
            if worker is not None and not worker.alive:
                self._retire(worker)
                # started at once, so the next schema finds it ready (its import overlaps the wait)
                worker = self._start()
            self._idle.put(worker)

    def close(self) -> None:
        """Kill every worker (a compile in flight ends with an error)."""
        with self._lock:
            self._closed = True
            workers, self._workers = list(self._workers), set()
        for worker in workers:
            worker.kill()


def _exit_when_orphaned(parent_pid: int) -> None:
    """A watchdog thread: a child whose server died (even by SIGKILL) exits within a second, mid-compile
    too (xgrammar releases the GIL while it compiles)."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            os._exit(0)


def _serve(parent_pid: int) -> None:
    # The protocol owns the real stdout; anything a library prints goes to stderr instead.
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    requests = sys.stdin.buffer
    threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), daemon=True).start()
    import xgrammar

    info = xgrammar.TokenizerInfo.deserialize_json(_read_frame(requests).decode())
    # one thread: the engine's steps need the cores more than a compile does
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    _write_frame(answers, _READY)
    while True:
        try:
            schema = _read_frame(requests).decode()
        except (EOFError, struct.error):
            return
        try:
            grammar = grammar_of(schema)
            compiler.compile_grammar(grammar)
            answer = _COMPILED + grammar.encode()
        except (RuntimeError, ValueError, TypeError) as exc:
            answer = _REFUSED + one_line_reason(exc).encode()
        _write_frame(answers, answer)


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
