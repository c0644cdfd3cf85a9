"""The server as a Ray Serve deployment: replicas on one machine or a cluster, restarted when they die.

Each replica is a Ray actor that loads the SLM, router and LLM once and runs its own decoding
thread (``engine.Engine``: continuous batching inside the replica); Ray's proxy spreads requests
over the replicas, restarts a replica whose process dies, and scales their number when given an
``autoscaling_config``. The routes are the single-process server's own (``app.add_routes``).

    r2r-hf serve ROUTER --ray --replicas 2                        # a local Ray instance
    ray start --head; r2r-hf serve ROUTER --ray --ray-address auto --gpus-per-replica 1

or, on a cluster, ``serve run`` with a config file whose application imports ``r2r_hf.serve.ray_serve:app_builder``
(docs/serving.md, "Scale out on Ray Serve").

``run_on_ray`` owns the command's life: a signal during start-up stops it at once (once a replica runs, it drains); a deployment that cannot fit
on the Ray started here is refused before it is placed, and start-up gives up after ``start_timeout``; on
SIGTERM/SIGINT every replica drains as the single-process server does (``_drain``) before Serve is shut down.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import signal
import threading
import time
import uuid
from typing import Any

from fastapi import FastAPI
from ray import serve

from . import DRAIN_GRACE_S
from .app import Service, add_routes
from .settings import ServeSettings

APP = "r2r"
KV_NAMESPACE = "r2r_hf"  # Ray's key-value store (in the GCS): where the command asks its replicas to drain
DRAIN_POLL_S = 0.5  # how often a replica looks for that request, and Serve for a draining replica's open requests
STATUS_POLL_S = 0.5  # how often start-up asks Serve whether the deployment runs


@dataclasses.dataclass
class ReplicaSpec:
    """What every replica loads and how it serves (plain values: Ray sends them to each replica).

    ``drain_key``: the key under which ``run_on_ray`` asks the replicas to drain (None: a ``serve run``
    deployment, which Ray's own graceful shutdown stops).
    """

    router: str
    name: str
    slm: str | None = None
    llm: str | None = None
    device: str = "cpu"
    dtype: str = "auto"
    threads: int | None = None
    settings: ServeSettings = dataclasses.field(default_factory=ServeSettings)
    drain_key: str | None = None


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
        from .ray_local import loopback_replica_server

        loopback_replica_server()  # on a Ray started here: before Serve starts this replica's gRPC server
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
        _publish_metrics(service)
        if spec.drain_key:
            threading.Thread(target=_await_drain, args=(service.engine, spec.drain_key), name="r2r-drain",
                             daemon=True).start()

    def check_health(self) -> None:
        """Ray's health check: a replica whose decoding thread died is replaced (one that drained is not)."""
        engine = _service().engine
        if not engine.thread.is_alive() and not engine.stopping:
            raise RuntimeError("the decoding thread of this replica has stopped")

    def __del__(self) -> None:
        service = _registry().pop("service", None)
        if service is not None:
            service.engine.stop(service.settings.drain_seconds)


def _publish_metrics(service: Service) -> None:
    """This replica publishes its metrics, and a scrape it answers gives every replica's (``replica_metrics``)."""
    from .replica_metrics import RayStore, ReplicaMetrics

    context = serve.get_replica_context()
    replica = getattr(getattr(context, "replica_id", None), "unique_id", None) or uuid.uuid4().hex[:8]
    exporter = ReplicaMetrics(service.engine.metrics, getattr(context, "app_name", None) or APP, replica,
                              RayStore(KV_NAMESPACE))
    service.exporter = exporter.text
    threading.Thread(target=exporter.run, args=(service.engine.thread.is_alive,), name="r2r-metrics",
                     daemon=True).start()


def _await_drain(engine, key: str) -> None:
    """In a replica: wait until the command asks for a drain (``_drain``), then drain this replica's engine."""
    from ray.experimental import internal_kv

    while engine.thread.is_alive():
        try:
            seconds = internal_kv._internal_kv_get(key, namespace=KV_NAMESPACE)
        except Exception:  # noqa: BLE001 - the GCS briefly unreachable: ask again
            seconds = None
        if seconds is not None:
            engine.drain(float(seconds))
            return
        time.sleep(DRAIN_POLL_S)


def app_builder(args: dict[str, Any]):
    """``serve run r2r_hf.serve.ray_serve:app_builder router=...`` (or a config file's ``import_path``)."""
    args = dict(args)
    args.setdefault("name", args["router"])
    drain = ServeSettings(**args.get("settings", {})).drain_seconds
    return R2RReplica.options(**_shutdown_options(drain)).bind(args)


def _shutdown_options(drain_seconds: float) -> dict[str, float]:
    """Ray's graceful shutdown of a replica waits for its open requests as long as a drain may take."""
    return {"graceful_shutdown_wait_loop_s": DRAIN_POLL_S,
            "graceful_shutdown_timeout_s": drain_seconds + DRAIN_GRACE_S + 2 * DRAIN_POLL_S}


def deployment(spec: ReplicaSpec, replicas: int = 1, gpus: float = 0.0, cpus: float = 1.0,
               autoscaling: dict[str, Any] | None = None):
    """The bound application: ``replicas`` copies (or ``autoscaling``), each reserving ``gpus``/``cpus``."""
    options: dict[str, Any] = {"ray_actor_options": {"num_gpus": gpus, "num_cpus": cpus},
                               **_shutdown_options(spec.settings.drain_seconds)}
    if autoscaling:
        options["autoscaling_config"] = autoscaling
    else:
        options["num_replicas"] = replicas
    return R2RReplica.options(**options).bind(spec)


def unfit(resources: dict[str, float], replicas: int, cpus: float, gpus: float) -> str | None:
    """Why ``replicas`` replicas reserving ``cpus``/``gpus`` each cannot all be placed on ``resources`` (those of a
    Ray started here: one node, no autoscaler to add more), or None when they fit."""
    for kind, each, flag in (("CPU", cpus, "--cpus-per-replica"), ("GPU", gpus, "--gpus-per-replica")):
        need, have = replicas * each, resources.get(kind, 0.0)
        if need > have + 1e-6:
            return (f"{replicas} replica(s) reserving {each:g} {kind} each need {need:g} {kind} in all, but the Ray "
                    f"started here has {have:g}; lower --replicas or {flag}, or join a cluster with --ray-address.")
    return None


def _starting_replicas(replicas: int, autoscaling: dict[str, Any] | None) -> int:
    """The replicas that must be placed before the deployment runs (at least one: it must fit to ever serve)."""
    if autoscaling:
        replicas = autoscaling.get("initial_replicas") or autoscaling.get("min_replicas", 1)
    return max(int(replicas), 1)


class _Stop(BaseException):
    """SIGINT/SIGTERM: raised from the handler, so that a blocking start-up call (``ray.init``, placement) ends
    at once; a BaseException, which Ray's own ``except Exception`` blocks let through."""


def _raise_stop(signum: int, frame: Any) -> None:
    raise _Stop(signum)


def _on_signals(handler: Any) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)


