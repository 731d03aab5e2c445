"""One request over HTTP (httpx, async) and what came of it: a `RequestRecord`.

Timings start when the request is sent (after any wait for `--max-concurrency`, as vLLM times them).
A streamed answer (server-sent events, OpenAI's chunks) gives the time to the first chunk carrying text
(TTFT) and the gaps between such chunks (ITL); a whole answer gives its latency only.

Outcomes: HTTP 4xx is `rejected` (the server refused it at admission and said so: a 429 under overload,
a 400 for a request that never fits); `failed` is everything where an answer was lost: 5xx, the
per-request timeout, a connection error, a stream that ended without `data: [DONE]` or carried an error
event.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from widebeam.bench_serve.records import Outcome, RequestRecord, RequestSpec

MAX_ERROR_CHARS = 300


async def send_request(client: httpx.AsyncClient, spec: RequestSpec, timeout_s: float) -> RequestRecord:
    """Send `spec` with `client` (its base URL and headers set) and record it; never raises (but for
    cancellation)."""
    record = RequestRecord(spec=spec)
    start = time.perf_counter()
    try:
        async with asyncio.timeout(timeout_s):
            if spec.body.get("stream"):
                await _streamed(client, spec, record, start)
            else:
                await _whole(client, spec, record)
    except TimeoutError:
        _fail(record, "timeout", f"no complete answer within {timeout_s:g} s")
    except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
        # the server closed the connection mid-answer
        _fail(record, "stream_cut", f"{type(exc).__name__}: {exc}")
    except httpx.TimeoutException as exc:
        _fail(record, "timeout", f"{type(exc).__name__}: {exc}")
    except httpx.HTTPError as exc:
        _fail(record, "connection", f"{type(exc).__name__}: {exc}")
    except ValueError as exc:  # a body or an event that is not the JSON it should be
        _fail(record, "bad_response", f"{type(exc).__name__}: {exc}")
    record.latency_s = time.perf_counter() - start
    return record


def _fail(record: RequestRecord, reason: str, error: str) -> None:
    record.outcome, record.reason, record.error = Outcome.FAILED, reason, error[:MAX_ERROR_CHARS]


def _http_error(record: RequestRecord, status: int, text: str, headers: httpx.Headers) -> None:
    record.http_status, record.retry_after = status, headers.get("retry-after")
    try:
        message = json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = text
    record.outcome = Outcome.REJECTED if 400 <= status < 500 else Outcome.FAILED
    record.reason, record.error = str(status), f"HTTP {status}: {message}"[:MAX_ERROR_CHARS]


def _choice_text(choice: dict) -> str:
    if "delta" in choice:
        return choice["delta"].get("content") or ""
    if "message" in choice:
        return (choice["message"] or {}).get("content") or ""
    return choice.get("text") or ""


def _read_usage(record: RequestRecord, usage: dict | None) -> None:
    if usage:
        record.prompt_tokens = usage.get("prompt_tokens")
        record.output_tokens = int(usage.get("completion_tokens") or 0)


async def _whole(client: httpx.AsyncClient, spec: RequestSpec, record: RequestRecord) -> None:
    response = await client.post(spec.endpoint, json=spec.body)
    record.http_status = response.status_code
    if response.status_code != 200:
        _http_error(record, response.status_code, response.text, response.headers)
        return
    body = response.json()
    texts = [_choice_text(c) for c in body.get("choices", ())]
    record.choice_texts, record.num_choices = texts, len(texts)
    record.num_text_chunks = 1 if any(texts) else 0
    _read_usage(record, body.get("usage"))
    record.outcome = Outcome.COMPLETED


async def _streamed(client: httpx.AsyncClient, spec: RequestSpec, record: RequestRecord,
                    start: float) -> None:
    texts: dict[int, str] = {}
    last_text_at = None
    async with client.stream("POST", spec.endpoint, json=spec.body) as response:
        record.http_status = response.status_code
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")
            _http_error(record, response.status_code, text, response.headers)
            return
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:  # the server failed this request after its 200 began
                _fail(record, "stream_error", f"error event: {event['error'].get('message', event['error'])}")
                return
            now = time.perf_counter()
            carried = False
            for choice in event.get("choices") or ():
                text = _choice_text(choice)
                texts[choice.get("index", 0)] = texts.get(choice.get("index", 0), "") + text
                carried = carried or bool(text)
            if carried:
                if last_text_at is None:
                    record.ttft_s = now - start
                else:
                    record.itls_s.append(now - last_text_at)
                last_text_at = now
                record.num_text_chunks += 1
            _read_usage(record, event.get("usage"))
        else:  # the body ended without [DONE]: the answer was cut
            _fail(record, "stream_cut", "the stream ended without data: [DONE]")
            return
    record.choice_texts = [texts[i] for i in sorted(texts)]
    record.num_choices = len(texts)
    if not record.output_tokens:  # no usage: each chunk carrying text counts as one token
        record.output_tokens = record.num_text_chunks
    record.outcome = Outcome.COMPLETED
