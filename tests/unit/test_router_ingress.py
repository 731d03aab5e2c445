"""The exact-fit router's ingress (server/router_ingress.py) against a scripted engine deployment: no Ray.
A never-fit call gets the engine's 400 at the door and never reaches a replica; a call's need is the sum
of its engine requests' exact blocks; past `max_waiting_requests` held calls a 429 with Retry-After; a
replica that fails before or during its answer gives a 503 or an error event and leaves nothing held;
the API key is checked at the door and reaches the replica."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from widebeam.engine import LLMEngine
from widebeam.errors import RequestTooLargeError
from widebeam.params import BeamSearchParams, SamplingParams
from widebeam.server.router_ingress import RouterIngress

PROMPT_IDS = [3, 4, 5, 6, 7, 8]
JSON_HEAD = {"status": 200, "headers": [(b"content-type", b"application/json")]}
SSE_HEAD = {"status": 200, "headers": [(b"content-type", b"text/event-stream")]}


class Call:
    """A scripted `handle.method.remote(...)`: awaitable (a value) or an async iterator (a stream)."""

    def __init__(self, value=None, items=(), fail_at: int | None = None, gate: asyncio.Event | None = None):
        self.value, self.items, self.fail_at, self.gate = value, list(items), fail_at, gate
        self.cancelled = False

    def __await__(self):
        async def value():
            return self.value
        return value().__await__()

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.gate is not None:
            await self.gate.wait()
        if self.fail_at == 0:
            raise RuntimeError("ActorDiedError: the replica died")
        if not self.items:
            raise StopAsyncIteration
        self.fail_at = None if self.fail_at is None else self.fail_at - 1
        return self.items.pop(0)

    def cancel(self):
        self.cancelled = True


class ScriptedEngines:
    """The engine deployment's handle: `forward` is placed on replica "r0" at once (as the router does when
    it has room) unless `hold` is set, answering `items` (failing at `fail_at`)."""

    def __init__(self, ingress_ledger_getter, sizer):
        self.ledger_of = ingress_ledger_getter
        self.sizer = sizer
        self.calls: list[dict] = []
        self.items = [JSON_HEAD, b'{"ok": true}']
        self.fail_at: int | None = None
        self.hold: asyncio.Event | None = None
        outer = self

        class Method:
            def __init__(self, name):
                self.name = name

            def remote(self, *args, **kwargs):
                return outer.call(self.name, *args, **kwargs)

        self.request_sizer = Method("request_sizer")
        self.forward = Method("forward")

    def options(self, **_):
        return self

    def call(self, name, *args, **kwargs):
        if name == "request_sizer":
            return Call(self.sizer)
        raw, need, routed_id = args[0], kwargs["need"], kwargs["routed_id"]
        self.calls.append({"raw": raw, "need": need})
        if self.hold is None:
            self.ledger_of().place(routed_id, "r0", need, held_id=routed_id)
        return Call(items=list(self.items), fail_at=self.fail_at, gate=self.hold)


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return LLMEngine(str(tiny_llama_dir), dtype="float32", device="cpu", tokens_per_block=4,
                     kv_cache_memory="1MiB", max_beam_width=64)


def make_ingress(engine, deployment: str, **app_kwargs):
    holder = {}
    engines = ScriptedEngines(lambda: holder["ingress"].ledger, engine.sizer.for_router())
    app = {"model_name": "tiny", "max_request_bytes": 2**20, **app_kwargs}
    ingress = RouterIngress(engines, deployment, app, max_waiting_requests=1)
    holder["ingress"] = ingress
    return ingress, engines


def client(ingress) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=ingress.router_app), base_url="http://ingress")


def beam_body(width: int, max_tokens: int, **extra) -> dict:
    return {"prompt": PROMPT_IDS, "max_tokens": max_tokens, "use_beam_search": True, "beam_width": width,
            "n": width, **extra}


def test_a_never_fit_call_is_refused_at_the_door_with_the_engines_words(engine):
    ingress, engines = make_ingress(engine, "never-fit")
    huge = engine.max_seq_len - len(PROMPT_IDS) - 1

    async def run():
        async with client(ingress) as c:
            return await c.post("/v1/completions", json=beam_body(64, huge))
    answer = asyncio.run(run())
    with pytest.raises(RequestTooLargeError) as refused:
        engine.add_request("r", PROMPT_IDS, BeamSearchParams(beam_width=64, max_new_tokens=huge))
    assert answer.status_code == 400 and answer.json()["error"]["message"] == str(refused.value)
    assert answer.json()["error"]["code"] == "kv_cache_capacity_exceeded"
    assert engines.calls == [] and ingress.num_refused_at_door == 1


def test_a_calls_need_is_its_engine_requests_exact_blocks_summed(engine):
    ingress, engines = make_ingress(engine, "need")
    body = {"prompt": [PROMPT_IDS, PROMPT_IDS + [9, 10, 11, 12, 13]], "max_tokens": 5, "n": 2,
            "temperature": 1.0, "seed": 1}

    async def run():
        async with client(ingress) as c:
            return await c.post("/v1/completions", json=body)
    assert asyncio.run(run()).json() == {"ok": True}
    need: dict[str, int] = {}
    for prompt in body["prompt"]:
        for k in range(2):  # n=2 sampled choices: two engine requests per prompt
            engine.add_request(f"n{k}", prompt, SamplingParams(max_new_tokens=5))
            for pool, blocks in engine._requests[f"n{k}"].admission.required_blocks.items():
                need[pool] = need.get(pool, 0) + blocks
            engine.abort(f"n{k}")
    assert engines.calls[0]["need"] == need
    assert ingress.ledger.placements == {} and ingress.ledger.num_held == 0  # released when answered


def test_past_the_bound_a_429_with_retry_after_and_the_held_call_completes(engine):
    ingress, engines = make_ingress(engine, "bound")
    engines.hold = asyncio.Event()

    async def run():
        async with client(ingress) as c:
            first = asyncio.create_task(c.post("/v1/completions", json=beam_body(4, 3)))
            while ingress.ledger.num_held == 0:
                await asyncio.sleep(0.01)
            try:  # past the bound: answered at once, never held
                second = await asyncio.wait_for(c.post("/v1/completions", json=beam_body(4, 3)), 10)
            finally:
                engines.hold.set()
            return await first, second
    first, second = asyncio.run(run())
    assert second.status_code == 429 and int(second.headers["retry-after"]) >= 1
    error = second.json()["error"]
    assert error["code"] == "queue_full" and "router's waiting queue" in error["message"]
    assert first.status_code == 200 and ingress.ledger.num_held == 0 and len(engines.calls) == 1


@pytest.mark.parametrize("fail_at", [0, 1])
def test_a_replica_that_fails_answers_an_error_and_holds_nothing(engine, fail_at):
    ingress, engines = make_ingress(engine, f"fail{fail_at}")
    engines.items = [SSE_HEAD, b"data: {}\n\n", b"data: [DONE]\n\n"]
    engines.fail_at = fail_at

    async def run():
        async with client(ingress) as c:
            return await c.post("/v1/completions", json=beam_body(4, 3, stream=True))
    answer = asyncio.run(run())
    if fail_at == 0:  # before any answer: a 503
        assert answer.status_code == 503 and answer.json()["error"]["code"] == "replica_failed"
    else:  # mid-stream: an error event, then [DONE]
        events = [line[6:] for line in answer.text.splitlines() if line.startswith("data: ")]
        assert json.loads(events[-2])["error"]["code"] == "replica_failed" and events[-1] == "[DONE]"
    assert ingress.ledger.placements == {} and ingress.ledger.num_held == 0


def test_the_api_key_is_checked_at_the_door_and_reaches_the_replica(engine):
    ingress, engines = make_ingress(engine, "key", api_key="secret")

    async def run():
        async with client(ingress) as c:
            key = {"Authorization": "Bearer secret"}
            return (await c.post("/v1/completions", json=beam_body(4, 3)),
                    await c.post("/v1/completions", json=beam_body(4, 3), headers=key))
    refused, allowed = asyncio.run(run())
    assert refused.status_code == 401 and allowed.status_code == 200 and len(engines.calls) == 1
    assert (b"authorization", b"Bearer secret") in engines.calls[0]["raw"]["headers"]
