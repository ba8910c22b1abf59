"""Routing never fails across a Redis state loss: restart empty, Sentinel failover, FLUSHALL.

A new epoch (Redis lost its state) starts with snapshots that may hold none, or only
some, of the engines: the others are still re-registering. The router keeps routing
to the engines it knew, flagged degraded, until the new epoch holds them, reports
them gone, or publishes engines ``rejoin_grace_s`` after its first snapshot the
router adopted (``redisbal.routing.adoption.Carrying``). Only a router that never
knew an engine (or whose engines all left or expired) raises ``NoEngines``.

The rule is tested as pure logic first, then on real processes: engines and a
coordinator as child processes (tests/programs/roles.py), an ``AsyncRouter`` routing on its
own event loop (route() then finished() every ~2 ms, as in an asyncio API server)
and a blocking ``Router`` on a RouteLoop, across REDISBAL_RESTART_ROUNDS (default
3) faults of each kind; every other round one engine is SIGSTOPped across the fault
so that the new epoch's first snapshot lacks it.
"""

from __future__ import annotations

import asyncio
import collections
import os
import random
import signal
import threading
import time
from typing import Any

import orjson
import pytest
import redis
from support.helpers import make_snapshot, wait_until
from support.procs import (
    ENGINES,
    FAILOVER_DEAD_AFTER_MS,
    ProcGroup,
    RouteLoop,
    hold_port,
    record,
    start_deployment,
    stored,
    synced,
)
from support.topology import SentinelTopology, binaries

from redisbal import AsyncRouter, Router
from redisbal.barrier.snapshot import Snapshot
from redisbal.keys import DeploymentKeys
from redisbal.routing.policies import NoEngines
from redisbal.routing.router_core import RouterCore
from redisbal.sim.embedded import RedisServer

pytestmark = pytest.mark.slow

BINARIES = binaries()
ROUNDS = int(os.environ.get("REDISBAL_RESTART_ROUNDS", "3"))
T0 = 1_000_000  # Redis time (ms) of the first snapshots below

# -- the rule, as pure logic ------------------------------------------------------------------


def core_on(engines: tuple[str, ...] = ("e0", "e1", "e2"), epoch: str = "a") -> RouterCore:
    core = RouterCore(0, 1, rng=random.Random(3))
    core.connected = True
    assert core.apply_snapshot(make_snapshot(dict.fromkeys(engines, (0, 0)), epoch=epoch))
    assert not core.degraded
    return core


def snap(
    engines: tuple[str, ...],
    version: int,
    *,
    epoch: str = "b",
    dt_ms: int = 0,
    gone: dict[str, str] | None = None,
    joining: tuple[str, ...] = (),
) -> Snapshot:
    s = make_snapshot(
        dict.fromkeys(engines, (1, 1)), version=version, epoch=epoch, time_ms=T0 + dt_ms, gone=gone
    )
    if joining:  # the barrier lists registered engines whose reports are past the cut
        doc = s.to_dict()
        doc["joining"] = list(joining)
        s = Snapshot.from_json(orjson.dumps(doc))
    return s


def routed(core: RouterCore, n: int = 300) -> collections.Counter[str]:
    """n requests routed while all are in flight, then finished."""
    decisions = [core.route() for _ in range(n)]
    for d in decisions:
        core.finished(d)
    return collections.Counter(d.engine_id for d in decisions)


def test_new_epoch_without_engines_keeps_routing_on_the_known_ones_degraded() -> None:
    core = core_on()
    assert core.apply_snapshot(snap((), 1))
    assert core.degraded and core.carried == {"e0", "e1", "e2"}
    got = routed(core)
    assert set(got) == {"e0", "e1", "e2"} and min(got.values()) >= 90
    # empty snapshots never settle the carry, however late
    assert core.apply_snapshot(snap((), 2, dt_ms=60_000))
    assert core.route().degraded and core.carried == {"e0", "e1", "e2"}
    assert core.apply_snapshot(snap(("e0", "e1", "e2"), 3, dt_ms=60_050))
    assert not core.degraded and not core.carried
    assert not core.route().degraded and core.counters["rejoin_dropped"] == 0


