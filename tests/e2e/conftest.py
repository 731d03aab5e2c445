"""End-to-end fixtures: `widebeam serve` started as a real process on loopback, on a free port.

Models: a tiny random Llama (hidden 32) that carries the real SmolLM2 tokenizer and chat template, so
text prompts and chat work while every step takes milliseconds; and the real default model for the
beam-search equality test. Both come from the session's `smollm2` fixture (tests/conftest.py), which
converts the default model's GGUF once into a session cache.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from e2e_helpers import free_port
from tiny_models import save_tiny_model

# How the server is started; the one place to change when `widebeam serve` is wired into the CLI.
SERVE_COMMAND = [sys.executable, "-m", "widebeam", "serve"]
API_KEY = "e2e-secret-key"
STARTUP_TIMEOUT_S = 180.0

# The two tiny-model servers' sizing. KV bytes per token: 2 layers x 2 kv heads x 8 dims x (K, V) x 4 B.
TINY_KV_BYTES_PER_BLOCK = 2 * 2 * 8 * 2 * 4 * 16
SMALL_POOL_OPTIONS = {"kv_cache_memory": 32 * TINY_KV_BYTES_PER_BLOCK, "max_seq_len": 64,
                      "max_beam_width": 16, "max_num_batched_tokens": 256, "tokens_per_block": 16}
SMALL_POOL_ARGS = [arg for key, value in SMALL_POOL_OPTIONS.items()
                   for arg in ("--" + key.replace("_", "-"), str(value))]
# The main tiny server's options (`server`); a speculative server that adds its flags to these answers
# as `server` does.
MAIN_ARGS = ["--served-model-name", "tiny-chat", "--kv-cache-memory", "16MiB", "--max-beam-width", "16",
             "--max-num-batched-tokens", "256"]


@pytest.fixture(scope="session")
def tiny_chat_model_dir(tmp_path_factory, smollm2) -> Path:
    """A tiny random Llama with the SmolLM2 tokenizer (vocab 49152) and its chat template."""
    from transformers import AutoTokenizer

    _, source = smollm2
    path = tmp_path_factory.mktemp("tiny-chat-llama")
    tokenizer = AutoTokenizer.from_pretrained(str(source.path))
    save_tiny_model(path, "llama", vocab_size=49152, hidden_size=32, intermediate_size=64,
                    max_position_embeddings=2048, bos_token_id=tokenizer.bos_token_id,
                    eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    tokenizer.save_pretrained(str(path))
    return path


class ServerProcess:
    """One `widebeam serve` process; its output goes to a log file (a pipe could fill and block it)."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None,
                 api_key: str | None = None, engine_options: dict | None = None):
        self.args = args
        self.engine_options = engine_options or {}  # the same sizing as LLMEngine keyword arguments
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115  (open as long as the server runs)
        self.command = [*SERVE_COMMAND, "--host", "127.0.0.1", "--port", str(self.port), "--log-level",
                        "warning", *args]
        # One intra-op thread: the tiny model runs fastest so, and on a 2-core machine a server and the test
        # process must not oversubscribe OpenMP threads (spinning threads slow a step tenfold).
        self.proc = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
        self._ready = False

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log_tail(self, num_chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def wait_ready(self) -> ServerProcess:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self._ready and time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    self._ready = True
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        if self._ready:
            return self
        self.stop()
        raise RuntimeError(f"server not ready after {STARTUP_TIMEOUT_S} s:\n{self.log_tail()}")

    def client(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=kwargs.pop("timeout", 60),
                            **kwargs)

    def metrics(self) -> dict[str, float]:
        """The Prometheus samples, keyed by name with labels:
        {'widebeam_kv_blocks_free{pool="self"}': 64.0}."""
        text = httpx.get(f"{self.url}/metrics", headers=self.headers, timeout=10).text
        samples = {}
        for line in text.splitlines():
            match = re.match(r"^([a-zA-Z_:][\w:]*(?:\{[^}]*\})?) (\S+)$", line)
            if match:
                samples[match.group(1)] = float(match.group(2))
        return samples

    def pools(self) -> dict[str, tuple[float, float]]:
        """pool -> (free, total) blocks, from /metrics."""
        samples = self.metrics()
        out = {}
        for key, total in samples.items():
            match = re.match(r'^widebeam_kv_blocks_total\{pool="([^"]+)"\}$', key)
            if match:
                out[match.group(1)] = (samples[f'widebeam_kv_blocks_free{{pool="{match.group(1)}"}}'], total)
        return out

    def wait_idle(self, timeout_s: float = 10.0) -> dict[str, float]:
        """Wait until nothing runs or waits and every pool is fully free; return the metrics."""
        deadline = time.monotonic() + timeout_s
        while True:
            samples = self.metrics()
            pools = self.pools()
            idle = (samples["widebeam_requests_running"] == 0 and samples["widebeam_requests_waiting"] == 0
                    and pools and all(free == total for free, total in pools.values()))
            if idle or time.monotonic() > deadline:
                return samples
            time.sleep(0.05)

    def stop(self) -> None:
        if self._log.closed:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)
        self._log.close()


