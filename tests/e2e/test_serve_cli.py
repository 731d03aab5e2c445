"""`widebeam serve` start-up: the warning for a server reachable from other machines without an API
key, and `--shutdown-timeout`. The engine and uvicorn's serving are replaced (nothing binds a port)."""

from __future__ import annotations

import logging

import pytest
from e2e_helpers import ScriptedEngine

from widebeam.server import serve_cli
from widebeam.server.shutdown import DrainingServer

WARNING_TEXT = "reachable from other machines"


@pytest.fixture()
def started(monkeypatch):
    """Run `widebeam serve` up to the point where uvicorn would serve; return what it was given."""
    seen = {}

    def fake_run(self, sockets=None):
        seen["server"] = self
        self.started = True

    monkeypatch.setattr("widebeam.engine.LLMEngine", lambda model, **kwargs: ScriptedEngine())
    monkeypatch.setattr(DrainingServer, "run", fake_run)
    monkeypatch.delenv(serve_cli.API_KEY_ENV, raising=False)
    return seen


@pytest.mark.parametrize("host,args,env_key,warns", [
    ("0.0.0.0", [], None, True),
    ("::", [], None, True),
    ("192.168.1.20", [], None, True),
    ("myhost.example", [], None, True),
    ("0.0.0.0", ["--api-key", "k"], None, False),
    ("0.0.0.0", [], "k", False),
    ("127.0.0.1", [], None, False),
    ("127.0.0.2", [], None, False),
    ("::1", [], None, False),
    ("localhost", [], None, False),
])
def test_non_loopback_host_without_api_key_warns(started, monkeypatch, caplog, host, args, env_key, warns):
    if env_key:
        monkeypatch.setenv(serve_cli.API_KEY_ENV, env_key)
    with caplog.at_level(logging.WARNING, logger="widebeam.server"):
        assert serve_cli.main(["--host", host, "--port", "0", "--log-level", "warning", *args]) == 0
    warnings = [r.getMessage() for r in caplog.records if WARNING_TEXT in r.getMessage()
                and r.levelno == logging.WARNING]
    if warns:
        assert len(warnings) == 1, caplog.text
        assert f"--host {host}" in warnings[0]
        assert "--api-key" in warnings[0] and serve_cli.API_KEY_ENV in warnings[0]
    else:
        assert warnings == [], caplog.text
    assert started["server"].config.host == host


def test_shutdown_timeout_reaches_the_server(started):
    assert serve_cli.main(["--port", "0", "--shutdown-timeout", "2.5"]) == 0
    server = started["server"]
    assert isinstance(server, DrainingServer) and server.shutdown_timeout_s == 2.5
    assert serve_cli.main(["--port", "0"]) == 0
    assert started["server"].shutdown_timeout_s == serve_cli.DEFAULT_SHUTDOWN_TIMEOUT_S == 30


@pytest.mark.parametrize("value", ["-1", "abc", "inf", "nan"])
def test_bad_shutdown_timeout_is_one_line_and_exit_2(capsys, value):
    with pytest.raises(SystemExit) as info:
        serve_cli.main(["--shutdown-timeout", value])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--shutdown-timeout" in err[0], err