def test_partial_new_epoch_keeps_the_missing_engines_until_they_rejoin_or_the_grace_ends() -> None:
    core = core_on()
    assert core.rejoin_grace_s == 1.0
    assert core.apply_snapshot(snap(("e0",), 1))
    assert [e.engine_id for e in core.engines] == ["e0", "e1", "e2"]
    assert core.carried == {"e1", "e2"} and core.degraded
    assert core.apply_snapshot(snap(("e0", "e1"), 2, dt_ms=500))
    assert core.carried == {"e2"} and core.degraded
    assert set(routed(core)) == {"e0", "e1", "e2"}
    # grace over (Redis time, from the epoch's first snapshot adopted): e2 did not come back
    assert core.apply_snapshot(snap(("e0", "e1"), 3, dt_ms=1000))
    assert list(core.by_id) == ["e0", "e1"] and not core.carried and not core.degraded
    assert core.counters["rejoin_dropped"] == 1
    # an engine coming back later joins like any joiner
    assert core.apply_snapshot(snap(("e0", "e1", "e2"), 4, dt_ms=3000))
    assert set(routed(core)) == {"e0", "e1", "e2"}


def test_engines_the_new_epoch_reports_gone_go_at_once_and_joining_ones_count_as_back() -> None:
    core = core_on(("e0", "e1", "e2", "e3"))
    first = snap(("e0",), 1, gone={"e2": "left"}, joining=("e1",))
    assert first.joining == ("e1",) and first.gone == {"e2": "left"}
    assert core.apply_snapshot(first)
    assert list(core.by_id) == ["e0", "e1", "e3"] and core.carried == {"e3"}
    assert core.apply_snapshot(snap(("e0", "e1"), 2, dt_ms=10, gone={"e3": "expired"}))
    assert list(core.by_id) == ["e0", "e1"] and not core.carried and not core.degraded


def test_carried_engines_keep_their_local_estimate() -> None:
    core = core_on(("e0", "e1"))
    held = [core.route("e1") for _ in range(5)]
    assert core.by_id["e1"].inflight == 5
    assert core.apply_snapshot(snap(("e0",), 1))
    e1 = core.by_id["e1"]
    assert e1.inflight == 5 and e1.routed == 5
    # e1 looks loaded by its own unfinished routes: new requests go to e0 first
    assert [core.route().engine_id for _ in range(3)] == ["e0"] * 3
    for d in held[:3]:
        core.finished(d)
    # routes it finished are no load any more: its own estimate is what is still in flight
    assert core.apply_snapshot(snap(("e0",), 2, dt_ms=50))
    assert (e1.inflight, e1.pending, len(e1.times)) == (2, 2, 2)
    for d in held[3:]:
        core.finished(d)
    assert e1.inflight == 0


def test_a_second_epoch_change_while_carrying_restarts_the_grace() -> None:
    core = core_on()
    assert core.apply_snapshot(snap((), 1))
    assert core.apply_snapshot(snap(("e0",), 1, epoch="c", dt_ms=900))
    assert core.carried == {"e1", "e2"}
    assert core.apply_snapshot(snap(("e0",), 2, epoch="c", dt_ms=1500))  # 600 ms into c
    assert core.carried == {"e1", "e2"}
    assert core.apply_snapshot(snap(("e0", "e1"), 3, epoch="c", dt_ms=1900))
    assert list(core.by_id) == ["e0", "e1"] and not core.carried


def test_engines_known_before_any_snapshot_go_at_the_first_snapshot_with_engines() -> None:
    core = RouterCore(0, 1)
    core.connected = True
    core.set_engines(["a", "b"])
    assert core.apply_snapshot(snap((), 1, epoch="x"))
    assert set(routed(core, 10)) == {"a", "b"} and core.degraded
    # the first snapshot with engines waits for every registered engine: no grace
    assert core.apply_snapshot(snap(("e0",), 2, epoch="x"))
    assert list(core.by_id) == ["e0"] and not core.degraded
    assert core.counters["rejoin_dropped"] == 0  # they were given, not seen in an epoch


def test_only_a_router_without_engines_to_route_to_raises() -> None:
    core = RouterCore(0, 1)
    with pytest.raises(NoEngines, match="no engine known yet"):
        core.route()
    core.connected = True
    assert core.apply_snapshot(snap((), 1, epoch="x"))
    with pytest.raises(NoEngines, match="no engine known yet"):
        core.route()
    assert core.apply_snapshot(snap(("e0",), 2, epoch="x"))
    core.route()
    # within an epoch, absence is removal (the barrier lists every member): e0 left
    assert core.apply_snapshot(snap((), 3, epoch="x", gone={"e0": "left"}))
    with pytest.raises(NoEngines, match="every engine this router knew left or expired"):
        core.route()


