"""The OpenAI-compatible HTTP server (`widebeam serve`): `schemas` (wire format), `protocol` (a request
as engine parameters), `api` (FastAPI app), `engine_loop` (the one task that owns the engine; drain and
close), `shutdown` (uvicorn with a drain on SIGTERM/SIGINT), `metrics` (Prometheus), `serve_cli` (the
command line).

Nothing heavy is imported here: `widebeam serve --help` should not pay for torch or FastAPI.
"""

__all__ = ["create_app"]


def __getattr__(name: str):
    if name == "create_app":
        from widebeam.server.api import create_app

        return create_app
    raise AttributeError(f"module 'widebeam.server' has no attribute {name!r}")
