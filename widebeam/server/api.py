"""The OpenAI-compatible HTTP server: routes and the guard middleware (API key, body size).

Handlers never touch the engine: they talk to the `EngineLoop` (engine_loop.py), which owns it.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hmac
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from widebeam.errors import InvalidParameterError
from widebeam.logprobs import TokenText
from widebeam.outputs import RequestOutput
from widebeam.server import protocol as p
from widebeam.server import schemas as s
from widebeam.server.engine_loop import EngineLoop, Group
from widebeam.server.metrics import CONTENT_TYPE, ServerMetrics
from widebeam.server.render import ChoiceRenderer
from widebeam.server.score import add_score_route
from widebeam.server.ui_routes import add_ui_routes, is_ui_path

log = logging.getLogger("widebeam.server")

DEFAULT_MAX_REQUEST_BYTES = 2**20
DISCONNECT_POLL_S = 0.2  # how often a waiting non-streaming handler checks that its client is still there


# -- the guard: API key and body size, before anything else reads the request ---------------------
class GuardMiddleware:
    def __init__(self, app, api_key: str | None, max_request_bytes: int):
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_request_bytes = max_request_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])  # a repeated header keeps its last value here
        num_authorization = sum(1 for name, _ in scope["headers"] if name == b"authorization")
        if num_authorization > 1:
            # A proxy checking the first and this server the last would disagree on who is calling:
            # ambiguous credentials are refused on every path, with or without an API key.
            return await _send_error(send, 400, f"{num_authorization} Authorization headers: send exactly "
                                     "one ('Authorization: Bearer <key>')",
                                     code="duplicate_authorization_header")
        presented = _presented_key(headers.get(b"authorization", b""))
        if self.api_key and scope["path"] != "/health" and not hmac.compare_digest(presented, self.api_key):
            # A browser opening the web page is asked for the key (HTTP Basic, the key as password)
            # and then sends it with the page's own calls; API clients send Bearer.
            challenge = b'Basic realm="widebeam"' if is_ui_path(scope["path"]) else b"Bearer"
            return await _send_error(send, 401,
                                     "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                     code="invalid_api_key",
                                     extra_headers=[(b"www-authenticate", challenge)])
        too_large = (f"request body exceeds the server's limit of {self.max_request_bytes} bytes "
                     "(widebeam serve --max-request-bytes)")
        length = headers.get(b"content-length")
        if length is not None:
            if not length.isdigit():
                return await _send_error(send, 400, "invalid Content-Length header")
            if int(length) > self.max_request_bytes:
                return await _send_error(send, 413, too_large, code="request_too_large")
        # Read the whole body now (chunked bodies carry no length), then replay it.
        chunks, size, last = [], 0, None
        while True:
            message = await receive()
            if message["type"] != "http.request":
                last = message
                break
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_request_bytes:
                return await _send_error(send, 413, too_large, code="request_too_large")
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]
        if last is not None:
            replay.append(last)

        async def replay_receive():
            return replay.pop(0) if replay else await receive()

        return await self.app(scope, replay_receive, send)


def _presented_key(authorization: bytes) -> bytes:
    """The key in an Authorization header: `Bearer KEY`, or `Basic base64(user:KEY)` (any user: what a
    browser sends for the web page); empty when there is none."""
    scheme, _, token = authorization.partition(b" ")
    if scheme.lower() == b"bearer":
        return token.strip()
    if scheme.lower() == b"basic":
        try:
            return base64.b64decode(token.strip(), validate=True).partition(b":")[2]
        except (binascii.Error, ValueError):
            return b""
    return b""


async def _send_error(send, status: int, message: str, code: str | None = None, extra_headers=()):
    error_type = "invalid_request_error" if status < 500 else "server_error"
    body = json.dumps(s.error_body(message, error_type, None, code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *extra_headers]})
    await send({"type": "http.response.body", "body": body})


def _error_response(error: s.ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status_code, headers=error.headers)


def _validation_message(errors) -> tuple[str, str | None]:
    parts, param = [], None
    for error in errors:
        loc = [str(x) for x in error.get("loc", ()) if x != "body"]
        if error.get("type") == "json_invalid":
            detail = (error.get("ctx") or {}).get("error", "")
            parts.append(f"request body is not valid JSON ({detail} at position {loc[0] if loc else '?'})")
            continue
        if param is None and loc:
            param = loc[0]
        parts.append(f"{'.'.join(loc) or 'body'}: {error.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request", param


# -- the app ---------------------------------------------------------------------------------------
_ERROR_RESPONSES = {status: {"model": s.ErrorResponse, "description": text} for status, text in (
    (400, "invalid request, or one that can never fit the KV cache (code kv_cache_capacity_exceeded)"),
    (401, "missing or wrong API key"), (404, "unknown model"), (413, "request body too large"))}


def create_app(engine, *, model_name: str, api_key: str | None = None,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               model_aliases: tuple[str, ...] = (), ui: bool = True,
               plan_model: str | None = None, engine_thread=None) -> FastAPI:
    """`model_aliases`: other names a request's `model` may give for the served model (the `--model`
    it was started with, a path's last part); /v1/models lists `model_name` only. `ui`: serve the web
    page at `/` (server/ui_routes.py; its JSON endpoints are there either way); `plan_model`: the
    served model as `widebeam plan` reads it, offered first by the plan panel. `engine_thread`: the thread
    that built the engine (server/engine_loop.py: `engine_thread`), where every engine call then runs."""
    from widebeam import __version__

    metrics = ServerMetrics(lambda: loop.snapshot)
    loop = EngineLoop(engine, metrics, engine_thread)
    created = s.now()
    token_text = TokenText(getattr(engine, "tokenizer", None))

    @asynccontextmanager
    async def lifespan(app):
        loop.start()
        try:
            yield
        finally:  # after a drain (serve_cli's shutdown) this only stops the loop; else it fails what is left
            await loop.close()

    app = FastAPI(title="widebeam", version=__version__, lifespan=lifespan,
                  description="OpenAI-compatible server with beam search at any width.")
    app.state.engine_loop = loop
    app.state.metrics = metrics  # the router's ingress reads each replica's text (router_replica.py)
    app.add_middleware(GuardMiddleware, api_key=api_key, max_request_bytes=max_request_bytes)

    @app.exception_handler(s.ApiError)
    async def _api_error(request, exc: s.ApiError):
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        message, param = _validation_message(exc.errors())
        return _error_response(s.ApiError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        error_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(s.error_body(str(exc.detail), error_type), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request, exc: Exception):
        log.exception("unhandled error")
        return JSONResponse(s.error_body("internal server error", "server_error"), status_code=500)

    add_ui_routes(app, loop, model_name=model_name, plan_model=plan_model, ui=ui)

    @app.get("/health")
    async def health():
        if loop.failure is not None:
            return JSONResponse({"status": "error", "detail": str(loop.failure)}, status_code=503)
        stats = loop.snapshot
        if loop.draining:
            return JSONResponse({"status": "shutting_down", "model": model_name, "running": stats["running"],
                                 "waiting": stats["waiting"], "kv_blocks": stats["pools"]}, status_code=503)
        return {"status": "ok", "model": model_name, "running": stats["running"], "waiting": stats["waiting"],
                "kv_blocks": stats["pools"]}

    @app.get("/metrics", response_class=Response,
             responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text format"}})
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models", response_model=s.ModelList, responses=_ERROR_RESPONSES)
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "widebeam", "max_model_len": engine.max_seq_len}]}

    @app.post("/v1/completions", response_model=s.CompletionResponse, responses=_ERROR_RESPONSES)
    async def completions(body: s.CompletionRequest, request: Request):
        return await _generate(request, body, chat=False)

    @app.post("/v1/chat/completions", response_model=s.ChatCompletionResponse, responses=_ERROR_RESPONSES)
    async def chat_completions(body: s.ChatCompletionRequest, request: Request):
        return await _generate(request, body, chat=True)

    async def _generate(request: Request, req, chat: bool):
        if req.model is not None and req.model != model_name and req.model not in model_aliases:
            raise s.ApiError(404,
                             f"model {req.model!r} is not served here; this server serves {model_name!r}",
                             param="model", code="model_not_found")
        plan = p.plan_request(req)
        p.check_echo(req, plan, engine)
        prompts = p.chat_prompts(engine.tokenizer, req) if chat else p.completion_prompts(req)
        render = ChoiceRenderer(plan, chat, engine.tokenizer, token_text)
        prompt_field = "messages" if chat else "prompt"
        try:
            prompt_texts = ([render.prompt_text(prompt, p.vocab_size(engine)) for prompt in prompts]
                            if plan.echo else [""] * len(prompts))
        except InvalidParameterError as exc:
            raise p.engine_error(exc, prompt_field=prompt_field) from None
        if len(prompts) * plan.requests_per_prompt > p.MAX_ENGINE_REQUESTS_PER_CALL:
            raise s.invalid(prompt_field, f"too many prompts x choices in one call: at most "
                                          f"{p.MAX_ENGINE_REQUESTS_PER_CALL} engine requests")
        entries = [(prompt, params) for prompt in prompts for params in plan.params]
        call_id = s.new_id("chatcmpl" if chat else "cmpl")
        request_ids = [f"{call_id}-{k}" for k in range(len(entries))]
        try:
            group = await loop.submit(request_ids, entries, stream=req.stream)
        except ValueError as exc:
            raise p.engine_error(exc, width_field=plan.width_field, prompt_field=prompt_field,
                                 max_tokens_name=p.max_tokens_field(req)[0]) from None
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(_stream(loop, group, plan, chat, call_id, prompt_texts, include_usage,
                                             render),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        outputs = await _collect(loop, group, request)
        if outputs is None:  # the client went away; its requests are aborted
            return Response(status_code=499)
        choices, prompt_tokens, completion_tokens, cached_tokens = [], 0, 0, 0
        for prompt_index in range(len(prompts)):
            start = prompt_index * plan.requests_per_prompt
            outs = outputs[start:start + plan.requests_per_prompt]
            prompt_tokens += len(outs[0].prompt_token_ids)
            cached_tokens += outs[0].num_cached_tokens
            for j, completion in enumerate(p.choices_of(outs, plan)):
                completion_tokens += len(completion.token_ids)
                choices.append(render.whole(prompt_index * plan.n + j, outs[0], completion,
                                            prompt_texts[prompt_index]))
        body = {"id": call_id, "object": "chat.completion" if chat else "text_completion", "created": s.now(),
                "model": model_name, "choices": choices,
                "usage": s.usage(prompt_tokens, completion_tokens, cached_tokens)}
        trees = render.search_trees(outputs)
        if trees is not None:
            body["search_trees"] = trees
        prompt_logprobs = render.chat_prompt_logprobs(outputs)
        if prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs
        return JSONResponse(body)

    def _stream(loop: EngineLoop, group: Group, plan: p.Plan, chat: bool, call_id: str,
                prompt_texts: list[str], include_usage: bool, render: ChoiceRenderer) -> AsyncIterator[str]:
        """Server-sent events: each step's new text of a sampled choice as it comes (the engine's deltas,
        already held back against stop strings), then a closing chunk per request with its finish reason;
        beam choices arrive whole in their closing chunks (their beams are reordered until the end)."""
        object_name = "chat.completion.chunk" if chat else "text_completion"
        created = s.now()

        def event(choices, **extra) -> str:
            payload = {"id": call_id, "object": object_name, "created": created, "model": model_name,
                       "choices": choices, **extra}
            return f"data: {json.dumps(payload)}\n\n"

        def choice_index(k: int, j: int = 0) -> int:
            return ((k // plan.requests_per_prompt) * plan.n
                    + (0 if plan.beam else k % plan.requests_per_prompt) + j)

        async def generate():
            complete = False
            remaining = len(group.request_ids)
            prompt_tokens = completion_tokens = cached_tokens = 0
            try:
                num_choices = len(prompt_texts) * plan.n
                if chat:
                    yield event([s.chunk_choice(True, i, "", None, first=True) for i in range(num_choices)])
                elif plan.echo and not plan.beam:  # a beam's prompt comes with its whole text
                    yield event([render.echo_chunk(i, prompt_texts[i // plan.n]) for i in range(num_choices)])
                while remaining:
                    k, kind, payload = await group.queue.get()
                    # the error event, then [DONE]; the group's other requests are aborted
                    if kind == "error":
                        yield f"data: {json.dumps(payload.body())}\n\n"
                        break
                    if kind == "text":
                        text, token_ids, entries = payload
                        yield event([render.text_chunk(choice_index(k), text, token_ids, entries)])
                        continue
                    remaining -= 1
                    output: RequestOutput = payload
                    if k % plan.requests_per_prompt == 0:
                        prompt_tokens += len(output.prompt_token_ids)
                        cached_tokens += output.num_cached_tokens
                    completions = output.outputs if plan.beam else output.outputs[:1]
                    chunks = []
                    for j, completion in enumerate(completions):
                        completion_tokens += len(completion.token_ids)
                        # a sample's text and log-probs went out as they came
                        chunks.append(render.closing_chunk(choice_index(k, j), output, completion,
                                                           prompt_texts[k // plan.requests_per_prompt],
                                                           plan.beam))
                    yield event(chunks, **({"search_tree": output.tree} if plan.return_tree else {}))
                else:
                    complete = True
                    if include_usage:
                        yield event([], usage=s.usage(prompt_tokens, completion_tokens, cached_tokens))
                yield "data: [DONE]\n\n"
            except Exception:  # a bug while building a chunk: still a well-formed end (error event, [DONE])
                log.exception("stream %s failed", call_id)
                error = s.ApiError(500, "internal server error while streaming this response",
                                   type="server_error")
                yield f"data: {json.dumps(error.body())}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                if not complete:  # the client went away (the response was cancelled) or an error ended it
                    loop.abort(group.request_ids)

        return generate()

    add_score_route(app, engine, loop, model_name, model_aliases, _collect, _ERROR_RESPONSES)

    def custom_openapi():
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes)
            # Validation errors are answered 400 in the OpenAI error shape, never FastAPI's 422.
            for methods in schema.get("paths", {}).values():
                for operation in methods.values():
                    operation.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = custom_openapi
    return app


async def _collect(loop: EngineLoop, group: Group, request: Request) -> list[RequestOutput] | None:
    """Wait for every final output of the group; None (and its requests aborted) if the client leaves."""
    results: list[RequestOutput | None] = [None] * len(group.request_ids)
    remaining = len(results)
    complete = False
    try:
        while remaining:
            try:
                k, kind, payload = await asyncio.wait_for(group.queue.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                if await request.is_disconnected():
                    return None
                continue
            if kind == "error":
                raise payload
            if kind == "final":
                results[k] = payload
                remaining -= 1
        complete = True
        return results  # type: ignore[return-value]
    finally:
        if not complete:
            loop.abort(group.request_ids)
