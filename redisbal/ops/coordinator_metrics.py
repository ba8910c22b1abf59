"""The coordinator's Prometheus exporter and the small HTTP server it is served on.

Needs the ``metrics`` extra (``pip install 'redisbal[metrics]'``, which brings
``prometheus_client``); importing this module without it raises ImportError
saying so. Nothing else in redisbal imports this module.

Coordinator (``redisbal coordinator --metrics-port``, or
:func:`serve_coordinator_metrics` in your own process): two sources.

- On every scrape a collector reads the deployment from Redis (one pipeline:
  meta hash, the barrier fields, snapshot, members, epoch; plus TIME), so the gauges and counters
  are as fresh as the scrape and a standby coordinator exports them too. A
  scrape that cannot reach Redis reports ``redisbal_up 0`` and nothing else
  from Redis.
- The barrier-wait histogram needs every snapshot, not the one present at
  scrape time: the coordinator's ``on_tick`` hook (every tick of the lease
  holder, every 20-50 ms; at most every ``sample_interval_s``) samples the
  stored snapshot, and so does each scrape.
  Each new cut is observed once (idle republishes of the same cut are not).
  When snapshots are published faster than the coordinator ticks, the
  histogram is a sample of them.

The counters come from the deployment's meta hash, which the barrier scripts
keep; a new epoch (Redis restart without persistence, failover to a lagging
replica) starts them from zero, which Prometheus treats as a counter reset.

Routers' and reporters' metrics, on the host application's registry, are in
``client_metrics``.
"""

from __future__ import annotations

import contextlib
import logging
import socketserver
import threading
import time
from collections.abc import Iterator
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

try:
    from prometheus_client import CollectorRegistry, Histogram, make_wsgi_app
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
    from prometheus_client.registry import Collector
except ImportError as exc:  # pragma: no cover - exercised by a test with the module hidden
    raise ImportError(
        "redisbal.ops.coordinator_metrics needs prometheus_client: pip install 'redisbal[metrics]'",
        name="prometheus_client",
    ) from exc

from redisbal.barrier.snapshot import Snapshot
from redisbal.connection import redact

log = logging.getLogger("redisbal.ops.coordinator_metrics")

__all__ = [
    "BARRIER_WAIT_BUCKETS",
    "CoordinatorMetrics",
    "MetricsServer",
    "barrier_wait_s",
    "imbalance",
    "serve_coordinator_metrics",
]

# barrier waits are a few ms when engines step together, up to stall_ms (250 ms by
# default) when one lags, more when the stall guard is off or slow
BARRIER_WAIT_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip

# meta hash field -> (metric name without prefix, help)
META_COUNTERS = {
    "published": ("snapshots_published", "Snapshots published by a complete barrier."),
    "forced": ("snapshots_forced", "Snapshots force-published by the stall guard."),
    "stale": ("reports_stale", "Reports rejected as older than the engine's latest."),
    "late": ("reports_late", "Reports for an already-published step (accepted, no republish)."),
    "joined": ("engines_joined", "Engines that joined (first report in the epoch)."),
    "expired": ("engines_expired", "Engines expired after dead_after_ms without a report."),
    "left": ("engines_left", "Engines that left gracefully."),
    "restarted": ("engines_restarted", "Engines whose record a later process replaced."),
    "conflicts": (
        "reports_conflict",
        "Reports refused: an earlier process reports under an engine id a later one took.",
    ),
    "stalled": ("engines_stalled", "Times an engine with work stopped progressing."),
    "suspected": ("engines_suspected", "Suspect marks set by routers (failed())."),
    "recovered": (
        "engines_recovered",
        "Suspect marks cleared by a router whose probe the engine answered.",
    ),
    "suspect_capped": (
        "suspect_capped",
        "Suspect marks refused because half of the engines were suspect already.",
    ),
}


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def imbalance(snap: Snapshot) -> float:
    """(max - mean) / mean of per-engine load (waiting + running); 0 with no load."""
    loads = [c.load for c in snap.engines.values()]
    if not loads:
        return 0.0
    mean = sum(loads) / len(loads)
    return (max(loads) - mean) / mean if mean > 0 else 0.0


