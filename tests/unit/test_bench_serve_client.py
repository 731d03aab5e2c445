"""`widebeam bench serve` against a scripted fake OpenAI server (Starlette + uvicorn on loopback, in a
thread): the prompt says what the fake does (sleep, stream chunks at set gaps, answer 429 / 500, cut the
stream, send an error event). Checks TTFT and ITL as measured, rejected (4xx) apart from failed (5xx,
timeout, cut stream), warm-ups sent but left out, the concurrency bound, the open loop, and the CLI's
JSON (vLLM's keys) and a sweep's PNG."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from widebeam.bench_serve.cli import main
from widebeam.bench_serve.metrics import compute_result
from widebeam.bench_serve.records import Outcome, RequestSpec
from widebeam.bench_serve.runner import RunConfig, run_load


class FakeState:
    def __init__(self):
        self.received = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.received_at: list[float] = []


def fake_app(state: FakeState) -> Starlette:
    """Directives in the prompt (or the last message): `status=429`, `sleep=S` before answering,
    `gaps=A,B,..` (one text chunk after each gap), `cut` (the connection drops after the chunks),
    `nodone` (the stream ends cleanly without [DONE]), `error_event` (an error event after the chunks)."""

    async def completions(request: Request):
        body = await request.json()
        prompt = body.get("prompt") or body["messages"][-1]["content"]
        directives = dict(re.findall(r"(\w+)=(\S+)", prompt))
        flags = set(re.findall(r"\b(cut|nodone|error_event)\b", prompt))
        state.received += 1
        state.received_at.append(time.perf_counter())
        if "status" in directives:
            status = int(directives["status"])
            return JSONResponse({"error": {"message": f"scripted {status}", "type": "x", "param": None,
                                           "code": None}}, status_code=status, headers={"Retry-After": "1"})
        gaps = [float(g) for g in directives.get("gaps", "0").split(",")]
        chat = "messages" in body

        def chunk(text: str) -> str:
            choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
            return f"data: {json.dumps({'choices': [choice]})}\n\n"

        async def events():
            state.in_flight += 1
            state.max_in_flight = max(state.max_in_flight, state.in_flight)
            try:
                await asyncio.sleep(float(directives.get("sleep", 0)))
                for i, gap in enumerate(gaps):
                    await asyncio.sleep(gap)
                    yield chunk(f"t{i} ")
                if "cut" in flags:
                    raise RuntimeError("scripted: the connection drops mid-stream")
                if "error_event" in flags:
                    yield f"data: {json.dumps({'error': {'message': 'scripted engine error'}})}\n\n"
                if "nodone" in flags:
                    return
                usage = {"prompt_tokens": 7, "completion_tokens": len(gaps), "total_tokens": 7 + len(gaps)}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                state.in_flight -= 1

        return StreamingResponse(events(), media_type="text/event-stream")

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                             Route("/v1/chat/completions", completions, methods=["POST"]),
                             Route("/v1/models", models)])


@pytest.fixture()
def fake():
    """(base URL, state) of a fresh fake server on a free loopback port."""
    state = FakeState()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    config = uvicorn.Config(fake_app(state), host="127.0.0.1", port=port, log_level="critical")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the fake server did not start"
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}", state
    server.should_exit = True
    thread.join(timeout=10)


def spec(prompt: str, chat: bool = False) -> RequestSpec:
    body = {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
    return RequestSpec("/v1/chat/completions" if chat else "/v1/completions",
                       {**body, "stream": True, "stream_options": {"include_usage": True}}, "test")


def run(base_url: str, specs, warmups=(), **config):
    config.setdefault("show_progress", False)
    return asyncio.run(run_load(specs, RunConfig(base_url=base_url, **config), warmups))


def test_ttft_and_itl_are_the_scripted_gaps(fake):
    base_url, _ = fake
    for chat in (False, True):
        outcome = run(base_url, [spec("gaps=0.15,0.1,0.2", chat=chat)])
        (record,) = outcome.records
        assert record.outcome is Outcome.COMPLETED, record.error
        assert 0.15 <= record.ttft_s < 0.15 + 0.1
        assert len(record.itls_s) == 2
        assert 0.1 - 0.01 <= record.itls_s[0] < 0.1 + 0.08 and 0.2 - 0.01 <= record.itls_s[1] < 0.2 + 0.08
        assert record.latency_s >= 0.45
        assert record.output_tokens == 3 and record.prompt_tokens == 7  # from usage
        assert record.choice_texts == ["t0 t1 t2 "]
        # TPOT: (e2el - TTFT) / (3 - 1), about 150 ms
        assert 0.15 - 0.01 <= record.tpot_s < 0.15 + 0.06


def test_rejected_and_failed_are_told_apart(fake):
    base_url, _ = fake
    specs = [spec("gaps=0.01"), spec("status=429"), spec("status=400"), spec("status=500"),
             spec("status=503"), spec("sleep=5"), spec("gaps=0.01,0.01 cut"), spec("gaps=0.01 nodone"),
             spec("gaps=0.01 error_event")]
    outcome = run(base_url, specs, timeout_s=0.6)
    result = compute_result(outcome.records, outcome.duration_s)
    assert result["completed"] == 1
    assert result["rejected"] == 2 and result["rejected_by_status"] == {"400": 1, "429": 1}
    assert result["failed"] == 6
    assert result["failed_by_reason"] == {"500": 1, "503": 1, "timeout": 1, "stream_cut": 2,
                                          "stream_error": 1}
    assert outcome.duration_s < 3, "the timed-out request was not cut at its timeout"
    assert any("scripted 429" in e for e in result["errors"])
    assert result["rejected_429_without_retry_after"] == 0  # the fake sends Retry-After


def test_warmups_are_sent_first_and_left_out(fake):
    base_url, state = fake
    outcome = run(base_url, [spec("gaps=0.01")] * 3, warmups=[spec("gaps=0.3")] * 2)
    assert state.received == 5
    assert len(outcome.records) == 3 and outcome.num_warmups == 2
    assert all(r.latency_s < 0.25 for r in outcome.records), "a warm-up's time was counted"
    assert outcome.duration_s < 0.25, "the clock started before the warm-ups were answered"


def test_max_concurrency_bounds_requests_in_flight(fake):
    base_url, state = fake
    outcome = run(base_url, [spec("gaps=0.1")] * 6, max_concurrency=2)
    assert state.max_in_flight == 2
    assert all(r.outcome is Outcome.COMPLETED for r in outcome.records)
    assert outcome.duration_s >= 0.3  # three rounds of two
    # a request's time starts when it is sent, not while it waits for a slot
    assert max(r.latency_s for r in outcome.records) < 0.25


def test_open_loop_sends_on_schedule_whatever_the_answers_take(fake):
    """Ten requests at 20/s (seed-fixed gaps) each answered after 0.5 s: sent on their schedule, not one
    after another's answer (a closed loop would take 5 s)."""
    base_url, state = fake
    outcome = run(base_url, [spec("sleep=0.5")] * 10, request_rate=20.0, burstiness=1.0, seed=3)
    from widebeam.bench_serve.arrivals import arrival_offsets_s

    expected = arrival_offsets_s(10, 20.0, 1.0, seed=3)
    sent = [t - state.received_at[0] for t in state.received_at]
    assert sent == pytest.approx(list(expected), abs=0.05)
    assert outcome.duration_s < expected[-1] + 0.5 + 0.3
    assert state.max_in_flight >= 3


