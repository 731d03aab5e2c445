"""One engine replica behind the exact-fit router: the single server's app, called through a handle.

The ingress (server/router_ingress.py) forwards each HTTP request whole (method, path, headers, body);
`forward` runs it through the very app `widebeam serve` runs (api.py: `create_app`) and streams the
response back as it is produced: first its status and headers, then its body chunks. So every route,
error, stream, API-key check and size cap behind the router is the single server's. The replica also
reports its room and its Prometheus text to the router (`record_routing_stats`, polled by Serve), and
hands the ingress a sizer of its own layout (`request_sizer`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

log = logging.getLogger("widebeam.server")


def build_engine_app(model: str, engine_kwargs: dict, app_kwargs: dict, num_threads: int):
    """(engine, app) of one replica: the single server's app (`create_app`) over its own engine, on
    `num_threads` CPU threads where there is no GPU; the start-up heap frozen (a long-lived process)."""
    import torch

    from widebeam.engine import LLMEngine
    from widebeam.heap import freeze_startup_heap
    from widebeam.server.api import create_app
    from widebeam.server.engine_loop import engine_thread

    def build() -> LLMEngine:
        if not torch.cuda.is_available():
            torch.set_num_threads(num_threads)  # the replica's CPU slots, not the whole host
        return LLMEngine(model, **engine_kwargs)

    thread = engine_thread()  # every torch call of the engine on one thread (server/engine_loop.py)
    engine = thread.submit(build).result()
    app = create_app(engine, engine_thread=thread, **app_kwargs)
    freeze_startup_heap()  # widebeam/heap.py
    return engine, app


class EngineReplica:
    def __init__(self, model: str, engine_kwargs: dict, app_kwargs: dict, num_threads: int):
        self.engine, self.app = build_engine_app(model, engine_kwargs, app_kwargs, num_threads)
        self.loop = self.app.state.engine_loop
        self._started = False

    def _start(self) -> None:
        # Nothing serves this app over HTTP, so its lifespan never runs: the engine loop starts on the
        # replica's event loop with the first call.
        if not self._started:
            self._started = True
            self.loop.start()

    async def request_sizer(self):
        """The engine's sizer over a fresh copy of its pools (counts only), for the ingress."""
        return self.engine.sizer.for_router()

    def record_routing_stats(self) -> dict:
        """The room report (routing/ledger.py: `ReplicaReport`) and this replica's Prometheus text, for the
        ingress's /metrics. Serve calls this off the replica's request loop: it reads the loop's latest
        snapshot and the metrics registry, nothing of the engine."""
        return {**self.loop.snapshot["routing"], "metrics_text": self.app.state.metrics.render().decode()}

    async def forward(self, request: dict, need: dict | None = None, routed_id: str | None = None,
                      ) -> AsyncIterator[dict | bytes]:
        """Run one HTTP request through the app: yields {"status", "headers"} and then body chunks.
        `need` and `routed_id` are the router's (server/ray_router.py)."""
        self._start()
        messages: asyncio.Queue = asyncio.Queue()
        sent_body = False
        gone = asyncio.Event()

        async def receive():
            nonlocal sent_body
            if not sent_body:
                sent_body = True
                return {"type": "http.request", "body": request["body"], "more_body": False}
            await gone.wait()  # the app waits here to learn that its client went away
            return {"type": "http.disconnect"}

        async def send(message):
            await messages.put(message)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "scheme": "http",
                 "method": request["method"], "path": request["path"], "raw_path": request["path"].encode(),
                 "query_string": request["query_string"], "root_path": "",
                 "headers": [(bytes(k), bytes(v)) for k, v in request["headers"]],
                 "client": request.get("client"), "server": request.get("server")}
        task = asyncio.create_task(self.app(scope, receive, send))
        task.add_done_callback(lambda _: messages.put_nowait(None))
        try:
            while True:
                message = await messages.get()
                if message is None:  # the app returned (or raised: its error went out as a 500)
                    break
                if message["type"] == "http.response.start":
                    yield {"status": message["status"], "headers": list(message.get("headers", []))}
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield bytes(message["body"])
                    if not message.get("more_body", False):
                        break
        finally:  # the caller stopped reading (its client left): the app aborts the request
            gone.set()
            if not task.done():
                try:
                    await asyncio.wait_for(asyncio.shield(task), 2.0)
                except Exception:  # noqa: BLE001  (a timeout or its own error: cut it short either way)
                    task.cancel()