def barrier_wait_s(snap: Snapshot) -> float | None:
    """Seconds from the oldest counts at the snapshot's cut to its publication: how
    long the barrier held the step open, and how long a heartbeat re-sent an engine's
    last counts (a report's time is when its counts were made).

    Only engines with work count: an idle engine's counts stand for as long as it
    stays idle (a same-step refresh moves an engine's report time later, so this
    never over-states the wait). None when no engine with work reported the cut step.
    A compact snapshot does not say each engine's step: there every engine with work
    but the stalled ones counts.
    """
    if snap.roster is not None:
        at_cut = [c for e, c in snap.engines.items() if e not in snap.stalled]
    else:
        at_cut = [c for c in snap.engines.values() if (c.wave, c.step) == snap.cut]
    times = [c.reported_ms for c in at_cut if c.waiting or c.running]
    if not times:
        return None
    return max(0.0, (snap.time_ms - min(times)) / 1000.0)


class CoordinatorMetrics:
    """Metrics of one deployment, for the coordinator process (see the module doc).

    ``registry``: where to register (a private CollectorRegistry by default).
    Call :meth:`sample` often (``attach()`` hooks it on the coordinator's ticks).
    """

    def __init__(
        self,
        coordinator: Any,
        registry: CollectorRegistry | None = None,
        *,
        sample_interval_s: float = 0.05,
    ) -> None:
        self.coordinator = coordinator
        # at most one snapshot GET per interval from on_tick (large deployments have
        # large snapshots); scrapes always sample
        self.sample_interval_s = sample_interval_s
        self._next_sample = 0.0
        self.deployment: str = coordinator.keys.deployment
        self.registry = registry if registry is not None else CollectorRegistry()
        self._lock = threading.Lock()
        self._last_cut: tuple[str, int, int] | None = None  # epoch, wave, step
        self.sample_errors = 0
        # registered before the histogram: a scrape observes the current snapshot
        # first, so the histogram it then reports already includes it
        self.registry.register(_CoordinatorCollector(self))
        self.barrier_wait = Histogram(
            "redisbal_barrier_wait_seconds",
            "Age of a published cut's oldest counts of an engine with work: the time "
            "its barrier was open, and any time a heartbeat re-sent the counts (sampled "
            "per coordinator tick and per scrape).",
            ["deployment"],
            buckets=BARRIER_WAIT_BUCKETS,
            registry=self.registry,
        )
        self.barrier_wait.labels(self.deployment)  # exported (as zeros) before the first cut

    def attach(self) -> CoordinatorMetrics:
        """Sample on every coordinator tick (chains any on_tick already set)."""
        previous = self.coordinator.on_tick

        def on_tick(coord: Any) -> None:
            if previous is not None:
                previous(coord)
            now = time.monotonic()
            if now >= self._next_sample:
                self._next_sample = now + self.sample_interval_s
                self.sample()

        self.coordinator.on_tick = on_tick
        return self

    def sample(self) -> None:
        """Read the stored snapshot and observe its barrier wait if it is a new cut.

        Never raises: a metrics problem must not disturb the coordinator.
        """
        try:
            raw = self.coordinator.client.get(self.coordinator.keys.snapshot)
            if raw:
                self.observe(Snapshot.from_json(raw))
        except Exception as exc:  # see the docstring
            self.sample_errors += 1
            log.debug("metrics sample failed: %s", redact(str(exc)))

    def observe(self, snap: Snapshot) -> None:
        cut = (snap.epoch, snap.wave, snap.step)
        with self._lock:
            if cut == self._last_cut:
                return
            self._last_cut = cut
        wait = barrier_wait_s(snap)
        if wait is not None:
            self.barrier_wait.labels(self.deployment).observe(wait)