def test_versions_never_go_back_within_an_epoch_even_by_way_of_another() -> None:
    core = core_on(("e0",), epoch="a")
    assert core.apply_snapshot(snap(("e0",), 5, epoch="a"))
    assert core.apply_snapshot(snap(("e0",), 1, epoch="b"))
    assert not core.apply_snapshot(snap(("e0",), 3, epoch="a"))  # a stale copy of epoch a
    assert not core.apply_snapshot(snap(("e0",), 5, epoch="a"))
    assert core.snapshot is not None and core.snapshot.epoch == "b"
    # a later version of epoch a published no later than what the router holds of b: a
    # message of a read after b's snapshot came by a GET
    assert not core.apply_snapshot(snap(("e0",), 6, epoch="a"))
    assert core.apply_snapshot(snap(("e0",), 6, epoch="a", dt_ms=1))  # a really newer one
    assert not core.apply_snapshot(snap(("e0",), 1, epoch="b"))
    assert core.counters["ignored_old"] == 4


@pytest.mark.parametrize("grace", [-1, float("nan"), float("inf"), True, "1"])
def test_rejoin_grace_is_validated(grace: Any) -> None:
    with pytest.raises(ValueError, match="rejoin_grace_s"):
        RouterCore(0, 1, rejoin_grace_s=grace)


# -- on real processes ------------------------------------------------------------------------


class AsyncRouting:
    """An AsyncRouter routing on its own event loop, as an asyncio API server does:
    route() then, 50 ms later, finished(), every ~2 ms, on the loop that runs its
    feed. Decisions land in ``probe.log`` (a RouteLoop that is never started) so
    that the RouteLoop checks apply."""

    def __init__(self, url: str, deployment: str, index: int, count: int) -> None:
        self.args = (url, deployment, index, count)
        self.probe = RouteLoop(None)
        self._ready = threading.Event()
        self._stop = threading.Event()
        self.failed: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True, name="async-router")

    def start(self) -> RouteLoop:
        self._thread.start()
        assert self._ready.wait(20), "AsyncRouter did not start"
        if self.failed is not None:
            raise self.failed
        return self.probe

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # surfaced by start() or by the empty log
            self.failed = exc
            self._ready.set()

    async def _main(self) -> None:
        router = AsyncRouter(*self.args)
        await router.start(wait=10)
        self.probe.router = router
        self._ready.set()
        log, inflight = self.probe.log, collections.deque[tuple[float, Any]]()
        seen: tuple[str, int] | None = None
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                s = router.snapshot
                if s is not None and (s.epoch, s.version) != seen:
                    seen = (s.epoch, s.version)
                    log.snapshots.append((now, s.epoch, s.version, frozenset(s.engines)))
                try:
                    d = router.route()
                except Exception as exc:  # the point: route() must never raise
                    log.errors.append(f"{type(exc).__name__}: {exc} [{s and s.epoch}]")
                else:
                    log.decisions.append((now, d.engine_id, d.version, d.degraded))
                    inflight.append((now, d))
                while inflight and now - inflight[0][0] >= 0.05:
                    router.finished(inflight.popleft()[1])
                await asyncio.sleep(0.002)
        finally:
            await router.aclose()


