"""The exact-fit router's front door: a light ingress that sizes each request and hands it to the
engine replica with room for it.

For /v1/completions and /v1/chat/completions the ingress reads the call as the replica's handler does
(protocol.py: the params of each choice, the prompts, chat templates applied) and sizes every engine
request with the replica's own sizer (request_sizer.py, over a copy of its pools: the same exact bounds the
engine admits with). A call no replica could ever hold gets the engine's 400 word for word, here;
one that fits no replica now waits at the router (ray_router.py), at most `max_waiting_requests` of
them, past which a 429 with `Retry-After` as a single server gives. Everything else (other routes,
calls it cannot size: a catalogue lives on the replicas, a body the replica will refuse) goes to a
replica unsized and gets the replica's answer. Responses stream back as the replica produces them.
A replica that dies under a request: its caller gets a 503 (or, mid-stream, an error event).
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from widebeam.errors import InvalidParameterError, QueueFullError, RequestTooLargeError
from widebeam.routing.ledger import shared_ledger
from widebeam.sched.queue_bound import WaitingQueueBound
from widebeam.server import protocol as p
from widebeam.server import schemas as s
from widebeam.server.api import GuardMiddleware
from widebeam.server.metrics import CONTENT_TYPE
from widebeam.server.metrics_merge import merge_replica_metrics

log = logging.getLogger("widebeam.server")

GENERATION_ROUTES = {"/v1/completions": (s.CompletionRequest, False),
                     "/v1/chat/completions": (s.ChatCompletionRequest, True)}
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]


class RouterIngress:
    def __init__(self, engine_handle, engine_deployment: str, app_kwargs: dict, max_waiting_requests: int):
        self.handle = engine_handle
        self.ledger = shared_ledger(engine_deployment)
        self.bound = WaitingQueueBound(max_waiting_requests)  # its Retry-After arithmetic and count
        self.model_names = {app_kwargs["model_name"], *app_kwargs.get("model_aliases", ())}
        self._sizer = None
        self.num_refused_at_door = 0
        self.router_app = self._build_app(app_kwargs)

    def __serve_build_asgi_app__(self):
        return self.router_app

    async def sizer(self):
        if self._sizer is None:  # any replica's: they share one configuration
            self._sizer = await self.handle.request_sizer.remote()
            # a replica that has not reported yet is counted with these pools (routing/ledger.py)
            self.ledger.default_capacity_blocks = {name: m.capacity_blocks()
                                                   for name, m in self._sizer.cache.managers.items()}
        return self._sizer

    # -- sizing ------------------------------------------------------------------------------------
    async def need_of(self, path: str, body: bytes) -> dict | None:
        """Blocks per pool the call's engine requests can ever reserve together, None when the ingress
        cannot size it (the replica decides); raises the API's 400 (`ApiError`, the engine's message) when
        it can never fit."""
        schema, chat = GENERATION_ROUTES[path]
        try:
            req = schema.model_validate_json(body)
        except ValidationError:
            return None  # the replica answers the same 400 it always does
        if req.model is not None and req.model not in self.model_names:
            return None  # the replica's 404
        sizer = await self.sizer()
        try:
            plan = p.plan_request(req)
            prompts = p.chat_prompts(sizer.prompt_rules.tokenizer, req) if chat else p.completion_prompts(req)
            need: dict[str, int] = {}
            for prompt in prompts:
                for params in plan.params:
                    for pool, blocks in sizer.size("routed", prompt, params).required_blocks.items():
                        need[pool] = need.get(pool, 0) + blocks
            return self.ledger.clip_to_capacity(need)
        except RequestTooLargeError as exc:
            raise p.engine_error(exc, width_field=plan.width_field,
                                 prompt_field="messages" if chat else "prompt",
                                 max_tokens_name=p.max_tokens_field(req)[0]) from None
        except (InvalidParameterError, s.ApiError, ValueError):
            return None

    # -- the app -----------------------------------------------------------------------------------
    def _build_app(self, app_kwargs: dict) -> FastAPI:
        app = FastAPI(title="widebeam router", docs_url=None, redoc_url=None, openapi_url=None)
        app.add_middleware(GuardMiddleware, api_key=app_kwargs.get("api_key"),
                           max_request_bytes=app_kwargs["max_request_bytes"])

        @app.get("/metrics")
        async def metrics():  # each replica's text as of its last report (at most ROUTING_STATS_PERIOD_S old)
            with self.ledger.lock:
                by_replica = {r: report.metrics_text for r, report in self.ledger.reports.items()}
            return Response(merge_replica_metrics(by_replica, self.router_metrics()), media_type=CONTENT_TYPE)

        @app.api_route("/{path:path}", methods=METHODS)
        async def forward(request: Request):
            body = await request.body()
            need = None
            if request.method == "POST" and request.url.path in GENERATION_ROUTES:
                try:
                    need = await self.need_of(request.url.path, body)
                except s.ApiError as exc:  # never fits any replica: refused at the door
                    self.num_refused_at_door += 1
                    return JSONResponse(exc.body(), status_code=exc.status_code, headers=exc.headers)
            return await self.forward(request, body, need)

        return app

    def router_metrics(self) -> dict[str, float]:
        return {"widebeam_router_held_requests": self.ledger.num_held,
                "widebeam_router_placed_requests": len(self.ledger.placements),
                "widebeam_router_refused_never_fit_total": self.num_refused_at_door,
                "widebeam_router_queue_full_total": self.bound.num_refused}

    async def forward(self, request: Request, body: bytes, need: dict | None):
        await self.sizer()  # the pools of replicas that have not reported yet
        routed_id = uuid.uuid4().hex
        try:  # the router's bounded wait: past it a 429, as a single server's queue gives
            self.bound.check(list(self.ledger.held), {})
        except QueueFullError as exc:
            message = str(exc).replace("the waiting queue", "the router's waiting queue")
            return JSONResponse(s.error_body(message,
                                             "rate_limit_error", exc.setting, "queue_full"),
                                status_code=429, headers={"Retry-After": str(exc.retry_after_s)})
        raw = {"method": request.method, "path": request.url.path, "query_string": request.url.query.encode(),
               "headers": list(request.headers.raw), "body": body,
               "client": tuple(request.client) if request.client else None}
        self.ledger.hold(routed_id)
        stream = self.handle.options(stream=True).forward.remote(raw, need=need, routed_id=routed_id)

        def done():
            stream.cancel()
            self.ledger.unhold(routed_id)
            if self.ledger.release(routed_id) is not None:
                self.bound.record_finish()

        try:
            head = await stream.__anext__()
        except asyncio.CancelledError:  # the client left while the call waited for room
            done()
            raise
        except Exception as exc:  # noqa: BLE001  (Ray raises several kinds for a dead replica)
            done()
            log.warning("a replica failed before answering: %s", exc)
            return JSONResponse(s.error_body(f"the replica serving this request failed: {type(exc).__name__}",
                                             "server_error", None, "replica_failed"), status_code=503)
        headers = [(k, v) for k, v in head["headers"]]
        event_stream = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                           for k, v in headers)

        async def chunks():
            try:
                async for chunk in stream:
                    yield chunk
            except Exception as exc:  # noqa: BLE001  (as above)
                log.warning("a replica failed mid-answer: %s", exc)
                if event_stream:
                    error = s.error_body(f"the replica serving this request failed: {type(exc).__name__}",
                                         "server_error", None, "replica_failed")
                    yield f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
            finally:
                done()

        response = StreamingResponse(chunks(), status_code=head["status"])
        response.raw_headers = headers
        return response
