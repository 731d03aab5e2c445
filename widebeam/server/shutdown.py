"""Graceful shutdown for `widebeam serve`: uvicorn's server with the engine loop drained first.

On SIGTERM or SIGINT uvicorn alone would close the listening socket, give the open connections a
fixed grace, cancel what is still running (a plain-text 500, streams cut without an error event or
`[DONE]`, CancelledError tracebacks), and then raise the signal again, so the process dies by it.
Here the first signal starts a drain while the socket still accepts: new calls get a 503 error
object, the calls in flight get up to `shutdown_timeout_s` to finish, the rest are failed with a 503
(a stream: an error event, then `[DONE]`). Only then does uvicorn close the connections, whose
responses are all complete by then, and the app's lifespan stops the engine loop. The signal is not
raised again: a drained shutdown exits with status 0. A second signal cuts the wait short.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading

import uvicorn

from widebeam.server.engine_loop import EngineLoop

log = logging.getLogger("widebeam.server")

SHUTDOWN_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# What uvicorn still waits for the connections after the drain (their responses are complete by then).
CONNECTIONS_CLOSE_TIMEOUT_S = 5.0


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, engine_loop: EngineLoop, shutdown_timeout_s: float):
        super().__init__(config)
        self.engine_loop = engine_loop
        self.shutdown_timeout_s = shutdown_timeout_s
        self.signals_received: list[int] = []

    @contextlib.contextmanager
    def capture_signals(self):
        """Install `handle_exit` for SIGINT and SIGTERM while serving; restore the previous handlers
        after, without raising the signal again (uvicorn does, which would end the process by it)."""
        if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in SHUTDOWN_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame) -> None:
        """A signal handler: it only sets flags, which the event loop reads on its next tick."""
        self.signals_received.append(sig)
        if self.should_exit:
            self.engine_loop.abort_now()
        self.should_exit = True

    async def shutdown(self, sockets=None) -> None:
        if self.signals_received:
            log.warning("received %s", signal.Signals(self.signals_received[0]).name)
        await self.engine_loop.drain(self.shutdown_timeout_s)  # the socket still answers (with 503) meanwhile
        await super().shutdown(sockets=sockets)