class Routing:
    """One AsyncRouter (on its loop) and one blocking Router (on a RouteLoop), both
    routing continuously; everything stopped on exit."""

    def __init__(self, url: str, deployment: str) -> None:
        self.async_routing = AsyncRouting(url, deployment, 0, 2)
        self.router = Router(url, deployment, 1, 2)
        self.loops: list[RouteLoop] = []

    def __enter__(self) -> Routing:
        try:
            self.loops.append(self.async_routing.start())
            self.router.start(wait=10.0)
            self.loops.append(RouteLoop(self.router).start())
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for loop in self.loops[1:]:
            loop.stop()
        self.async_routing.stop()
        self.router.close()

    def synced_to(self, c: redis.Redis, keys: DeploymentKeys) -> bool:
        """Every router is on the stored snapshot's epoch with every engine, not degraded."""
        current = stored(c, keys)
        return current is not None and all(synced(lp, ENGINES, current.epoch) for lp in self.loops)

    def adopted_epoch_other_than(self, epoch: str) -> bool:
        return all(lp.router.snapshot.epoch != epoch for lp in self.loops)

    def check(self, figures: dict[str, Any]) -> None:
        """Zero exceptions, versions never back within an epoch; adds the counts to figures."""
        errors = [e for lp in self.loops for e in lp.log.errors]
        back = [b for lp in self.loops for b in lp.versions_monotonic()]
        figures["exceptions"] = len(errors)
        # how often the race came up: the first snapshot a router adopted of an epoch
        # lacked engines it knew (forced in the rounds with e2 stopped)
        firsts = [
            s
            for lp in self.loops
            for i, s in enumerate(lp.log.snapshots)
            if i and s[1] != lp.log.snapshots[i - 1][1]
        ]
        figures["new_epochs_adopted"] = len(firsts)
        figures["first_snapshot_lacking_engines"] = sum(s[3] != set(ENGINES) for s in firsts)
        figures["routes"] = sum(len(lp.log.decisions) for lp in self.loops)
        figures["degraded_routes"] = sum(sum(d[3] for d in lp.log.decisions) for lp in self.loops)
        figures["rejoin_dropped"] = sum(
            lp.router.core.counters["rejoin_dropped"] for lp in self.loops
        )
        assert self.async_routing.failed is None, (
            f"the AsyncRouter's loop failed: {self.async_routing.failed!r}"
        )
        assert errors == [], f"route() raised {len(errors)} times: {errors[:3]}"
        assert back == [], f"a router went back to an older version: {back}"


def lagging_engine_round(
    routing: Routing, engine: Any, t_fault: float, epoch_before: str
) -> tuple[float, float]:
    """With ``engine`` (e2) SIGSTOPped across the fault: once every router adopted the new
    epoch (without e2), wait 0.2 s and resume it. Returns (new epoch adopted, e2 back)."""
    wait_until(lambda: routing.adopted_epoch_other_than(epoch_before), 20, "a new epoch")
    t_new = time.monotonic()
    time.sleep(0.2)
    engine.signal(signal.SIGCONT)

    def back() -> bool:
        return all("e2" in (lp.router.snapshot.engines) for lp in routing.loops)

    wait_until(back, 20, "e2 back in the new epoch")
    t_back = time.monotonic()
    time.sleep(0.05)  # the route loops log it within a route or two
    return t_new, t_back


def assert_lagging_engine_stayed_routable(routing: Routing, t_fault: float, epoch: str) -> None:
    """After adopting the new epoch's first snapshot, which lacks e2 (stopped), each
    router kept routing to e2 until it came back (the rule under test), and flagged
    its routes degraded meanwhile (e2 is carried, not yet re-registered)."""
    for lp in routing.loops:
        snaps = [s for s in lp.log.snapshots if s[0] >= t_fault and s[1] != epoch]
        first = next(s[0] for s in snaps)
        assert "e2" not in snaps[0][3], "the new epoch held e2 while it was stopped"
        back = next(s[0] for s in snaps if "e2" in s[3])
        window = [d for d in lp.log.decisions if first <= d[0] < back]
        got = collections.Counter(d[1] for d in window)
        assert got["e2"] > 0, f"e2 dropped by the new epoch's first snapshot: {got}"
        early = [d for d in window if d[0] < first + 0.05]
        assert early and all(d[3] for d in early), "routes while e2 was carried not degraded"


@pytest.fixture
def binary(server_name: str) -> str:
    return server_name


@pytest.mark.timeout(120 + 30 * ROUNDS)
def test_routing_never_fails_across_redis_restarts(binary: str, deployment: str) -> None:
    keys = DeploymentKeys(deployment)
    server = RedisServer(BINARIES[binary], tcp=True).start()
    figures: dict[str, Any] = {"binary": binary, "rounds": ROUNDS}
    try:
        c = server.client(socket_timeout=2)
        with ProcGroup(server.url, deployment) as g:
            procs = start_deployment(g, dead_after_ms=1500)
            with Routing(server.url, deployment) as routing:
                wait_until(lambda: routing.synced_to(c, keys), 20, "routers in sync")
                for k in range(ROUNDS):
                    lagging = k % 2 == 1
                    epoch = stored(c, keys).epoch  # type: ignore[union-attr]
                    if lagging:
                        procs["e2"].signal(signal.SIGSTOP)  # type: ignore[attr-defined]
                    server.kill()
                    t_kill = time.monotonic()
                    held = hold_port(server.port)
                    time.sleep(0.3 + 0.3 * (k % 4))  # outages of 0.3-1.2 s shift the race
                    held.close()
                    server.start()
                    if lagging:
                        lagging_engine_round(routing, procs["e2"], t_kill, epoch)
                        assert_lagging_engine_stayed_routable(routing, t_kill, epoch)
                    wait_until(lambda: routing.synced_to(c, keys), 30, f"resync after restart {k}")
                time.sleep(0.2)
            routing.check(figures)
    finally:
        server.cleanup()
    record("restart_routing", **figures)


