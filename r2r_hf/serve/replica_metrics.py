"""``/metrics`` of a Ray Serve deployment: every replica's series on every scrape, each labelled ``replica``.

Ray's proxy hands each request, a scrape too, to one replica of its choosing, so a scrape that one replica answered
alone showed a random replica's counters (after 8 requests over two replicas: 7, 7, 1, 7 ...), which Prometheus reads
as counter resets. So each replica publishes its samples into a key-value store (Ray's, in the GCS) every
``PUBLISH_S`` and whenever it answers a scrape, and a scrape answers with every live replica's latest samples, each
series labelled with its replica. Whichever replica answers, a series only grows: each replica is the one writer of
its entry, and takes and writes its samples under one lock. A replica silent for ``STALE_S`` (killed, replaced) is
left out and its entry deleted; its successor's series start afresh under its own label.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

PREFIX = "metrics/"
PUBLISH_S = 1.0  # how often a replica publishes between scrapes: the other replicas' series are this old at most
STALE_S = 30.0


class Store(Protocol):
    """The key-value store replicas share (``RayStore``; a dict in tests)."""

    def put(self, key: str, value: str) -> None: ...

    def get(self, key: str) -> str | None: ...

    def keys(self, prefix: str) -> list[str]: ...

    def delete(self, key: str) -> None: ...


class RayStore:
    """Ray's internal key-value store (the GCS), in one namespace."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace

    def put(self, key: str, value: str) -> None:
        from ray.experimental import internal_kv

        internal_kv._internal_kv_put(key, value, overwrite=True, namespace=self.namespace)

    def get(self, key: str) -> str | None:
        from ray.experimental import internal_kv

        value = internal_kv._internal_kv_get(key, namespace=self.namespace)
        return None if value is None else value.decode()

    def keys(self, prefix: str) -> list[str]:
        from ray.experimental import internal_kv

        return [k.decode() if isinstance(k, bytes) else k
                for k in internal_kv._internal_kv_list(prefix, namespace=self.namespace)]

    def delete(self, key: str) -> None:
        from ray.experimental import internal_kv

        internal_kv._internal_kv_del(key, namespace=self.namespace)


class ReplicaMetrics:
    """One replica's side of the deployment's ``/metrics`` (see the module docstring).

    Args:
        metrics: the replica's ``ServeMetrics``.
        app: the Serve application (its replicas' entries share a prefix).
        replica: this replica's id, its series' ``replica`` label.
        store: where the replicas publish.
    """

    def __init__(self, metrics, app: str, replica: str, store: Store) -> None:
        self.metrics, self.replica, self.store = metrics, replica, store
        self.prefix = f"{PREFIX}{app}/"
        self._lock = threading.Lock()

    def publish(self) -> None:
        """Write this replica's current samples (taken under the lock: a later write never holds older ones)."""
        with self._lock:
            entry = {"at": time.time(), "families": _families(self.metrics.registry)}
            self.store.put(self.prefix + self.replica, json.dumps(entry))

    def run(self, alive: Callable[[], bool]) -> None:
        """Publish every ``PUBLISH_S`` while ``alive()`` (a daemon thread's loop), then remove this replica's entry."""
        while alive():
            with contextlib.suppress(Exception):  # the store briefly unreachable: the next round writes
                self.publish()
            time.sleep(PUBLISH_S)
        with contextlib.suppress(Exception):
            self.store.delete(self.prefix + self.replica)

    def text(self) -> bytes:
        """Every live replica's samples, each labelled with its replica, in the Prometheus text format."""
        from prometheus_client import generate_latest

        if self.metrics.registry is None:
            return self.metrics.text()  # says what to install
        self.publish()
        replicas, now = {}, time.time()
        for key in self.store.keys(self.prefix):
            raw = self.store.get(key)
            entry = json.loads(raw) if raw else None
            if entry is None or now - entry["at"] > STALE_S:
                with contextlib.suppress(Exception):
                    self.store.delete(key)
                continue
            replicas[key[len(self.prefix):]] = entry["families"]
        return generate_latest(_Labelled(replicas))


def _families(registry) -> list[dict[str, Any]]:
    """A registry's samples as plain values: name, help, type and (sample name, labels, value) of each family."""
    return [{"name": f.name, "help": f.documentation, "type": f.type,
             "samples": [[s.name, s.labels, s.value] for s in f.samples]} for f in registry.collect()]


class _Labelled:
    """A collector of every replica's published families, each sample labelled with its replica."""

    def __init__(self, replicas: dict[str, list[dict[str, Any]]]) -> None:
        self.replicas = replicas

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import Metric

        merged: dict[str, Metric] = {}
        for replica, families in sorted(self.replicas.items()):
            for f in families:
                family = merged.setdefault(f["name"], Metric(f["name"], f["help"], f["type"]))
                for name, labels, value in f["samples"]:
                    family.add_sample(name, {**labels, "replica": replica}, value)
        yield from merged.values()