def _init_ray(address: str | None) -> None:
    """Connect to ``address`` or start a Ray here (``local``: a ``RAY_ADDRESS`` in the environment never turns the
    Ray this command starts, made loopback by ``ray_local``, into a remote one)."""
    import ray

    try:
        ray.init(address=address or "local", include_dashboard=False, ignore_reinit_error=True,
                 logging_level="WARNING")
    except SystemExit:  # Ray's own SIGTERM handler, set while ray.init runs, exits this way
        raise _Stop(signal.SIGTERM) from None
    _on_signals(_raise_stop)  # ray.init replaced the SIGTERM handler with its own


def _wait_until_running(timeout: float) -> None:
    """Block until Serve runs the app; a failed deployment or one not running within ``timeout`` s is an error."""
    deadline = time.monotonic() + timeout
    while True:
        app = serve.status().applications.get(APP)
        status = str(getattr(app, "status", ""))
        if status.endswith("RUNNING"):
            return
        if status.endswith("DEPLOY_FAILED"):
            raise RuntimeError(f"The Ray Serve deployment failed: {app.message or 'no reason given'}")
        if time.monotonic() >= deadline:
            waiting = "; ".join(d.message for d in getattr(app, "deployments", {}).values() if d.message)
            raise RuntimeError(f"The deployment did not start within {timeout:g} s (--ray-start-timeout)"
                               f"{': ' + waiting if waiting else ''}; raise --ray-start-timeout if its replicas "
                               "were still loading, or ask for fewer replicas or resources than the cluster has free.")
        time.sleep(STATUS_POLL_S)


