"""The web page at `/` (widebeam/server/ui/, docs/ui.md) and the JSON endpoints it reads.

- `GET /v1/stats`: the engine's `stats()` as the engine loop last took it (pools: total / free /
  evictable / pinned blocks; the last finished requests' required vs peak blocks), with the server's
  `time` in seconds: the capacity panel polls it.
- `POST /v1/plan`: `widebeam plan` for a model (a built-in name, or the served model), a memory size,
  a beam width and lengths: the plan panel's table (widebeam/plan.py).
- `GET /v1/ui/config`: what the page's form offers: the served model, widths, catalogues, plan models.
- `GET /` and `GET /ui/<file>`: the page itself, plain files shipped in the package (no build step, no
  CDN); `widebeam serve --no-ui` leaves them out (the JSON endpoints stay, they are API).

Every path but /health sits behind the same API key guard as the API (server/api.py): with a key set,
a browser is asked for it (HTTP Basic, the key as password) and sends it with the page's calls.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Literal

from fastapi import FastAPI
from fastapi.responses import FileResponse
from pydantic import BaseModel, ConfigDict, Field

from widebeam.defaults import DTYPES, KV_CACHE_DTYPES
from widebeam.server import schemas as s

UI_DIR = Path(__file__).with_name("ui")
# The files the page loads; nothing else under ui/ is served.
UI_FILES = {"index.html": "text/html", "style.css": "text/css", "app.js": "text/javascript",
            "tree.js": "text/javascript", "panels.js": "text/javascript"}
UI_PATH_PREFIXES = ("/ui/",)  # with "/": the paths a browser opens (answered 401 with Basic)


def is_ui_path(path: str) -> bool:
    return path == "/" or path.startswith(UI_PATH_PREFIXES)


# Bounds that keep one plan quick (the layout's loops are over pools and lengths, not memory).
MAX_PLAN_BEAM_WIDTH = 1 << 16
MAX_PLAN_TOKENS = 1 << 20


class PlanRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    model: str = Field(..., description="the served model or a built-in name (widebeam plan --list-models); "
                                        "no other path is read")
    memory: str | int = Field(..., description="device memory: bytes, or a size such as '8GiB'")
    beam_width: int = Field(1, ge=1, le=MAX_PLAN_BEAM_WIDTH)
    prompt_len: int = Field(512, ge=1, le=MAX_PLAN_TOKENS)
    max_new_tokens: int = Field(64, ge=1, le=MAX_PLAN_TOKENS)
    dtype: Literal[DTYPES] = "bfloat16"  # type: ignore[valid-type]
    tokens_per_block: int | None = Field(None, ge=1, le=1024)
    kv_cache_dtype: Literal[KV_CACHE_DTYPES] = "auto"  # type: ignore[valid-type]


def _memory_bytes(memory: str | int) -> int:
    from widebeam.plan import MAX_PLAN_MEMORY_BYTES
    from widebeam.units import parse_bytes

    try:
        value = memory if isinstance(memory, int) else parse_bytes(memory)
    except ValueError as exc:
        raise s.invalid("memory", f"memory: {exc}") from None
    if not 0 < value <= MAX_PLAN_MEMORY_BYTES:
        raise s.invalid("memory", f"memory must be in (0, {MAX_PLAN_MEMORY_BYTES}] bytes (256 TiB, more than "
                                  f"any machine has), got {memory!r}")
    return value


def add_ui_routes(app: FastAPI, loop, *, model_name: str, plan_model: str | None, ui: bool) -> None:
    """`loop`: the server's `EngineLoop` (its `snapshot` is `engine.stats()` taken on the engine's own
    thread); `plan_model`: the served model as `widebeam plan --model` takes it (its path or alias)."""
    engine = loop.engine

    @app.get("/v1/stats")
    async def stats():
        return {**loop.snapshot, "time": time.time()}

    from widebeam.model.families.arch import BUILTIN_CONFIGS

    # what the plan endpoint reads: a client cannot make the server open any other path
    plan_models = ([plan_model] if plan_model else []) + [m for m in BUILTIN_CONFIGS if m != plan_model]

    @app.get("/v1/ui/config")
    async def ui_config():
        return {"model": model_name, "max_beam_width": getattr(engine, "max_beam_width", 1),
                "max_seq_len": engine.max_seq_len,
                "catalogues": sorted(getattr(engine, "catalogues", None) or {}),
                "chat": bool(getattr(getattr(engine, "tokenizer", None), "chat_template", None)),
                "plan_models": plan_models}

    @app.post("/v1/plan")
    async def plan_endpoint(body: PlanRequest):
        from widebeam.defaults import DEFAULT_TOKENS_PER_BLOCK
        from widebeam.errors import ConfigError, InvalidParameterError, UnsupportedModelError
        from widebeam.model.loading.arch import load_arch
        from widebeam.plan import PlanError, PlanInputs, plan

        if body.model not in plan_models:
            raise s.invalid("model", f"model must be the served model or a built-in one: {plan_models}")
        try:
            arch = load_arch(body.model)
        except (ConfigError, UnsupportedModelError) as exc:
            raise s.invalid("model", f"model: {exc}") from None
        inputs = PlanInputs(memory_bytes=_memory_bytes(body.memory), beam_width=body.beam_width,
                            prompt_len=body.prompt_len, max_new_tokens=body.max_new_tokens, dtype=body.dtype,
                            tokens_per_block=body.tokens_per_block or DEFAULT_TOKENS_PER_BLOCK,
                            kv_cache_dtype=body.kv_cache_dtype)
        try:
            return plan(arch, inputs)
        except PlanError as exc:
            raise s.invalid("memory", str(exc).replace("--memory", "memory")) from None
        except (InvalidParameterError, ValueError, ArithmeticError) as exc:
            raise s.invalid(getattr(exc, "param", None) or "model", str(exc)) from None

    if not ui:
        return

    @app.get("/", include_in_schema=False)
    async def index():
        return FileResponse(UI_DIR / "index.html", media_type="text/html")

    @app.get("/ui/{name}", include_in_schema=False)
    async def ui_file(name: str):
        if name not in UI_FILES:
            raise s.ApiError(404, f"no such file: /ui/{name}", code="not_found")
        return FileResponse(UI_DIR / name, media_type=UI_FILES[name], headers={"Cache-Control": "no-cache"})