class _CoordinatorCollector(Collector):
    """Reads the deployment's state from Redis at scrape time."""

    def __init__(self, owner: CoordinatorMetrics) -> None:
        self.owner = owner

    def describe(self) -> list[Metric]:
        return []  # collected dynamically: do not call collect() at registration

    def collect(self) -> Iterator[Metric]:
        o = self.owner
        dep = o.deployment
        coord = o.coordinator
        stats = coord.stats
        lab = ["deployment"]

        def gauge(name: str, doc: str, value: float, labels: list[str] | None = None) -> Metric:
            g = GaugeMetricFamily(f"redisbal_{name}", doc, labels=labels or lab)
            g.add_metric([dep], value)
            return g

        def counter(name: str, doc: str, value: float) -> Metric:
            c = CounterMetricFamily(f"redisbal_{name}", doc, labels=lab)
            c.add_metric([dep], value)
            return c

        yield gauge("coordinator_leader", "1 while this coordinator holds the lease.", stats.leader)
        yield gauge("coordinator_fence", "Fence of this coordinator's lease.", stats.fence)
        yield counter("coordinator_ticks", "Coordinator rounds run.", stats.ticks)
        yield counter("coordinator_errors", "Coordinator rounds that failed.", stats.errors)
        yield counter(
            "coordinator_forced", "Snapshots this coordinator force-published.", stats.forced
        )
        yield counter("coordinator_expired", "Engines this coordinator expired.", stats.expired)
        yield counter(
            "coordinator_epochs_started",
            "New epochs this coordinator started after the Redis server changed.",
            stats.epochs_started,
        )
        try:
            state = self._read()
        except Exception as exc:  # a scrape reports Redis as down, never fails
            log.warning("metrics: cannot read %s from Redis: %s", dep, redact(str(exc)))
            yield gauge("up", "1 when the last scrape could read the deployment.", 0)
            return
        yield gauge("up", "1 when the last scrape could read the deployment.", 1)
        meta, raw, members, epoch, now_ms = state
        for field, (name, doc) in META_COUNTERS.items():
            yield counter(name, doc + " Resets with a new epoch.", float(meta.get(field, 0) or 0))
        info = GaugeMetricFamily(
            "redisbal_epoch_info",
            "Current epoch of the deployment's state.",
            labels=[*lab, "epoch"],
        )
        info.add_metric([dep, epoch], 1)
        yield info
        yield gauge("engines_live", "Member engines (reporting, not expired).", len(members))
        since = meta.get("since")
        yield gauge(
            "barrier_open_seconds",
            "How long the current barrier has waited for its slowest engine (0: none open).",
            max(0.0, (now_ms - float(since)) / 1000.0) if since else 0.0,
        )
        if "behind" in meta:
            yield gauge(
                "barrier_behind",
                "Barrier members that have not yet reported past the published step.",
                float(meta["behind"] or 0),
            )
        age = GaugeMetricFamily(
            "redisbal_engine_heartbeat_age_seconds",
            "Seconds since each member engine's liveness was last refreshed (by a report "
            "or heartbeat; refreshed at least every dead_after_ms / 8 while it reports).",
            labels=[*lab, "engine"],
        )
        stale = CounterMetricFamily(
            "redisbal_engine_reports_stale",
            "Stale reports per engine. Resets with a new epoch.",
            labels=[*lab, "engine"],
        )
        for engine, seen_ms in members:
            age.add_metric([dep, engine], max(0.0, (now_ms - seen_ms) / 1000.0))
            stale.add_metric([dep, engine], float(meta.get(f"stale:{engine}", 0) or 0))
        yield age
        yield stale
        if not raw:
            return
        snap = Snapshot.from_json(raw)
        o.observe(snap)
        yield gauge("snapshot_version", "Version of the latest snapshot.", snap.version)
        yield gauge(
            "snapshot_age_seconds",
            "Seconds since the latest snapshot was published (Redis server time).",
            max(0.0, (now_ms - snap.time_ms) / 1000.0),
        )
        yield gauge("snapshot_forced", "1 when the latest snapshot was forced.", snap.forced)
        yield gauge(
            "snapshot_laggards", "Engines the latest (forced) snapshot names as laggards.",
            len(snap.laggards),
        )  # fmt: skip
        yield gauge(
            "snapshot_stalled",
            "Engines the latest snapshot marks stalled (work, no progress: not routed to).",
            len(snap.stalled),
        )
        yield gauge(
            "snapshot_suspect",
            "Engines the latest snapshot marks suspect (failed() by a router: not routed to).",
            len(snap.suspect),
        )
        yield gauge(
            "imbalance",
            "(max - mean) / mean of per-engine waiting + running in the latest snapshot.",
            imbalance(snap),
        )
        per_engine = {
            "waiting": ("redisbal_engine_waiting", "Waiting requests per engine (snapshot)."),
            "running": ("redisbal_engine_running", "Running requests per engine (snapshot)."),
            "kv_usage": ("redisbal_engine_kv_usage", "KV-cache usage per engine, 0..1 (snapshot)."),
        }
        families = {
            k: GaugeMetricFamily(name, doc, labels=[*lab, "engine"])
            for k, (name, doc) in per_engine.items()
        }
        for engine, c in sorted(snap.engines.items()):
            families["waiting"].add_metric([dep, engine], c.waiting)
            families["running"].add_metric([dep, engine], c.running)
            if c.kv_usage is not None:
                families["kv_usage"].add_metric([dep, engine], c.kv_usage)
        yield from families.values()

    def _read(self) -> tuple[dict[str, str], bytes | None, list[tuple[str, float]], str, float]:
        coord = self.owner.coordinator
        keys = coord.keys
        client = coord.client
        pipe = client.pipeline(transaction=False)
        pipe.hgetall(keys.meta)
        pipe.get(keys.snapshot)
        pipe.zrange(keys.members, 0, -1, withscores=True)
        pipe.get(keys.epoch)
        pipe.hmget(keys.reports, ".since", ".behind")  # the barrier's hot fields
        meta_raw, raw, members_raw, epoch, hot = pipe.execute()
        sec, usec = client.time()
        now_ms = int(sec) * 1000 + int(usec) / 1000.0
        meta = {_s(k): _s(v) for k, v in (meta_raw or {}).items()}
        meta.update({k: _s(v) for k, v in zip(("since", "behind"), hot, strict=True) if v})
        members = [(_s(e), float(t)) for e, t in members_raw or []]
        return meta, raw, members, _s(epoch or ""), now_ms


