"""Every call a served engine gets (its requests, aborts and steps) runs on one thread, the one given to
`create_app` (server/engine_loop.py: `engine_thread`; `widebeam serve` builds the engine there too).
PyTorch's CPU thread pool keeps a team of threads per calling thread, and a second team makes every op
sleep and wake instead of spinning: steps through `asyncio.to_thread` took 1.6-1.8x as long."""

from __future__ import annotations

import threading

from e2e_helpers import ScriptedEngine, ThreadServer

from widebeam.server.api import create_app
from widebeam.server.engine_loop import engine_thread


class ThreadRecordingEngine(ScriptedEngine):
    def __init__(self):
        super().__init__(step_s=0.001)
        self.threads: set[int] = set()

    def add_request(self, *args, **kwargs):
        self.threads.add(threading.get_ident())
        return super().add_request(*args, **kwargs)

    def step(self):
        self.threads.add(threading.get_ident())
        return super().step()


def test_every_engine_call_runs_on_the_engine_thread():
    thread = engine_thread()
    engine = ThreadRecordingEngine()
    owner = thread.submit(threading.get_ident).result()
    app = create_app(engine, model_name="scripted", engine_thread=thread)
    with ThreadServer(app) as server, server.client() as client:
        for index in range(6):  # one call at a time: each adds, then steps to its end
            response = client.post("/v1/completions", json={"prompt": f"p{index}", "max_tokens": 5})
            assert response.status_code == 200, response.text
        streamed = client.post("/v1/completions", json={"prompt": "s", "max_tokens": 5, "stream": True})
        assert streamed.status_code == 200
    assert engine.threads == {owner}
    assert not engine.has_unfinished()
