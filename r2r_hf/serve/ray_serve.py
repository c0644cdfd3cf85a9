"""The server as a Ray Serve deployment: replicas on one machine or a cluster, restarted when they die.

Each replica is a Ray actor that loads the SLM, router and LLM once and runs its own decoding
thread (``engine.Engine``: continuous batching inside the replica); Ray's proxy spreads requests
over the replicas, restarts a replica whose process dies, and scales their number when given an
``autoscaling_config``. The routes are the single-process server's own (``app.add_routes``).

    r2r-hf serve ROUTER --ray --replicas 2                        # a local Ray instance
    ray start --head; r2r-hf serve ROUTER --ray --ray-address auto --gpus-per-replica 1

or, on a cluster, ``serve run`` with a config file whose application imports ``r2r_hf.serve.ray_serve:app_builder``
(README: "Serve", scale-out).
"""

from __future__ import annotations

import dataclasses
import importlib
import signal
import threading
from typing import Any

from fastapi import FastAPI
from ray import serve

from .app import Service, add_routes
from .settings import ServeSettings


@dataclasses.dataclass
class ReplicaSpec:
    """What every replica loads and how it serves (plain values: Ray sends them to each replica)."""

    router: str
    name: str
    slm: str | None = None
    llm: str | None = None
    device: str = "cpu"
    dtype: str = "auto"
    threads: int | None = None
    settings: ServeSettings = dataclasses.field(default_factory=ServeSettings)


ingress = FastAPI(title="r2r_hf", docs_url=None, redoc_url=None)
# The service of this replica's process (one replica per actor process). Ray ships the deployment class
# and the ingress app by value, each with its own copy of this module's globals, so both reach the one
# registry through the imported module instead.
_REGISTRY = "r2r_hf.serve.ray_serve"
_replica: dict[str, Service] = {}


def _registry() -> dict[str, Service]:
    return importlib.import_module(_REGISTRY)._replica


def _service() -> Service:
    return _registry()["service"]


add_routes(ingress, _service)


@serve.deployment(name="r2r", max_ongoing_requests=64, health_check_period_s=2, health_check_timeout_s=10)
@serve.ingress(ingress)
class R2RReplica:
    """One replica: the model pair, the router and a decoding thread."""

    def __init__(self, spec: ReplicaSpec | dict[str, Any]) -> None:
        from . import load_for_serving

        if isinstance(spec, dict):  # from a `serve run` config file
            settings = ServeSettings(**spec.pop("settings", {}))
            spec = ReplicaSpec(settings=settings, **spec)
        if spec.threads:
            import torch

            torch.set_num_threads(spec.threads)
        model, tokenizer = load_for_serving(spec.router, spec.slm, spec.llm, spec.device, spec.dtype)
        service = Service(model, tokenizer, spec.settings, spec.name)
        service.engine.start()
        _registry()["service"] = service

    def check_health(self) -> None:
        """Ray's health check: a replica whose decoding thread died is replaced."""
        if not _service().engine.thread.is_alive():
            raise RuntimeError("the decoding thread of this replica has stopped")

    def __del__(self) -> None:
        service = _registry().pop("service", None)
        if service is not None:
            service.engine.stop(service.settings.drain_seconds)


def app_builder(args: dict[str, Any]):
    """``serve run r2r_hf.serve.ray_serve:app_builder router=...`` (or a config file's ``import_path``)."""
    args = dict(args)
    args.setdefault("name", args["router"])
    return R2RReplica.bind(args)


def deployment(spec: ReplicaSpec, replicas: int = 1, gpus: float = 0.0, cpus: float = 1.0,
               autoscaling: dict[str, Any] | None = None):
    """The bound application: ``replicas`` copies (or ``autoscaling``), each reserving ``gpus``/``cpus``."""
    options: dict[str, Any] = {"ray_actor_options": {"num_gpus": gpus, "num_cpus": cpus}}
    if autoscaling:
        options["autoscaling_config"] = autoscaling
    else:
        options["num_replicas"] = replicas
    return R2RReplica.options(**options).bind(spec)


def run_on_ray(spec: ReplicaSpec, replicas: int = 1, address: str | None = None, gpus: float = 0.0,
               cpus: float = 1.0, autoscaling: dict[str, Any] | None = None) -> None:
    """Deploy on Ray (a cluster at ``address``, or a local instance) and serve until SIGINT/SIGTERM."""
    import ray

    ray.init(address=address, include_dashboard=False, ignore_reinit_error=True, logging_level="WARNING")
    stopped = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopped.set())
    try:
        serve.start(http_options={"host": spec.settings.host, "port": spec.settings.port})
        serve.run(deployment(spec, replicas, gpus, cpus, autoscaling), name="r2r", route_prefix="/")
        print(f"serving {spec.name} on http://{spec.settings.host}:{spec.settings.port}/v1 with Ray Serve", flush=True)
        stopped.wait()
    finally:
        serve.shutdown()
        ray.shutdown()
