"""The server drives the engine through its public API only (`add_request`, `step`, `abort`,
`has_unfinished`, `stats`, `tokenizer`, `max_seq_len`): a scripted engine with nothing else serves
completions, streamed ones forward each step's `new_text` as it is, and time to first token is counted
on the step that says `first_token`, not on a prefill-only step."""

from __future__ import annotations

import json
import re

import pytest
from fastapi.testclient import TestClient

from widebeam.outputs import CompletionOutput, RequestDelta, RequestOutput
from widebeam.params import BeamSearchParams

PIECES = ["Hel", "lo", ", w\u00f6r", "", "ld \U0001f389"]  # one step may add no text (held back)
PROMPT_IDS = [7, 8, 9]


class ScriptedEngine:
    """Each request: one prefill-only step, then one step per piece (a sampled request) or three steps
    (a beam request, two beams at the end). Only the public API exists: no `poll`, no `last_schedule`."""

    tokenizer = None
    max_seq_len = 64

    def __init__(self):
        self._requests: dict[str, dict] = {}
        self.steps = 0

    def add_request(self, request_id, prompt, params):
        self._requests[request_id] = {"params": params, "step": 0, "prompt": prompt}
        return list(PROMPT_IDS)

    def abort(self, request_id):
        self._requests.pop(request_id, None)

    def has_unfinished(self):
        return bool(self._requests)

    def stats(self):
        return {"pools": {"self": {"total_blocks": 8, "free_blocks": 8}}, "running": len(self._requests),
                "waiting": 0, "rejected": 0}

    def step(self):
        self.steps += 1
        deltas = []
        for request_id, state in list(self._requests.items()):
            state["step"] += 1
            n = state["step"] - 1  # generated tokens after this step
            delta = RequestDelta(request_id, first_token=n == 1, num_generated_tokens=n)
            beam = isinstance(state["params"], BeamSearchParams)
            if n and not beam:
                delta.new_token_ids, delta.new_text = [100 + n], PIECES[n - 1]
            last = 3 if beam else len(PIECES)
            if n == last:
                if beam:
                    outputs = [CompletionOutput(i, f"beam {i}", [1, 2, 3], -1.0 - i, "length", -0.5 - i)
                               for i in range(2)]
                else:
                    outputs = [CompletionOutput(0, "".join(PIECES), [101 + i for i in range(last)], -2.0,
                                                "length")]
                delta.finished = True
                delta.output = RequestOutput(request_id, state["prompt"], list(PROMPT_IDS), outputs, True)
                del self._requests[request_id]
            deltas.append(delta)
        return deltas


@pytest.fixture()
def client():
    from widebeam.server.api import create_app

    engine = ScriptedEngine()
    with TestClient(create_app(engine, model_name="scripted")) as test_client:
        test_client.engine = engine
        yield test_client


def metric(client, name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", client.get("/metrics").text, re.MULTILINE)
    return float(match.group(1))


def test_streamed_text_is_the_engines_deltas(client):
    events = []
    with client.stream("POST", "/v1/completions",
                       json={"prompt": "hi", "max_tokens": 8, "stream": True,
                             "stream_options": {"include_usage": True}}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: "):]))
    texts = [e["choices"][0]["text"] for e in events if e["choices"]]
    assert texts == [piece for piece in PIECES if piece] + [""]  # each delta as sent, then the closing chunk
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "length"
    assert events[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8,
                                   "prompt_tokens_details": {"cached_tokens": 0}}
    assert metric(client, "widebeam_time_to_first_token_seconds_count") == 1
    assert metric(client, "widebeam_prompt_tokens_total") == 3


def test_whole_and_beam_responses_and_first_token_metric(client):
    whole = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 8, "n": 2, "seed": 1}).json()
    assert [c["text"] for c in whole["choices"]] == ["".join(PIECES)] * 2
    assert whole["usage"] == {"prompt_tokens": 3, "completion_tokens": 10, "total_tokens": 13,
                              "prompt_tokens_details": {"cached_tokens": 0}}
    beams = client.post("/v1/completions",
                        json={"prompt": "hi", "max_tokens": 8, "n": 2, "use_beam_search": True,
                              "beam_width": 2}).json()
    assert [(c["text"], c["beam_score"]) for c in beams["choices"]] == [("beam 0", -0.5), ("beam 1", -1.5)]
    # one observation per engine request (two samples, one beam search), none for the prefill steps
    assert metric(client, "widebeam_time_to_first_token_seconds_count") == 3
    assert metric(client, "widebeam_prompt_tokens_total") == 9
    assert not client.engine.has_unfinished()