# -- HTTP server ------------------------------------------------------------------------------


class _ThreadingWSGIServer(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """No access log on stderr."""


class MetricsServer:
    """A running /metrics endpoint; ``shutdown()`` stops it."""

    def __init__(self, registry: CollectorRegistry, port: int, addr: str = "127.0.0.1") -> None:
        self.registry = registry
        self._httpd = make_server(
            addr,
            port,
            make_wsgi_app(registry),
            server_class=_ThreadingWSGIServer,
            handler_class=_QuietHandler,
        )
        self.addr = addr
        self.port = int(self._httpd.server_port)
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, daemon=True, name="redisbal-metrics"
        )
        self._thread.start()
        self.metrics: CoordinatorMetrics | None = None

    @property
    def url(self) -> str:
        return f"http://{self.addr}:{self.port}/metrics"

    def shutdown(self) -> None:
        with contextlib.suppress(Exception):
            self._httpd.shutdown()
            self._httpd.server_close()
        self._thread.join(timeout=5)

    close = shutdown


def serve_coordinator_metrics(
    coordinator: Any, port: int, addr: str = "127.0.0.1"
) -> MetricsServer:
    """Serve the coordinator's metrics at http://addr:port/metrics on a private registry.

    Hooks :meth:`CoordinatorMetrics.sample` on the coordinator's ticks. Returns the
    server (``.shutdown()`` to stop; ``.port`` is the bound port, useful with port 0).
    """
    registry = CollectorRegistry()
    metrics = CoordinatorMetrics(coordinator, registry).attach()
    server = MetricsServer(registry, port, addr)
    server.metrics = metrics
    log.info("metrics for %s on %s", metrics.deployment, server.url)
    return server
