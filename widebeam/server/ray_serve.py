"""`widebeam serve --replicas N`: the same OpenAI-compatible app on Ray Serve, N engine replicas.

Each replica is a Ray Serve deployment replica holding one engine (one GPU where there are GPUs,
`cpus_per_replica` CPU slots otherwise) and the app `create_app` builds for it; Serve's proxy
routes each HTTP call to a replica, and autoscales between `min_replicas` and `max_replicas`
when those are given. Everything a request sees (routes, errors, streaming, API key, size caps)
is the single-engine server's, because it is the same app.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

log = logging.getLogger("widebeam.server")


class EngineServer:
    """One replica: an engine and its app (`__serve_build_asgi_app__` hands the app to Serve)."""

    def __init__(self, model: str, engine_kwargs: dict, app_kwargs: dict, num_threads: int):
        import torch

        from widebeam.engine import LLMEngine
        from widebeam.heap import freeze_startup_heap
        from widebeam.server.api import create_app

        if not torch.cuda.is_available():
            torch.set_num_threads(num_threads)  # the replica's CPU slots, not the whole host
        self.engine = LLMEngine(model, **engine_kwargs)
        self.openai_app = create_app(self.engine, **app_kwargs)
        freeze_startup_heap()  # a long-lived replica (widebeam/heap.py)

    def __serve_build_asgi_app__(self):
        return self.openai_app


def deployment(model: str, engine_kwargs: dict, app_kwargs: dict, *, replicas: int = 1,
               min_replicas: int | None = None, max_replicas: int | None = None, cpus_per_replica: int = 1):
    """The bound Serve application: `replicas` fixed, or autoscaled in [min_replicas, max_replicas]."""
    import torch
    from ray import serve

    ingress = serve.ingress()(EngineServer)
    options: dict = {"ray_actor_options": {"num_gpus": 1} if torch.cuda.is_available()
                     else {"num_cpus": cpus_per_replica}}
    if min_replicas is not None or max_replicas is not None:
        low = replicas if min_replicas is None else min_replicas
        options["autoscaling_config"] = {"min_replicas": low, "initial_replicas": max(low, 1),
                                         "max_replicas": max(replicas, low, max_replicas or 0)}
    else:
        options["num_replicas"] = replicas
    return serve.deployment(ingress, name="widebeam", **options).bind(model, engine_kwargs, app_kwargs,
                                                                     cpus_per_replica)


def start(model: str, engine_kwargs: dict, app_kwargs: dict, *, host: str, port: int, replicas: int,
          min_replicas: int | None = None, max_replicas: int | None = None, ray_address: str | None = None,
          cpus_per_replica: int = 1, num_cpus: int | None = None) -> None:
    """Start Ray (a local instance, or join `ray_address`), then Serve on `host:port`, and run the
    app until the replicas are up; returns once it is served (the caller keeps the process alive)."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        ray.init(address=ray_address, num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": host, "port": port})
    app = deployment(model, engine_kwargs, app_kwargs, replicas=replicas, min_replicas=min_replicas,
                     max_replicas=max_replicas, cpus_per_replica=cpus_per_replica)
    serve.run(app, name="widebeam", route_prefix="/", blocking=False)
    log.info("serving %s on Ray Serve at http://%s:%d with %d replica(s)", model, host, port, replicas)


def serve_forever(**kwargs) -> int:
    """`start`, then wait for SIGINT or SIGTERM; shut Serve and the local Ray instance down on the
    way out (a SIGTERM without a handler would leave Ray's processes behind)."""
    # Ray's own failure handler would abort on SIGTERM before Serve and Ray are shut down; it reads
    # this when Ray is imported.
    os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
    import ray
    from ray import serve

    try:
        start(**kwargs)
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
        while True:
            time.sleep(3600)
    except (KeyboardInterrupt, SystemExit):
        return 0
    finally:
        if ray.is_initialized():
            serve.shutdown()
            ray.shutdown()
