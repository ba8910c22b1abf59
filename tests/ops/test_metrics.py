"""Prometheus metrics: the coordinator exporter scraped over HTTP on a real Redis, the
CLI's --metrics-port, router metrics on a caller's registry, and the missing-extra error."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from support.cli import REDISBAL, scrubbed_env
from support.helpers import wait_until
from support.prometheus import scrape, val

import redisbal
from redisbal import Counts
from redisbal.barrier.operations import Scripts, report_reply
from redisbal.barrier.snapshot import Snapshot
from redisbal.keys import DeploymentKeys
from redisbal.ops.client_metrics import RouterMetrics
from redisbal.ops.coordinator import Coordinator, CoordinatorConfig
from redisbal.ops.coordinator_metrics import imbalance, serve_coordinator_metrics
from redisbal.sim.embedded import RedisServer, free_port


def test_coordinator_exporter_over_http(redis_url: str, deployment: str) -> None:
    """Counters, per-engine gauges, imbalance, snapshot age and the barrier-wait
    histogram match what the scripts did, read over HTTP from the exporter."""
    started = time.monotonic()  # no age or wait below can be longer than the test
    cfg = CoordinatorConfig(join_grace_ms=0, stall_ms=100, idle_publish_ms=60_000)
    coord = Coordinator(redis_url, deployment, cfg, interval_s=0.02)
    server = serve_coordinator_metrics(coord, free_port())
    assert server.metrics is not None
    server.metrics.sample_interval_s = 0.0  # sample at every tick: every cut below is seen
    e0 = redisbal.Reporter(redis_url, deployment, "e0", heartbeat=False)
    e1 = redisbal.Reporter(redis_url, deployment, "e1", heartbeat=False)
    d = {"deployment": deployment}
    try:
        coord.tick()
        e0.register(wait=True)  # idempotent (a blocking reporter registers when built)
        e1.register(wait=True)
        e0.report(Counts(step=1, waiting=1, running=2), wait=True)
        assert e1.report(Counts(step=1, waiting=5, running=0), wait=True).version == 1
        coord.tick()  # samples cut 1
        e0.report(Counts(step=2, waiting=2, running=2), wait=True)
        time.sleep(0.15)  # the barrier for step 2 stays open >= 150 ms
        assert e1.report(Counts(step=2, waiting=6, running=1), wait=True).version == 2
        coord.tick()  # samples cut 2
        # an older step: the reporter refuses it itself (never sent); sent around it, by
        # the same process (its incarnation), the barrier refuses it
        assert e1.report(Counts(step=1, waiting=9, running=9), wait=True).status == "stale"
        raw = Scripts(coord.client, DeploymentKeys(deployment)).call(
            "report", "ep", "e1", 0, 1, 9, 9, "", "", e1.incarnation, "1"
        )
        assert report_reply(raw)[0] == "stale"
        e0.report(Counts(step=3, waiting=3, running=3), wait=True)
        wait_until(lambda: (coord.tick(), coord.stats.forced)[1] == 1, 10, "a forced snapshot")
        late = e1.report(Counts(step=3, waiting=7, running=1), wait=True)
        assert late.accepted  # late: step 3 is published

        m = scrape(server.url)
        assert val(m, "redisbal_up", **d) == 1
        assert val(m, "redisbal_coordinator_leader", **d) == 1
        assert val(m, "redisbal_snapshots_published_total", **d) == 2
        assert val(m, "redisbal_snapshots_forced_total", **d) == 1
        assert val(m, "redisbal_reports_stale_total", **d) == 1
        assert val(m, "redisbal_reports_late_total", **d) == 1
        assert val(m, "redisbal_engine_reports_stale_total", engine="e1", **d) == 1
        assert val(m, "redisbal_engine_reports_stale_total", engine="e0", **d) == 0
        assert val(m, "redisbal_engines_live", **d) == 2
        # both engines are at step 3 = the published step: the next cut waits for both
        assert val(m, "redisbal_barrier_behind", **d) == 2
        assert val(m, "redisbal_snapshot_version", **d) == 3
        assert val(m, "redisbal_snapshot_forced", **d) == 1
        assert val(m, "redisbal_snapshot_laggards", **d) == 1
        # the forced cut at step 3 has e0's step-3 counts and e1's step-2 counts
        assert val(m, "redisbal_engine_waiting", engine="e0", **d) == 3
        assert val(m, "redisbal_engine_running", engine="e0", **d) == 3
        assert val(m, "redisbal_engine_waiting", engine="e1", **d) == 6
        assert val(m, "redisbal_engine_running", engine="e1", **d) == 1
        snap = Snapshot.from_json(coord.client.get(DeploymentKeys(deployment).snapshot))
        assert val(m, "redisbal_imbalance", **d) == pytest.approx(imbalance(snap))
        assert val(m, "redisbal_imbalance", **d) == pytest.approx((7 - 6.5) / 6.5)
        lived = time.monotonic() - started + 0.01  # (+ the ms the server's times round off)
        assert 0 <= val(m, "redisbal_snapshot_age_seconds", **d) < lived
        assert 0 <= val(m, "redisbal_engine_heartbeat_age_seconds", engine="e1", **d) < lived
        # three cuts observed: ~0 s, >= 0.15 s (step 2), >= 0.1 s (forced step 3)
        assert val(m, "redisbal_barrier_wait_seconds_count", **d) == 3
        total = val(m, "redisbal_barrier_wait_seconds_sum", **d)
        assert 0.25 <= total < 3 * lived, total
        assert val(m, "redisbal_barrier_wait_seconds_bucket", le="0.05", **d) <= 1
        assert val(m, "redisbal_barrier_wait_seconds_bucket", le="+Inf", **d) == 3
    finally:
        server.shutdown()
        e0.close()
        e1.close()
        coord.client.close()


def test_exporter_reports_redis_down_instead_of_failing(fresh_server: RedisServer) -> None:
    coord = Coordinator(fresh_server.url, "down", CoordinatorConfig(), interval_s=0.02)
    server = serve_coordinator_metrics(coord, free_port())
    try:
        coord.tick()
        assert scrape(server.url)[("redisbal_up", (("deployment", "down"),))] == 1
        fresh_server.kill()
        m = scrape(server.url)
        assert m[("redisbal_up", (("deployment", "down"),))] == 0
        assert ("redisbal_coordinator_ticks_total", (("deployment", "down"),)) in m
        assert not any(name == "redisbal_engines_live" for name, _ in m)
    finally:
        server.shutdown()
        coord.client.close()


def test_cli_coordinator_metrics_port_serves_metrics(redis_url: str, deployment: str) -> None:
    port = free_port()
    env = scrubbed_env()
    proc = subprocess.Popen(
        [REDISBAL, "--redis-url", redis_url, "--deployment", deployment, "coordinator",
         "--metrics-port", str(port), "--duration", "20", "--join-grace-ms", "0"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    rep = redisbal.Reporter(redis_url, deployment, "0", heartbeat=False)
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        d = (("deployment", deployment),)

        def leader_with_snapshot() -> dict[Any, float] | None:
            rep.report(Counts(step=int(time.monotonic() * 10), waiting=1, running=1), wait=True)
            m = scrape(url)
            ok = m.get(("redisbal_coordinator_leader", d)) == 1
            ok = ok and m.get(("redisbal_barrier_wait_seconds_count", d), 0) >= 1
            return m if ok and ("redisbal_snapshot_version", d) in m else None

        m = wait_until(leader_with_snapshot, 20, "the CLI's metrics endpoint")
        assert m[("redisbal_engines_live", d)] == 1
    finally:
        proc.terminate()
        _out, err = proc.communicate(timeout=10)
        rep.close()
    assert proc.returncode == 0, err


async def test_router_metrics_on_the_callers_registry(redis_url: str, deployment: str) -> None:
    started = time.monotonic()  # the snapshot below cannot be older than the test
    registry = CollectorRegistry()
    metrics = RouterMetrics(registry)
    e0 = redisbal.AsyncReporter(redis_url, deployment, "a", heartbeat=False)
    e1 = redisbal.AsyncReporter(redis_url, deployment, "b", heartbeat=False)
    arouter = metrics.bind(redisbal.AsyncRouter(redis_url, deployment, 0, 2))
    router = metrics.bind(redisbal.Router(redis_url, deployment, 1, 2))
    # a router that cannot reach Redis routes degraded (on engines it was given)
    port = free_port()
    offline = metrics.bind(
        redisbal.AsyncRouter(f"redis://127.0.0.1:{port}/0", "offline", 0, 1, engines=["x", "y"])
    )
    try:
        # the join grace (default 1 s) delays the first snapshot: configure it away
        await e0.client.hset(DeploymentKeys(deployment).config, "join_grace_ms", "0")
        await e0.register(wait=True)
        await e1.register(wait=True)
        await e0.report(Counts(step=1, waiting=0, running=1), wait=True)
        assert (await e1.report(Counts(step=1, waiting=0, running=1), wait=True)).version == 1
        await arouter.start(wait=5)
        await asyncio.to_thread(router.start, 5)
        await offline.start()
        for _ in range(3):
            arouter.finished(arouter.route())
        arouter.route(engine_id="b")
        router.route()
        offline.route()
        offline.route()

        def v(name: str, dep: str, idx: int) -> float | None:
            return registry.get_sample_value(name, {"deployment": dep, "client_index": str(idx)})

        assert v("redisbal_router_routes_total", deployment, 0) == 4
        assert v("redisbal_router_pinned_total", deployment, 0) == 1
        assert v("redisbal_router_degraded_routes_total", deployment, 0) == 0
        assert v("redisbal_router_routes_total", deployment, 1) == 1
        assert v("redisbal_router_snapshots_total", deployment, 0) >= 1
        assert v("redisbal_router_snapshot_version", deployment, 1) == 1
        lived = time.monotonic() - started + 0.01  # (+ the ms the server's times round off)
        assert 0 <= v("redisbal_router_snapshot_age_seconds", deployment, 0) < lived  # type: ignore[operator]
        assert v("redisbal_router_degraded", deployment, 0) == 0
        assert v("redisbal_router_engines", deployment, 0) == 2
        assert v("redisbal_router_degraded_routes_total", "offline", 0) == 2
        assert v("redisbal_router_degraded", "offline", 0) == 1
        assert v("redisbal_router_connected", "offline", 0) == 0
        assert v("redisbal_router_snapshot_age_seconds", "offline", 0) is None
        metrics.unbind(offline)
        assert v("redisbal_router_routes_total", "offline", 0) is None
    finally:
        await offline.aclose()
        await asyncio.to_thread(router.close)
        await arouter.aclose()
        await e0.aclose()
        await e1.aclose()


@pytest.mark.parametrize("module", ["coordinator_metrics", "client_metrics"])
def test_missing_prometheus_client_names_the_extra(module: str) -> None:
    code = (
        "import sys; sys.modules['prometheus_client'] = None\n"
        f"try:\n    import redisbal.ops.{module}\n"
        "except ImportError as e:\n    print(e.name, '|', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("prometheus_client |")
    assert "pip install 'redisbal[metrics]'" in out.stdout


def test_snapshot_stalled_and_suspect_gauges_count_the_marked_engines() -> None:
    """The exporter counts the engines the latest snapshot marks stalled and suspect
    (read from a snapshot the collector is handed; no Redis)."""
    from support.exported_metrics import coordinator_registry, full_snapshot
    from support.helpers import make_snapshot

    d = {"deployment": "d"}
    marked = coordinator_registry(full_snapshot())
    assert marked.get_sample_value("redisbal_snapshot_stalled", d) == 1
    assert marked.get_sample_value("redisbal_snapshot_suspect", d) == 1
    both = make_snapshot({"a": (1, 1), "b": (1, 1)}, stalled={"a": 1, "b": 2}, suspect={})
    clean = coordinator_registry(both)
    assert clean.get_sample_value("redisbal_snapshot_stalled", d) == 2
    assert clean.get_sample_value("redisbal_snapshot_suspect", d) == 0


def test_barrier_wait_counts_the_oldest_counts_of_engines_with_work() -> None:
    """A report's time is when its counts were made: an idle engine's stands as long as
    it stays idle, so the barrier's wait is taken over the engines with work."""
    from support.helpers import make_snapshot

    from redisbal.barrier.snapshot import EngineCounts
    from redisbal.ops.coordinator_metrics import barrier_wait_s

    def at(waiting: int, running: int, ms: int) -> EngineCounts:
        return EngineCounts(waiting, running, None, 0, 1, ms)

    busy = {"a": at(1, 2, 999_900), "b": at(0, 3, 999_700)}
    assert barrier_wait_s(make_snapshot(busy)) == pytest.approx(0.3)
    idle_long = {**busy, "c": at(0, 0, 900_000)}
    assert barrier_wait_s(make_snapshot(idle_long)) == pytest.approx(0.3)
    assert barrier_wait_s(make_snapshot({"c": at(0, 0, 900_000)})) is None
