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
    """One replica serving HTTP itself (`--router serve`): `__serve_build_asgi_app__` hands the app to
    Serve."""

    def __init__(self, model: str, engine_kwargs: dict, app_kwargs: dict, num_threads: int):
        from widebeam.server.router_replica import build_engine_app

        self.engine, self.openai_app = build_engine_app(model, engine_kwargs, app_kwargs, num_threads)

    def __serve_build_asgi_app__(self):
        return self.openai_app


ROUTERS = ("exact-fit", "serve")
ENGINE_DEPLOYMENT = "widebeam-engine"
# Serve's own cap on calls in flight per replica (its default is 5). Behind the exact-fit router the
# ledger decides what a replica takes and the engine's queue bounds the rest, so Serve's probe of a
# replica's queue must always accept.
MAX_ONGOING_REQUESTS = 100_000


def _replica_options(replicas: int, min_replicas: int | None, max_replicas: int | None,
                     cpus_per_replica: int) -> dict:
    import torch

    options: dict = {"ray_actor_options": {"num_gpus": 1} if torch.cuda.is_available()
                     else {"num_cpus": cpus_per_replica}}
    if min_replicas is not None or max_replicas is not None:
        low = replicas if min_replicas is None else min_replicas
        options["autoscaling_config"] = {"min_replicas": low, "initial_replicas": max(low, 1),
                                         "max_replicas": max(replicas, low, max_replicas or 0)}
    else:
        options["num_replicas"] = replicas
    return options


def deployment(model: str, engine_kwargs: dict, app_kwargs: dict, *, replicas: int = 1,
               min_replicas: int | None = None, max_replicas: int | None = None, cpus_per_replica: int = 1,
               router: str = "exact-fit", max_waiting_requests: int = 256):
    """The bound Serve application: `replicas` fixed, or autoscaled in [min_replicas, max_replicas].

    `router`: "exact-fit" (a light ingress sizes each request and places it by its exact block need,
    server/router_ingress.py; at most `max_waiting_requests` wait there for room) or "serve" (each
    replica serves the app itself, routed by Serve's default power-of-two-choices router)."""
    from ray import serve

    options = _replica_options(replicas, min_replicas, max_replicas, cpus_per_replica)
    if router == "serve":
        ingress = serve.ingress()(EngineServer)
        return serve.deployment(ingress, name="widebeam", **options).bind(model, engine_kwargs, app_kwargs,
                                                                         cpus_per_replica)
    if router != "exact-fit":
        raise ValueError(f"router must be one of {ROUTERS}, got {router!r}")
    from ray.serve.config import RequestRouterConfig

    from widebeam.server.ray_router import ROUTING_STATS_PERIOD_S, ExactFitRequestRouter
    from widebeam.server.router_ingress import RouterIngress
    from widebeam.server.router_replica import EngineReplica

    router_config = RequestRouterConfig(request_router_class=ExactFitRequestRouter,
                                        request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
                                        request_routing_stats_timeout_s=ROUTING_STATS_PERIOD_S * 4)
    engines = serve.deployment(EngineReplica, name=ENGINE_DEPLOYMENT,
                               max_ongoing_requests=MAX_ONGOING_REQUESTS,
                               request_router_config=router_config, **options).bind(
        model, engine_kwargs, app_kwargs, cpus_per_replica)
    # the ingress only parses, tokenizes and forwards: no CPU slot of its own (it shares the host's)
    ingress = serve.ingress()(RouterIngress)
    return serve.deployment(ingress, name="widebeam", ray_actor_options={"num_cpus": 0},
                            max_ongoing_requests=MAX_ONGOING_REQUESTS).bind(
        engines, ENGINE_DEPLOYMENT, app_kwargs, max_waiting_requests)


def start(model: str, engine_kwargs: dict, app_kwargs: dict, *, host: str, port: int, replicas: int,
          min_replicas: int | None = None, max_replicas: int | None = None, ray_address: str | None = None,
          cpus_per_replica: int = 1, num_cpus: int | None = None, router: str = "exact-fit",
          max_waiting_requests: int = 256) -> None:
    """Start Ray (a local instance, or join `ray_address`), then Serve on `host:port`, and run the
    app until the replicas are up; returns once it is served (the caller keeps the process alive)."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        ray.init(address=ray_address, num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": host, "port": port})
    app = deployment(model, engine_kwargs, app_kwargs, replicas=replicas, min_replicas=min_replicas,
                     max_replicas=max_replicas, cpus_per_replica=cpus_per_replica, router=router,
                     max_waiting_requests=max_waiting_requests)
    serve.run(app, name="widebeam", route_prefix="/", blocking=False)
    log.info("serving %s on Ray Serve at http://%s:%d with %d replica(s), %s router", model, host, port,
             replicas, router)


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
