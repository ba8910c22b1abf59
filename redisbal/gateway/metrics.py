"""The gateway's Prometheus metrics (its own registry, served on ``GET /metrics``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from redisbal.routing.estimates import room
from redisbal.routing.router_core import RouterCore

# added latency is sub-millisecond when all is well: fine buckets there
LATENCY_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.00075,
    0.001,
    0.0015,
    0.002,
    0.003,
    0.005,
    0.0075,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    1.0,
)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class GatewayMetrics:
    """Counters the proxy bumps, and gauges read from the router when scraped."""

    def __init__(
        self,
        routers: Mapping[str, RouterCore],
        inflight: Callable[[], float],
        by_deployment: bool = False,
        held: Callable[[], float] = lambda: 0.0,
    ) -> None:
        """``routers``: each deployment's router state by name; ``by_deployment``: its
        gauges are labelled with the deployment (several behind the gateway), else the
        one deployment's are unlabelled."""
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "redisbal_gateway_requests",
            "Requests answered, by path and HTTP status.",
            ["path", "status"],
            registry=r,
        )
        self.errors = Counter(
            "redisbal_gateway_errors",
            "Failed attempts and requests by reason: what an engine did (connect, reset, "
            "5xx, 429, first_byte_timeout, idle_timeout, timeout; retried when nothing "
            "was sent yet), client_disconnect (the client left before the end), "
            "no_engine, bad_request, too_large, body_timeout (its body came too slowly), "
            "overloaded (past --max-concurrent-requests).",
            ["reason"],
            registry=r,
        )
        self.retries = Counter(
            "redisbal_gateway_retries", "Requests retried on another engine.", registry=r
        )
        self.retries_refused = Counter(
            "redisbal_gateway_retries_refused",
            "Retries not made: the retry budget (a share of recent requests) was spent.",
            registry=r,
        )
        self.outcomes = Counter(
            "redisbal_gateway_engine_outcomes",
            "Attempts per engine by how they ended: ok, rejected (a 4xx), "
            "client_disconnect, or a failure kind (connect, reset, 5xx, 429, "
            "first_byte_timeout, idle_timeout, timeout).",
            ["engine", "outcome"],
            registry=r,
        )
        self.abandoned = Counter(
            "redisbal_gateway_abandoned",
            "Attempts this gateway gave up on while the engine still had them "
            "(first_byte_timeout, idle_timeout, timeout): their connection is dropped, "
            "which the engine takes as the client leaving and aborts; work it did before "
            "is lost, and a retry elsewhere does it again.",
            ["engine", "reason"],
            registry=r,
        )
        self.ejections = Counter(
            "redisbal_gateway_ejections",
            "Engines this gateway ejected on the outcome of its requests (and told the "
            "deployment of).",
            ["engine"],
            registry=r,
        )
        self.decisions = Counter(
            "redisbal_gateway_decisions", "Route decisions per engine.", ["engine"], registry=r
        )
        self.probes = Counter(
            "redisbal_gateway_probes",
            "Probes of engines whose ejection ended (copies of requests routed elsewhere, "
            "their answers dropped), by how they ended: answered (the engine is routed to "
            "again), unproven (the answer ended before the point where its streams "
            "stalled), rejected (a 4xx), cancelled, or a failure kind (it stays ejected).",
            ["engine", "outcome"],
            registry=r,
        )
        self.cache_routes = Counter(
            "redisbal_gateway_cache_routes",
            "Route decisions that followed a match in the engines' prefix caches "
            "(--prefix-tokens): to the engine holding the prompt's deepest prefix.",
            registry=r,
        )
        self.cache_tokens = Counter(
            "redisbal_gateway_cache_matched_tokens",
            "Prompt tokens those engines held (what their prefill may skip), summed.",
            registry=r,
        )
        self.added = Histogram(
            "redisbal_gateway_added_latency_seconds",
            "Time the gateway itself adds: before the upstream request and between the "
            "upstream's first byte and the client's (non-streaming: the whole response).",
            ["stream"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.hold = Histogram(
            "redisbal_gateway_hold_seconds",
            "How long requests were held while every engine was at its running cap "
            "(--hold-s; only the requests held).",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0),
            registry=r,
        )
        labels = ["deployment"] if by_deployment else []
        age = Gauge(
            "redisbal_gateway_snapshot_age_seconds",
            "Seconds since the router adopted its latest snapshot (-1: none yet).",
            labels,
            registry=r,
        )
        index = Gauge(
            "redisbal_gateway_client_index", "This gateway's API-server index.", labels, registry=r
        )
        count = Gauge(
            "redisbal_gateway_client_count", "API servers of the deployment.", labels, registry=r
        )
        told = Gauge(
            "redisbal_gateway_routes_told",
            "1 while every other router of the deployment tells its routes (counted as "
            "told); 0 while they are estimated from this router's share.",
            labels,
            registry=r,
        )
        for name, core in routers.items():
            values = (name,) if by_deployment else ()

            def _age(core: RouterCore = core) -> float:
                return monotonic_age(core.snapshot_at)

            def _index(core: RouterCore = core) -> float:
                return core.client_index

            def _count(core: RouterCore = core) -> float:
                return core.client_count

            def _told(core: RouterCore = core) -> float:
                return float(core.told_routes.live)

            for gauge, fn in ((age, _age), (index, _index), (count, _count), (told, _told)):
                (gauge.labels(*values) if values else gauge).set_function(fn)
        r.register(RoomCollector(routers, by_deployment))
        Gauge("redisbal_gateway_inflight", "Requests being proxied now.", registry=r).set_function(
            inflight
        )
        Gauge(
            "redisbal_gateway_held", "Requests held now (--hold-s; part of inflight).", registry=r
        ).set_function(held)
        # children resolved once: labels() costs a dict lookup and a lock per call
        self._added = {True: self.added.labels("true"), False: self.added.labels("false")}
        self._children: dict[tuple[Counter, tuple[str, ...]], Counter] = {}

    def _inc(self, counter: Counter, *values: str) -> None:
        c = self._children.get((counter, values))
        if c is None:
            c = self._children[(counter, values)] = counter.labels(*values)
        c.inc()

    def decision(self, engine_id: str) -> None:
        self._inc(self.decisions, engine_id)

    def probe(self, engine_id: str, outcome: str) -> None:
        self._inc(self.probes, engine_id, outcome)

    def cache_route(self, tokens: int) -> None:
        """A route that followed a cache match of ``tokens`` prompt tokens."""
        self.cache_routes.inc()
        self.cache_tokens.inc(tokens)

    def outcome(self, engine_id: str, kind: str) -> None:
        self._inc(self.outcomes, engine_id, kind)

    def abandon(self, engine_id: str, kind: str) -> None:
        self._inc(self.abandoned, engine_id, kind)

    def answered(self, path: str, status: int | str) -> None:
        """A request to ``path`` answered with ``status``."""
        self._inc(self.requests, path, str(status))

    def observe_added(self, stream: bool, seconds: float) -> None:
        self._added[stream].observe(max(0.0, seconds))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RoomCollector(Collector):
    """What the router learned of the engines, read when scraped: the running cap and
    each engine's room as holding reads them (``routing.estimates.room``), so that an
    operator sees why requests are held, or why none are; and how many anchors of each
    engine's prefix cache its view holds (``--prefix-tokens``), so that one sees which
    engines' caches it matches prompts with."""

    def __init__(self, routers: Mapping[str, RouterCore], by_deployment: bool) -> None:
        self.routers = routers
        self.by_deployment = by_deployment

    def describe(self) -> Iterator[Metric]:
        return iter(self._families())

    def collect(self) -> Iterator[Metric]:
        cap, rooms, anchors = self._families()
        for name, core in self.routers.items():
            dep = [name] if self.by_deployment else []
            with core.lock:
                cap.add_metric(dep, float(core.running_cap))
                c, w = core.running_cap, core.pending_weight
                for e in core.known:
                    rooms.add_metric([*dep, e.engine_id], room(e, c, w))
            # (the view's reader runs on this loop: no change while this reads it)
            for eid, held in list(core.cache_view.engines.items()):
                anchors.add_metric([*dep, eid], float(len(held)))
        yield cap
        yield rooms
        yield anchors

    def _families(self) -> tuple[GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily]:
        dep = ["deployment"] if self.by_deployment else []
        cap = GaugeMetricFamily(
            "redisbal_gateway_running_cap",
            "The engines' running cap as this router learned it from their reports "
            "(a queue that outlived a report; 0: not learned yet).",
            labels=dep,
        )
        rooms = GaugeMetricFamily(
            "redisbal_gateway_engine_room",
            "Requests each engine would run now without queueing one, as this router "
            "reads it: its free slots under the running cap and its KV room, less what "
            "is on its way to it (+Inf: nothing bounds it, so nothing is held; <= 0 on "
            "every engine, none of them KV-bound (its cache holding fewer than half "
            "its cap): requests are held, --hold-s).",
            labels=[*dep, "engine"],
        )
        anchors = GaugeMetricFamily(
            "redisbal_gateway_cache_anchors",
            "Anchors (one per 64 prompt tokens) of each engine's prefix cache in this "
            "router's view, read from what `redisbal kv-events` writes, else learned from "
            "the gateways' routes (--prefix-tokens).",
            labels=[*dep, "engine"],
        )
        return cap, rooms, anchors


def monotonic_age(applied_at: float) -> float:
    """Age of something applied at ``applied_at`` (time.monotonic), -1 if never."""
    return -1.0 if applied_at == float("-inf") else time.monotonic() - applied_at