@pytest.mark.timeout(120 + 20 * ROUNDS)
def test_routing_never_fails_across_flushall(binary: str, deployment: str) -> None:
    keys = DeploymentKeys(deployment)
    server = RedisServer(BINARIES[binary], tcp=True).start()
    figures: dict[str, Any] = {"binary": binary, "rounds": ROUNDS}
    try:
        c = server.client(socket_timeout=2)
        with ProcGroup(server.url, deployment) as g:
            procs = start_deployment(g, dead_after_ms=1500)
            with Routing(server.url, deployment) as routing:
                wait_until(lambda: routing.synced_to(c, keys), 20, "routers in sync")
                for k in range(ROUNDS):
                    lagging = k % 2 == 1
                    epoch = stored(c, keys).epoch  # type: ignore[union-attr]
                    if lagging:
                        procs["e2"].signal(signal.SIGSTOP)  # type: ignore[attr-defined]
                    t_flush = time.monotonic()
                    c.flushall()
                    if lagging:
                        lagging_engine_round(routing, procs["e2"], t_flush, epoch)
                        assert_lagging_engine_stayed_routable(routing, t_flush, epoch)
                    wait_until(lambda: routing.synced_to(c, keys), 30, f"resync after flush {k}")
                time.sleep(0.2)
            routing.check(figures)
    finally:
        server.cleanup()
    record("flushall_routing", **figures)


def replica_of_the_new_primary(topo: SentinelTopology, server: RedisServer) -> bool:
    """Whether ``server`` (the old primary, restarted empty) replicates the current
    primary and the sentinels see it as a healthy replica (a failover candidate).
    The sentinels reconfigure a returning primary at their next INFO of it (up to
    10 s apart); this does it at once, as they would."""
    port = topo.primary_port()
    with topo.data_client(server) as c:
        info = c.info("replication")
        if info["role"] != "slave" or int(info.get("master_port", 0)) != port:
            c.replicaof("127.0.0.1", port)
            return False
        if info.get("master_link_status") != "up":
            return False
    with topo.sentinels[0].client() as s:
        return any(
            int(r["port"]) == server.port and not (r["is_sdown"] or r["is_disconnected"])
            for r in s.sentinel_slaves(topo.service)
        )


@pytest.mark.timeout(120 + 40 * ROUNDS)
def test_routing_never_fails_across_sentinel_failovers(deployment: str) -> None:
    keys = DeploymentKeys(deployment)
    figures: dict[str, Any] = {"binary": "7.0", "rounds": ROUNDS}
    with SentinelTopology(BINARIES["system"]) as topo, ProcGroup(topo.url, deployment) as g:
        start_deployment(g, dead_after_ms=FAILOVER_DEAD_AFTER_MS)
        with Routing(topo.url, deployment) as routing:
            for k in range(ROUNDS):
                primary = topo.server_on(topo.primary_port())
                replica = next(s for s in topo.servers if s is not primary)
                with topo.data_client(primary) as pc:
                    wait_until(lambda: routing.synced_to(pc, keys), 30, f"sync before {k}")
                    epoch = stored(pc, keys).epoch  # type: ignore[union-attr]
                with topo.data_client(replica) as rc:
                    # the state is on the replica before the crash
                    wait_until(lambda: stored(rc, keys) is not None, 20, "state replicated")
                old = topo.kill_primary()
                held = hold_port(old)
                topo.wait_failover(old, timeout=40)
                with topo.data_client(replica) as rc:
                    wait_until(
                        lambda e=epoch: (s := stored(rc, keys)) is not None and s.epoch != e,
                        20,
                        "a new epoch on the promoted replica",
                    )
                    wait_until(lambda: routing.synced_to(rc, keys), 30, f"resync after {k}")
                # the old primary comes back empty; the sentinels make it a replica
                held.close()
                primary.start()
                wait_until(
                    lambda p=primary: replica_of_the_new_primary(topo, p),
                    40,
                    "old primary a replica",
                )
            time.sleep(0.2)
        routing.check(figures)
    record("sentinel_failover_routing", **figures)
