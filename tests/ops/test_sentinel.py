"""Sentinel: redis+sentinel://host:port[,host:port]/service_name for every class and the
CLI, on real sentinels (one primary, one replica, three sentinels), and one failover:
the primary is SIGKILLed, everything reconnects through the sentinels, and routers
never go back to an older version within an epoch (the coordinator starts a new epoch
when the server behind the URL changed)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator

import pytest
from support.cli import run_cli
from support.helpers import await_until, wait_until
from support.topology import EveryClass, SentinelTopology, binaries

import redisbal
from redisbal import Counts
from redisbal.connection import BadRedisURL, make_client, parse_url
from redisbal.keys import DeploymentKeys
from redisbal.ops.coordinator import Coordinator, CoordinatorConfig

pytestmark = [pytest.mark.servers, pytest.mark.slow]

FAST = CoordinatorConfig(join_grace_ms=0, stall_ms=200, idle_publish_ms=300, dead_after_ms=3000)


@pytest.fixture(scope="module")
def sentinels(server_name: str) -> Iterator[SentinelTopology]:
    """Sentinel on every server binary (each can run as a sentinel with --sentinel)."""
    with SentinelTopology(binaries()[server_name]) as topo:
        yield topo


# -- URL parsing (pure) ---------------------------------------------------------------------------


def test_sentinel_url_names_sentinels_service_db_and_credentials() -> None:
    t = parse_url("redis+sentinel://u:pw@10.0.0.1:26379,10.0.0.2:26380/mymaster?db=3")
    assert t.kind == "sentinel" and not t.tls
    assert t.hosts == (("10.0.0.1", 26379), ("10.0.0.2", 26380))
    assert (t.service, t.db, t.username, t.password) == ("mymaster", 3, "u", "pw")
    assert parse_url("rediss+sentinel://h:1/svc").tls


@pytest.mark.parametrize(
    "url", ["redis+sentinel://h:26379", "redis+sentinel://h:26379/", "redis+sentinel://h/svc"]
)
def test_sentinel_url_without_service_or_port_is_refused(url: str) -> None:
    with pytest.raises(BadRedisURL):
        parse_url(url)


# -- every class through the sentinels -------------------------------------------------------------


async def test_every_class_works_through_a_sentinel_url(sentinels: SentinelTopology) -> None:
    dep = f"sen{int(time.time() * 1000) % 100000}"
    async with EveryClass(sentinels.url, dep, config=FAST) as flow:
        await flow.run()
        # the data went to the primary the sentinels name
        with sentinels.server_on(sentinels.primary_port()).client() as c:
            assert c.exists(DeploymentKeys(dep).snapshot) == 1


async def test_a_closed_client_leaves_no_connection_to_the_sentinels(
    sentinels: SentinelTopology,
) -> None:
    """Closing a client made from a Sentinel URL closes its connections to the sentinels
    too (redis-py leaves them open until collected), sync and asyncio alike."""

    def connected() -> int:
        total = 0
        for s in sentinels.sentinels:
            with s.client() as c:
                total += int(c.info("clients")["connected_clients"]) - 1  # (this one)
        return total

    before = connected()
    kept = []  # alive after closing, as a caller's attribute would keep them
    for _ in range(3):
        client = make_client(sentinels.url, socket_timeout=2)
        client.ping()
        client.close()
        aclient = make_client(sentinels.url, asyncio=True, socket_timeout=2)
        await aclient.ping()
        await aclient.aclose()
        kept += [client, aclient]
    await await_until(lambda: connected() <= before, 10, "the sentinels' connections closed", 0.2)


def test_cli_coordinator_and_status_through_a_sentinel_url(sentinels: SentinelTopology) -> None:
    url = sentinels.url
    dep = f"sencli{int(time.time() * 1000) % 100000}"
    out = run_cli(
        "--redis-url", url, "--deployment", dep, "coordinator", "--duration", "1.5",
        "--expect", "2", "--join-grace-ms", "0",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    with (
        redisbal.Reporter(url, dep, "0", heartbeat=False) as a,
        redisbal.Reporter(url, dep, "1", heartbeat=False) as b,
    ):
        a.report(Counts(step=1, waiting=3, running=1), wait=True)
        assert b.report(Counts(step=1, waiting=0, running=4), wait=True).version >= 1
        out = run_cli("--redis-url", url, "--deployment", dep, "status", "--json")
        assert out.returncode == 0, out.stderr
        st = json.loads(out.stdout)
        engines = {e["engine"]: e for e in st["engines"]}
        assert set(engines) == {"0", "1"}, st
        # the coordinator wrote the config through the sentinel URL
        client = make_client(url)
        try:
            cfg = client.hgetall(DeploymentKeys(dep).config)
            assert cfg[b"expected"] == b"0,1" and cfg[b"join_grace_ms"] == b"0"
        finally:
            client.close()


# -- failover ---------------------------------------------------------------------------------


def test_failover_everything_reconnects_and_versions_never_go_back() -> None:
    """Kill the primary: the sentinels promote the replica; engines, coordinator and
    routers reconnect through the same URL; after it, snapshots flow again and every
    router's (epoch, version) sequence never goes back within an epoch."""
    topo = SentinelTopology().start()
    url = topo.url
    dep = "failover"
    stop = threading.Event()
    coord = Coordinator(url, dep, FAST, interval_s=0.02)
    reps = [redisbal.Reporter(url, dep, f"e{i}", heartbeat=False) for i in range(2)]
    routers = [redisbal.Router(url, dep, i, 2, poll_s=0.5) for i in range(2)]
    seen: list[list[tuple[str, int]]] = [[] for _ in routers]
    accepted_after: list[float] = []
    threads: list[threading.Thread] = []

    def engines() -> None:
        step = 0
        while not stop.is_set():
            step += 1
            for i, rep in enumerate(reps):
                sent = time.monotonic()  # (a report sent after the kill met the new primary)
                res = rep.report(Counts(step=step, waiting=i, running=step % 50), wait=True)
                if res.accepted:
                    accepted_after.append(sent)
            stop.wait(0.03)

    def watch() -> None:
        while not stop.is_set():
            for i, r in enumerate(routers):
                s = r.snapshot
                if s is not None and (not seen[i] or seen[i][-1] != (s.epoch, s.version)):
                    seen[i].append((s.epoch, s.version))
            stop.wait(0.005)

    try:
        coord.tick()
        for r in routers:
            r.start()
        threads = [
            threading.Thread(target=engines, daemon=True),
            threading.Thread(target=watch, daemon=True),
            threading.Thread(target=coord.run, args=(40.0,), daemon=True),
        ]
        for t in threads:
            t.start()
        wait_until(lambda: all(len(s) >= 3 for s in seen), 15, "snapshots before the failover")
        first_epoch = seen[0][-1][0]
        # kill only once the replica holds the deployment (its first full sync can
        # lag the sentinels' readiness): the state survives, so the new epoch is the
        # coordinator's (server identity changed, state kept), not a re-creation
        primary = topo.server_on(topo.primary_port())
        replica = next(s for s in topo.servers if s is not primary)
        rc = replica.client(socket_timeout=2)
        wait_until(lambda: rc.get(DeploymentKeys(dep).snapshot) is not None, 15, "replicated")
        rc.close()
        old = topo.kill_primary()
        killed_at = time.monotonic()
        new = topo.wait_failover(old, timeout=30)
        assert new != old
        # engines' reports are accepted again and routers get snapshots of a new epoch
        wait_until(lambda: accepted_after and accepted_after[-1] > killed_at, 20, "reports")
        wait_until(
            lambda: all(s[-1][0] != first_epoch for s in seen),
            20,
            "routers on a new epoch after the failover",
        )
        versions_after = [s[-1][1] for s in seen]
        wait_until(
            lambda: all(s[-1][1] > v for s, v in zip(seen, versions_after, strict=True)),
            10,
            "snapshots flowing on the new primary",
        )
        assert coord.stats.epochs_started >= 1
        assert all(not r.degraded for r in routers)
    finally:
        stop.set()
        coord.stop()
        for t in threads:
            t.join(timeout=10)
        for r in routers:
            r.close()
        for rep in reps:
            rep.close(leave=False)
        coord.client.close()
        topo.cleanup()
    for per_router in seen:
        last: dict[str, int] = {}
        for epoch, version in per_router:
            assert version > last.get(epoch, 0), f"went back within epoch {epoch}: {per_router}"
            last[epoch] = version


