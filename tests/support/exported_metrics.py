"""The series redisbal's exporters really export, read from their registries in-process.

The coordinator's exporter (``redisbal.ops.coordinator_metrics.CoordinatorMetrics``) reads the
deployment from Redis at scrape time; here its collector reads a deployment state
made in the test instead (every meta counter, an open barrier, members, a snapshot
with KV usage, stalled, suspect and laggard engines), so that every family it can
export appears, with no Redis. The gateway's families come from a
``GatewayMetrics`` registry with one observation on each labelled metric.
Nothing here lists metric names: they are the exporters' own.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric

from redisbal.barrier.snapshot import Snapshot
from redisbal.gateway.metrics import GatewayMetrics
from redisbal.keys import DeploymentKeys
from redisbal.ops.coordinator import CoordinatorStats
from redisbal.ops.coordinator_metrics import (
    META_COUNTERS,
    CoordinatorMetrics,
    _CoordinatorCollector,
)
from redisbal.routing.router_core import RouterCore
from support.helpers import make_snapshot

# the sample names a family of each type exposes (prometheus_client strips _total
# and the like from the family name)
SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "summary": ("", "_count", "_sum", "_created"),
    "info": ("_info",),
    "unknown": ("",),
}


@dataclass
class Series:
    """Series names -> the label names seen on them."""

    labels: dict[str, set[str]] = field(default_factory=dict)

    def add(self, families: Iterable[Metric]) -> None:
        for fam in families:
            if not fam.samples:  # a labelled metric never used: what it would expose
                for suffix in SUFFIXES[fam.type]:
                    self.labels.setdefault(fam.name + suffix, set())
            for s in fam.samples:
                self.labels.setdefault(s.name, set()).update(s.labels)


def coordinator_state(snap: Snapshot) -> Any:
    """What ``_CoordinatorCollector._read`` returns: meta, snapshot, members, epoch, now."""
    meta = {f: "3" for f in META_COUNTERS}
    meta.update({"since": "999000", "behind": "1", "stale:e0": "1"})
    members = [(e, float(snap.time_ms)) for e in snap.engines]
    return meta, snap.raw, members, snap.epoch, float(snap.time_ms + 250)


def coordinator_registry(snap: Snapshot) -> CollectorRegistry:
    """A coordinator exporter's registry whose collector reads ``snap`` (no Redis)."""
    keys = DeploymentKeys("d")
    stats = CoordinatorStats(leader=True, fence=7, ticks=10)
    coord = SimpleNamespace(keys=keys, stats=stats, client=None, on_tick=None)
    registry = CollectorRegistry()
    CoordinatorMetrics(coord, registry)
    for collector in list(registry._collector_to_names):
        if isinstance(collector, _CoordinatorCollector):
            collector._read = lambda: coordinator_state(snap)  # type: ignore[method-assign]
    return registry


def full_snapshot() -> Snapshot:
    """A forced snapshot with every optional part: KV usage, laggards, stalled, suspect."""
    return make_snapshot(
        {"e0": (2, 3), "e1": (0, 1), "e2": (5, 0)},
        kv={"e0": 0.5, "e1": 0.25, "e2": 0.75},
        forced=True,
        laggards={"e2": 300},
        stalled={"e1": 2500},
        suspect={"e2": 1500},
    )


def gateway_registry() -> CollectorRegistry:
    m = GatewayMetrics({"d": RouterCore(client_index=0, client_count=1)}, lambda: 2.0)
    m.requests.labels("/v1/completions", "200").inc()
    m.errors.labels("connect").inc()
    m.retries.inc()
    m.retries_refused.inc()
    m.decision("e0")
    m.outcome("e0", "5xx")
    m.ejections.labels("e0").inc()
    m.observe_added(True, 0.001)
    m.observe_added(False, 0.002)
    return m.registry


def exported_series() -> Series:
    """Every series the coordinator's exporter and the gateway export, with labels."""
    out = Series()
    out.add(coordinator_registry(full_snapshot()).collect())
    out.add(gateway_registry().collect())
    return out
