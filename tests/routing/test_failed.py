"""router.failed(): an API server that cannot reach an engine stops choosing it at once,
and every router of the deployment does within one snapshot (real Redis, real routers);
bounded so that no caller can empty the deployment. Also: routers and engine restarts,
and pinning by an int id."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import pytest
import redis
from support.helpers import Barrier, await_until, make_snapshot, wait_until

import redisbal
from redisbal.barrier.snapshot import Snapshot
from redisbal.keys import DeploymentKeys
from redisbal.reporting.reporter import new_incarnation
from redisbal.routing.router_core import RouterCore
from redisbal.routing.state import Decision

INC = new_incarnation(1_700_000_000_000)


@pytest.fixture
async def deployment_of(
    redis_url: str, r: redis.Redis, keys: DeploymentKeys
) -> AsyncIterator[Barrier]:
    bar = Barrier(r, keys)
    bar.configure()
    yield bar


async def routers(redis_url: str, keys: DeploymentKeys, n: int) -> list[redisbal.AsyncRouter]:
    out = []
    for i in range(n):
        rt = redisbal.AsyncRouter(redis_url, keys.deployment, i, n, poll_s=5.0)
        await rt.start(wait=5.0)
        out.append(rt)
    return out


def report_all(bar: Barrier, *engines: str) -> None:
    """Register the engines, then each reports step 1: one snapshot holds them all."""
    bar.register(*engines)
    for e in engines:
        bar.report(e, 1, inc=INC)


def routed_to(router: redisbal.AsyncRouter, engine: str) -> Decision:
    """A decision for ``engine`` (pinned: the same bookkeeping as a chosen one)."""
    return router.route(engine)


async def test_failed_excludes_here_at_once_and_everywhere_within_one_snapshot(
    redis_url: str, r: redis.Redis, keys: DeploymentKeys, deployment_of: Barrier
) -> None:
    bar = deployment_of
    report_all(bar, "e0", "e1", "e2", "e3")
    a, b = await routers(redis_url, keys, 2)
    try:
        await await_until(lambda: b.snapshot is not None and len(b.snapshot.engines) == 4)
        before = b.snapshot
        assert before is not None
        a.failed(routed_to(a, "e0"), "connect refused")
        assert "e0" in a.core.excluded()  # here: at once, before any Redis round trip
        assert all(a.route().engine_id != "e0" for _ in range(200))
        # there: the mark publishes a snapshot, the next one after what b had
        await await_until(lambda: b.core.excluded().get("e0") == "suspect", 5, "b avoids e0")
        snap = b.snapshot
        assert snap is not None and snap.version == before.version + 1 and "e0" in snap.suspect
        assert all(b.route().engine_id != "e0" for _ in range(200))
        meta = bar.meta()
        assert meta["suspected"] == "1"
        # the reason: what the router's requests got, and what the caller saw
        assert meta["suspect:e0"].split(" ", 3)[1:] == [
            "0",
            "0",
            "error x1 in 0.0s (connect refused)",
        ]
        # pinning still reaches it (the caller asked for it)
        assert b.route("e0").engine_id == "e0"
        # its own progress clears nothing: outcomes over self-reports
        for e in ("e0", "e1", "e2", "e3"):
            bar.report(e, 2, inc=INC)
        await await_until(lambda: b.snapshot is not None and b.snapshot.step == 2, 5, "step 2")
        assert "e0" in b.core.excluded()
        # the back-off ends: probing, one request at a time, until one is answered
        await await_until(lambda: b.core.excluded().get("e0") == "probing", 5, "e0 probing")
        probe = b.route()
        assert probe.engine_id == "e0" and probe.probe
        assert all(b.route().engine_id != "e0" for _ in range(50))  # one at a time
        b.answered(probe)
        b.finished(probe)
        assert "e0" not in b.core.excluded()  # b at once; a within one snapshot
        await await_until(lambda: "e0" not in a.core.excluded(), 5, "e0 back at a")
        assert bar.meta()["recovered"] == "1"
    finally:
        for rt in (a, b):
            await rt.aclose()


async def test_failed_tells_redis_once_per_ejection(
    redis_url: str, r: redis.Redis, keys: DeploymentKeys, deployment_of: Barrier
) -> None:
    bar = deployment_of
    report_all(bar, "e0", "e1", "e2")
    (a,) = await routers(redis_url, keys, 1)
    try:
        for _ in range(20):
            a.failed(routed_to(a, "e0"), "reset by peer", kind="reset")
        await await_until(lambda: bar.meta().get("suspected") == "1", 5, "one mark")
        assert a.core.counters["failed"] == 20
        assert a.core.by_id["e0"].inflight == 0  # every failed request ended
        assert a.core.evidence("e0").startswith("reset x20 in ")
    finally:
        await a.aclose()


async def test_no_caller_can_empty_the_deployment(
    redis_url: str, r: redis.Redis, keys: DeploymentKeys, deployment_of: Barrier
) -> None:
    bar = deployment_of
    report_all(bar, "e0", "e1")
    a, b = await routers(redis_url, keys, 2)
    try:
        a.failed(routed_to(a, "e0"), "x")
        await await_until(lambda: "e0" in b.core.excluded(), 5, "e0 suspect")
        # the last engine: evidence against it is kept, but ejects it nowhere
        a.failed(routed_to(a, "e1"), "x")
        b.failed(routed_to(b, "e1"), "x")
        assert a.core.evidence("e1") and set(a.core.excluded()) == {"e0"}
        assert {a.route().engine_id for _ in range(50)} == {"e1"}
        assert b.route().engine_id == "e1"
        # and Redis refuses a mark past half of the engines, whoever asks
        assert bar.suspect("e1") == ("capped", 0)
        snap = bar.snapshot()
        assert snap is not None and set(snap.suspect) == {"e0"}
    finally:
        for rt in (a, b):
            await rt.aclose()


@pytest.mark.parametrize("policy", ["redisbal", "vllm-pre", "vllm-latest", "least-inflight"])
async def test_pinning_an_avoided_engine_neither_fails_nor_makes_it_chosen(
    policy: str, redis_url: str, r: redis.Redis, keys: DeploymentKeys, deployment_of: Barrier
) -> None:
    """A pinned route may reach an engine the router avoids; it must not raise (the
    vLLM baselines keep their copy of the counts of the choosable engines only), nor
    leave the engine in the policy's choice for the routes that do not pin."""
    bar = deployment_of
    report_all(bar, "e0", "e1", "e2")
    rt = redisbal.AsyncRouter(redis_url, keys.deployment, 0, 1, policy=policy, poll_s=5.0)
    await rt.start(wait=5.0)
    try:
        await await_until(lambda: rt.snapshot is not None and len(rt.snapshot.engines) == 3)
        rt.failed(routed_to(rt, "e0"), "connect refused")
        # no await from here on: the feed cannot adopt the mark's snapshot in between
        pinned = rt.route("e0")
        assert pinned.engine_id == "e0" and rt.core.by_id["e0"].inflight == 1
        chosen = [rt.route().engine_id for _ in range(100)]
        assert "e0" not in chosen, f"{chosen.count('e0')} of 100 unpinned routes went to e0"
        rt.finished(pinned)
        assert rt.core.by_id["e0"].inflight == 0
    finally:
        await rt.aclose()


