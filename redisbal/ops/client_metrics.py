"""Prometheus metrics of the library's clients, routers and reporters, on a registry
the host application owns.

Needs the ``metrics`` extra (``pip install 'redisbal[metrics]'``, which brings
``prometheus_client``); importing this module without it raises ImportError
saying so. Nothing else in redisbal imports this module.

Routers: ``RouterMetrics(registry).bind(router)`` exposes the counters a router keeps
in ``router.core.counters`` (routes, degraded routes, pinned, snapshots adopted, old
versions ignored, epochs) and its snapshot age. Reporters:
``ReporterMetrics(registry).bind(reporter)`` exposes each engine's report counters.
Reading them costs nothing on the hot path: the collectors read the counters at
scrape time.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

try:
    from prometheus_client import CollectorRegistry
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
    from prometheus_client.registry import Collector
except ImportError as exc:  # pragma: no cover - exercised by a test with the module hidden
    raise ImportError(
        "redisbal.ops.client_metrics needs prometheus_client: pip install 'redisbal[metrics]'",
        name="prometheus_client",
    ) from exc

__all__ = ["REPORTER_COUNTERS", "ROUTER_COUNTERS", "ReporterMetrics", "RouterMetrics"]


# -- routers ----------------------------------------------------------------------------------


ROUTER_COUNTERS = {
    "routes": "Requests routed.",
    "degraded_routes": "Requests routed without a fresh snapshot (Redis gone or feed stale).",
    "pinned": "Requests pinned to an engine by the caller.",
    "snapshots": "Snapshots adopted.",
    "ignored_old": "Snapshots ignored as older than the current one within its epoch.",
    "epochs": "Epoch changes adopted (Redis state was reset).",
    "rejoin_dropped": "Engines known before an epoch change that did not re-register in time.",
    "failed": "Requests the caller reported failed at their engine (failed()).",
    "stalled": "Streams the caller reported stopped mid-way at their engine (stalled()).",
    "restarts": "Engines seen with a new incarnation (a restarted process).",
    "all_excluded_routes": "Requests routed while every engine was stalled or suspect.",
    "roster_fetches": "Compact snapshots whose roster was not seen: the stored one was read.",
    "malformed": "Snapshots ignored as malformed (a field missing or of the wrong type or range).",
}


class _Bound:
    """The objects a registry exports the metrics of: bound and unbound from any
    thread, read at scrape time."""

    def __init__(self) -> None:
        self._items: list[Any] = []
        self._lock = threading.Lock()

    def add(self, obj: Any) -> None:
        with self._lock:
            if obj not in self._items:
                self._items.append(obj)

    def remove(self, obj: Any) -> None:
        with self._lock:
            if obj in self._items:
                self._items.remove(obj)

    def items(self) -> list[Any]:
        with self._lock:
            return list(self._items)


class RouterMetrics:
    """Client-side router metrics on a registry the host application passes in.

    >>> metrics = RouterMetrics(registry)         # once per registry
    >>> metrics.bind(router)                      # each Router / AsyncRouter

    Labels: ``deployment`` and ``client_index``. Values are read at scrape time.
    """

    def __init__(self, registry: CollectorRegistry, prefix: str = "redisbal_router") -> None:
        self.prefix = prefix
        self._bound = _Bound()
        registry.register(_RouterCollector(self))

    def bind(self, router: Any) -> Any:
        """Export ``router``'s metrics (a Router or AsyncRouter); returns it."""
        self._bound.add(router)
        return router

    def unbind(self, router: Any) -> None:
        self._bound.remove(router)

    def routers(self) -> list[Any]:
        return self._bound.items()


def _router_deployment(router: Any) -> str:
    inner = getattr(router, "_inner", router)  # Router wraps an AsyncRouter
    return str(inner.keys.deployment)


class _RouterCollector(Collector):
    def __init__(self, owner: RouterMetrics) -> None:
        self.owner = owner

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        p = self.owner.prefix
        labels = ["deployment", "client_index"]
        counters = {
            k: CounterMetricFamily(f"{p}_{k}", doc, labels=labels)
            for k, doc in ROUTER_COUNTERS.items()
        }
        gauges = {
            "snapshot_age_seconds": GaugeMetricFamily(
                f"{p}_snapshot_age_seconds",
                "Seconds since this router adopted its current snapshot (local clock).",
                labels=labels,
            ),
            "snapshot_version": GaugeMetricFamily(
                f"{p}_snapshot_version", "Version of the router's current snapshot.", labels=labels
            ),
            "degraded": GaugeMetricFamily(
                f"{p}_degraded", "1 while routing without a fresh snapshot.", labels=labels
            ),
            "connected": GaugeMetricFamily(
                f"{p}_connected", "1 while the snapshot feed is connected.", labels=labels
            ),
            "engines": GaugeMetricFamily(
                f"{p}_engines", "Engines the router routes to.", labels=labels
            ),
        }
        for router in self.owner.routers():
            core = router.core
            lv = [_router_deployment(router), str(core.client_index)]
            snapshot_counters = dict(core.counters)
            for k, fam in counters.items():
                fam.add_metric(lv, float(snapshot_counters.get(k, 0)))
            if core.snapshot is not None:
                gauges["snapshot_age_seconds"].add_metric(lv, core.clock() - core.snapshot_at)
                gauges["snapshot_version"].add_metric(lv, core.snapshot.version)
            gauges["degraded"].add_metric(lv, float(core.degraded))
            gauges["connected"].add_metric(lv, float(core.connected))
            gauges["engines"].add_metric(lv, float(len(core.engines)))
        yield from counters.values()
        yield from gauges.values()


REPORTER_COUNTERS = {
    "queued": "Reports handed to the sender.",
    "sent": "Reports (and heartbeats) that reached Redis.",
    "stale": "Reports refused as older than the engine's latest.",
    "conflict": "Reports refused: a process started later reports under this engine id.",
    "coalesced": "Reports replaced by newer counts before they were sent.",
    "unavailable": "Sends that failed on a Redis outage (retried by the sender).",
    "errors": "Sends Redis refused for another reason (not retried).",
    "dropped": "Reports never sent (handed over after close, or left at close).",
}


class ReporterMetrics:
    """Engine-side reporter metrics on a registry the host application passes in:
    ``ReporterMetrics(registry).bind(reporter)`` for each Reporter or AsyncReporter.
    Labels: ``deployment`` and ``engine`` (each of the reporter's engines, at scrape time)."""

    def __init__(self, registry: CollectorRegistry, prefix: str = "redisbal_reporter") -> None:
        self.prefix = prefix
        self._bound = _Bound()
        registry.register(_ReporterCollector(self))

    def bind(self, reporter: Any) -> Any:
        """Export ``reporter``'s metrics (a Reporter or AsyncReporter); returns it."""
        self._bound.add(reporter)
        return reporter

    def reporters(self) -> list[Any]:
        return self._bound.items()


class _ReporterCollector(Collector):
    def __init__(self, owner: ReporterMetrics) -> None:
        self.owner = owner

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        p, labels = self.owner.prefix, ["deployment", "engine"]
        fams = {
            k: CounterMetricFamily(f"{p}_reports_{k}", doc, labels=labels)
            for k, doc in REPORTER_COUNTERS.items()
        }
        for rep in self.owner.reporters():
            for engine in rep.engines:
                stats = rep.stats(engine)
                for k, fam in fams.items():
                    fam.add_metric([rep.keys.deployment, engine], float(getattr(stats, k)))
        yield from fams.values()