async def test_password_protected_data_nodes_through_sentinels(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Data nodes with requirepass (sentinels with auth-pass): the password in the
    Sentinel URL reaches the data nodes; a wrong one is reported without echoing it."""
    secret = "sentinel-data-Secret-42"
    with SentinelTopology(password=secret) as topo:
        hosts = topo.url.split("://", 1)[1]
        url = f"redis+sentinel://:{secret}@{hosts}"
        dep = "senpw"
        coord = Coordinator(url, dep, FAST, interval_s=0.02)
        rep = redisbal.Reporter(url, dep, "e0", heartbeat=False)
        router = redisbal.AsyncRouter(url, dep, poll_s=30.0)
        try:
            await asyncio.to_thread(coord.tick)
            assert coord.stats.leader
            await router.start()
            assert rep.report(Counts(step=1, waiting=1, running=1), wait=True).version >= 1
            await await_until(lambda: router.snapshot is not None, 10, "a snapshot")
            assert router.snapshot is not None and set(router.snapshot.engines) == {"e0"}
        finally:
            await router.aclose()
            rep.close()
            coord.release()
            coord.client.close()
        bad = redisbal.Reporter(f"redis+sentinel://:wrong-{secret}@{hosts}", dep, "e1")
        assert bad.report(Counts(step=1, waiting=0, running=0), wait=True).status == "unavailable"
        bad.close(leave=False)
    assert secret not in caplog.text