@pytest.fixture(scope="session")
def tiny_servers(tiny_chat_model_dir, tmp_path_factory):
    """Both tiny-model servers, started together (start-up is mostly imports; they overlap well)."""
    servers = {
        # a roomy KV pool and the API key from $WIDEBEAM_API_KEY
        "main": ServerProcess(["--model", str(tiny_chat_model_dir), *MAIN_ARGS],
                              tmp_path_factory.mktemp("server-main") / "server.log",
                              env={"WIDEBEAM_API_KEY": API_KEY}, api_key=API_KEY),
        # a 32-block KV pool (512 tokens), max_seq_len 64, no API key
        "small": ServerProcess(["--model", str(tiny_chat_model_dir), *SMALL_POOL_ARGS],
                               tmp_path_factory.mktemp("server-small") / "server.log",
                               engine_options=SMALL_POOL_OPTIONS),
    }
    yield servers
    for proc in servers.values():
        proc.stop()


@pytest.fixture(scope="session")
def server(tiny_servers):
    """Tiny model, a roomy KV pool (4096 blocks), max_seq_len 2048, API key required."""
    return tiny_servers["main"].wait_ready()


@pytest.fixture(scope="session")
def small_server(tiny_servers):
    """Tiny model, a 32-block KV pool (512 tokens) and max_seq_len 64; no API key."""
    return tiny_servers["small"].wait_ready()


@pytest.fixture(scope="session")
def ngram_server(tiny_chat_model_dir, tmp_path_factory):
    """`server`'s model and options plus n-gram speculation (4 tokens a round), no API key; shared by
    the modules that compare a speculative server with the plain one."""
    proc = ServerProcess(["--model", str(tiny_chat_model_dir), *MAIN_ARGS, "--speculative-method", "ngram",
                          "--num-speculative-tokens", "4"],
                         tmp_path_factory.mktemp("server-ngram") / "server.log")
    yield proc.wait_ready()
    proc.stop()


@pytest.fixture(scope="session")
def tiny_nllb(tmp_path_factory):
    """A tiny NLLB-shaped translation model (tiny_nllb.py): (path, transformers model, tokenizer)."""
    from tiny_nllb import save_tiny_nllb

    path = tmp_path_factory.mktemp("tiny-nllb")
    hf, tokenizer = save_tiny_nllb(path)
    return path, hf, tokenizer


@pytest.fixture(scope="session")
def nllb_server(tiny_nllb, tmp_path_factory):
    """`widebeam serve` on `tiny_nllb` as "tiny-nllb", beams up to 8; shared by the translation modules."""
    path, _, _ = tiny_nllb
    proc = ServerProcess(["--model", str(path), "--served-model-name", "tiny-nllb", "--kv-cache-memory",
                          "8MiB", "--max-beam-width", "8"],
                         tmp_path_factory.mktemp("server-nllb") / "server.log")
    yield proc.wait_ready()
    proc.stop()


REAL_ENGINE_OPTIONS = {"kv_cache_memory": "64MiB", "max_beam_width": 4, "max_num_batched_tokens": 256}


@pytest.fixture(scope="session")
def real_server(smollm2, tiny_servers, tmp_path_factory):
    """The real default model (SmolLM2-135M-Instruct) from the session's converted cache.

    It asks for `tiny_servers` only so that all three start at once: start-ups overlap, tests run later.
    """
    cache, _ = smollm2
    log = tmp_path_factory.mktemp("server-real") / "server.log"
    proc = ServerProcess(["--kv-cache-memory", REAL_ENGINE_OPTIONS["kv_cache_memory"],
                          "--max-beam-width", str(REAL_ENGINE_OPTIONS["max_beam_width"]),
                          "--max-num-batched-tokens", str(REAL_ENGINE_OPTIONS["max_num_batched_tokens"])],
                         log, env={"WIDEBEAM_CACHE": str(cache)}, engine_options=REAL_ENGINE_OPTIONS)
    yield proc.wait_ready()
    proc.stop()


@pytest.fixture()
def server_factory(tmp_path):
    """Start `widebeam serve` processes of the test's own (stopped at its end, if still running):
    `server_factory(args, env=None)` -> a ServerProcess, not yet waited for."""
    started: list[ServerProcess] = []

    def start(args: list[str], env: dict[str, str] | None = None) -> ServerProcess:
        proc = ServerProcess(args, tmp_path / f"server-{len(started)}.log", env=env)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop()