def test_cli_writes_vllm_keys_and_a_sweep_plot(fake, tmp_path, capsys):
    base_url, state = fake
    data = tmp_path / "bodies.jsonl"
    data.write_text(json.dumps({"prompt": "gaps=0.01,0.01"}) + "\n"
                    + json.dumps({"messages": [{"role": "user", "content": "status=429"}]}) + "\n")
    args = ["--base-url", base_url, "--workload", "jsonl", "--dataset-path", str(data), "--num-prompts", "4",
            "--num-warmups", "1", "--goodput", "e2el:5000", "--metric-percentiles", "50,99", "--disable-tqdm",
            "--save-result", "--result-dir", str(tmp_path)]
    assert main([*args, "--request-rate", "inf", "--result-filename", "one.json"]) == 0
    one = json.loads((tmp_path / "one.json").read_text())
    for key in ("completed", "failed", "request_throughput", "output_throughput", "total_token_throughput",
                "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "p50_e2el_ms", "std_itl_ms", "mean_tpot_ms",
                "request_goodput", "duration", "max_concurrency", "request_rate", "burstiness",
                "beams_per_s", "items_per_s", "invalid_items", "rejected", "rejected_by_status"):
        assert key in one, key
    assert one["request_rate"] == "inf" and one["model_id"] == "fake-model"
    assert (one["completed"], one["rejected"], one["failed"]) == (2, 2, 0)
    assert one["rejected_by_status"] == {"429": 2}
    assert one["request_goodput"] == pytest.approx(2 / one["duration"])
    assert state.received == 5
    assert "Serving Benchmark Result" in capsys.readouterr().out

    assert main([*args, "--request-rate", "50", "inf", "--result-filename", "sweep.json"]) == 0
    sweep = json.loads((tmp_path / "sweep.json").read_text())
    assert [r["request_rate"] for r in sweep["runs"]] == [50.0, "inf"]
    assert (tmp_path / "sweep.png").stat().st_size > 10_000


def test_cli_refuses_bad_flags_in_one_line(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--request-rate", "0"])
    assert info.value.code == 2
    assert capsys.readouterr().err.count("\n") == 1
    assert main(["--workload", "jsonl"]) == 1