def _drain(key: str, seconds: float) -> None:
    """Drain every replica, then delete the app: each replica's engine stops taking requests and gives its
    answers ``seconds`` to finish, then ends those still open with an error event and [DONE] (``Engine.drain``).

    The request goes through Ray's key-value store, which every replica polls (``_await_drain``): a handle call
    reaches only the replica Ray's router picks, and a broadcast through ``reconfigure`` redeploys the app. Then
    ``serve.delete`` stops the replicas while the proxy still streams their answers, and Ray's graceful shutdown
    waits for each replica's open requests (``_shutdown_options``) before it stops it. ``serve.shutdown`` alone
    would kill the proxy at once, cutting every stream mid-body.
    """
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(key, str(seconds), namespace=KV_NAMESPACE)
    try:
        # Not serve.delete's own wait: it gives up after 60 s, and a drain may take longer.
        serve.delete(APP, _blocking=False)
        _wait_until_deleted(seconds + DRAIN_GRACE_S + 4 * DRAIN_POLL_S + 30)
    finally:
        internal_kv._internal_kv_del(key, namespace=KV_NAMESPACE)


def _wait_until_deleted(timeout: float) -> None:
    """Block until Serve has deleted the app (its replicas stopped) or ``timeout`` s have passed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        app = serve.status().applications.get(APP)
        if app is None or str(app.status).endswith("NOT_STARTED"):
            return
        time.sleep(STATUS_POLL_S)


def _serving() -> bool:
    """Whether a replica of the app runs: Ray's proxy sends it requests as soon as it does, which may be before the
    app is RUNNING (a signal then must drain the answers it streams, not cut them)."""
    try:
        app = serve.status().applications.get(APP)
    except _Stop:  # a second signal: stop at once
        return False
    except Exception:  # noqa: BLE001 - Serve cannot tell: nothing it serves is known
        return False
    deployments = getattr(app, "deployments", None) or {}
    return any(str(state).endswith("RUNNING") and count > 0
               for d in deployments.values() for state, count in (d.replica_states or {}).items())


def _drain_after_signal(spec: ReplicaSpec) -> None:
    """Drain every replica after SIGINT/SIGTERM (a second signal skips what is left of the drain)."""
    try:
        _drain(spec.drain_key, spec.settings.drain_seconds)
    except _Stop:
        pass


def _serve_until_signal(spec: ReplicaSpec) -> None:
    """Announce the server, wait for SIGINT/SIGTERM, then drain."""
    settings = spec.settings
    print(f"serving {spec.name} on http://{settings.host}:{settings.port}/v1 with Ray Serve", flush=True)
    try:
        while True:
            time.sleep(3600)
    except _Stop:
        _drain_after_signal(spec)


def run_on_ray(spec: ReplicaSpec, replicas: int = 1, address: str | None = None, gpus: float = 0.0,
               cpus: float = 1.0, autoscaling: dict[str, Any] | None = None, start_timeout: float = 1800.0) -> None:
    """Deploy on Ray (a cluster at ``address``, or an instance started here) and serve until SIGINT/SIGTERM.

    A signal before any replica runs stops at once (KeyboardInterrupt: the command says "interrupted"); one after a
    replica runs drains, even before the whole app runs (Ray's proxy sends requests to a replica once it runs); on a
    Ray started here a deployment that cannot fit is refused before it is placed; start-up gives up after
    ``start_timeout`` seconds (RuntimeError). A Ray started here dies with this process, even by SIGKILL
    (``ray_local.start_watchdog``).
    """
    import ray

    from .ray_local import start_watchdog

    spec = dataclasses.replace(spec, drain_key=f"drain-{uuid.uuid4().hex}")
    _on_signals(_raise_stop)
    serve_started = False
    try:
        try:
            if address is None:
                start_watchdog()
            _init_ray(address)
            if address is None:  # a cluster may add nodes (its autoscaler): only a Ray started here is all there is
                why = unfit(ray.cluster_resources(), _starting_replicas(replicas, autoscaling), cpus, gpus)
                if why:
                    raise RuntimeError(why)
            serve_started = True
            serve.start(http_options={"host": spec.settings.host, "port": spec.settings.port})
            serve._run(deployment(spec, replicas, gpus, cpus, autoscaling), name=APP, route_prefix="/",
                       _blocking=False)  # serve.run would wait without a deadline; _wait_until_running has one
            _wait_until_running(start_timeout)
        except _Stop:
            if not (serve_started and _serving()):
                raise KeyboardInterrupt from None
            _drain_after_signal(spec)  # a replica answers already: what it streams is drained, as once running
            return
        _serve_until_signal(spec)
    finally:
        _on_signals(signal.SIG_DFL)  # a signal during the clean-up ends the process; the watchdog finishes it
        if serve_started and address is not None:
            # A cluster's Serve, and the other applications on it, outlive this command: delete only this one (after
            # a drain it is gone already). A Ray started here ends with Serve in it.
            with contextlib.suppress(Exception):
                serve.delete(APP)
        ray.shutdown()
