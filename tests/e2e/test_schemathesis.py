"""Schemathesis fuzzes every operation of the server's own OpenAPI schema (/openapi.json): no request,
however odd, gets a 500. The example count is bounded so the run takes well under two minutes."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

MAX_EXAMPLES = 30


def test_schema_fuzzing_finds_no_server_errors(small_server, tmp_path):
    schemathesis = shutil.which("schemathesis", path=str(Path(sys.executable).parent))
    if schemathesis is None:
        pytest.fail("schemathesis is not installed: pip install -e '.[dev]'")
    schema = httpx.get(f"{small_server.url}/openapi.json", timeout=10).json()
    operations = {(method.upper(), path) for path, methods in schema["paths"].items() for method in methods}
    assert {("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
            ("GET", "/health"), ("GET", "/metrics")} <= operations
    log_before = small_server.log_path.read_text(errors="replace")
    run = subprocess.run(
        [schemathesis, "run", f"{small_server.url}/openapi.json", "--checks", "not_a_server_error",
         "--max-examples", str(MAX_EXAMPLES), "--seed", "20261130", "--workers", "1", "--request-timeout",
         "30", "--phases", "examples,coverage,fuzzing", "--no-color"],
        cwd=tmp_path, capture_output=True, text=True, timeout=170, check=False)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-6000:]
    match = re.search(r"(\d+) generated, (\d+) passed", output)
    assert match and int(match.group(1)) >= 100 and match.group(1) == match.group(2), output[-3000:]
    assert f"Tested: {len(operations)}" in output, output[-3000:]
    server_log = small_server.log_path.read_text(errors="replace")[len(log_before):]
    assert "Traceback" not in server_log, server_log[-6000:]
    small_server.wait_idle(timeout_s=30)
    assert all(free == total for free, total in small_server.pools().values())