def test_blocking_router_failed_and_bad_reasons(
    redis_url: str, r: redis.Redis, keys: DeploymentKeys
) -> None:
    bar = Barrier(r, keys)
    bar.configure()
    report_all(bar, "e0", "e1", "e2")
    with redisbal.Router(redis_url, keys.deployment, 0, 1) as rt:
        rt.start(wait=5.0)
        with pytest.raises(TypeError, match="reason must be a str"):
            rt.failed(rt.route("e1"), 404)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="kind must be one of"):
            rt.failed(rt.route("e1"), "x", kind="ok")
        with pytest.raises(ValueError, match="kind must be one of"):
            rt.outcome(rt.route("e1"), "weird")
        rt.failed(rt.route("e1"), "bad\ngateway\x00" + "x" * 300)
        wait_until(lambda: "suspect:e1" in bar.meta(), 5, "the mark in Redis")
        reason = bar.meta()["suspect:e1"].split(" ", 3)[3]
        assert reason == ("error x1 in 0.0s (bad gateway " + "x" * 300)[:200]


def test_a_restarted_engine_starts_its_bookkeeping_again() -> None:
    def snap(version: int, admitted: int, inc: str) -> Snapshot:
        return make_snapshot(
            {"e0": (0, 0)}, version=version, admitted={"e0": (admitted,)}, incarnation={"e0": inc}
        )

    core = RouterCore(0, 1)
    core.apply_snapshot(snap(1, 0, "a-1"))
    for _ in range(30):
        core.route("e0")
    core.apply_snapshot(snap(2, 20, "a-1"))
    assert core.by_id["e0"].pending == 10  # routed, not yet admitted
    # the process restarts: its admitted counts start from 0 again
    core.apply_snapshot(snap(3, 0, "b-2"))
    assert core.by_id["e0"].pending == 0 and core.counters["restarts"] == 1
    core.route("e0")
    core.apply_snapshot(snap(4, 0, "b-2"))
    assert core.by_id["e0"].pending == 1


def test_pinning_takes_an_int_engine_id_as_its_text() -> None:
    core = RouterCore(0, 1)
    core.apply_snapshot(make_snapshot({"3": (0, 0), "4": (0, 0)}))
    assert core.route(engine_id=3).engine_id == "3"  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="engine_id must be a str"):
        core.route(engine_id=3.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="engine_id must be a str"):
        core.route(engine_id=True)  # type: ignore[arg-type]


def test_the_coordinator_logs_each_change_of_health_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from redisbal.ops.coordinator import HealthLog

    caplog.set_level(logging.WARNING, logger="redisbal.ops.coordinator")
    h = HealthLog()
    for v in range(1, 11):  # ten forced snapshots on one laggard: one line
        h.snapshot(make_snapshot({}, version=v, forced=True, laggards={"e2": 300 + v}), v, 250)
    h.snapshot(make_snapshot({}, version=11, stalled={"e4": 2100}), 10, 250)
    h.snapshot(make_snapshot({}, version=12, stalled={"e4": 2200}, suspect={"e5": 900}), 10, 250)
    h.snapshot(make_snapshot({}, version=13), 10, 250)
    lines = caplog.messages
    assert lines == [
        "coordinator: barrier stalled on e2 (last report 301 ms ago); forcing a snapshot "
        "every 250 ms until they report",
        "coordinator: barrier complete again after 10 forced snapshots",
        "coordinator: e4 now stalled (work and no progress): routers do not choose it",
        "coordinator: e5 now suspect (a router failed to reach it): routers do not choose it",
        "coordinator: e4 no longer stalled",
        "coordinator: e5 no longer suspect",
    ]
