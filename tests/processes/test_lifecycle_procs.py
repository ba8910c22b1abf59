"""Engine lifecycle on real processes: restarts on a Redis that holds the deployment,
a hung engine, a killed engine under load with API servers calling failed(), and
two processes under one engine id. Figures go to the reliability log (procs.record)
and docs/RELIABILITY.md."""

from __future__ import annotations

import itertools
import logging
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from support.helpers import wait_until
from support.procs import ProcGroup, Routers, SnapshotObserver, record, start_deployment
from support.prometheus import scrape, val

import redisbal
from redisbal import Counts
from redisbal.barrier.record import parse_record
from redisbal.barrier.snapshot import Snapshot
from redisbal.keys import DeploymentKeys
from redisbal.ops.coordinator import Coordinator, CoordinatorConfig
from redisbal.ops.coordinator_metrics import serve_coordinator_metrics
from redisbal.ops.status import gather_status
from redisbal.sim.embedded import RedisServer, free_port

ROOT = Path(__file__).resolve().parents[2]
DEMO = [sys.executable, "-m", "redisbal", "demo"]
pytestmark = pytest.mark.slow


def readme_example() -> str:
    """The README's API example (its one python block)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return re.search(r"```python\n(.*?)```", text, re.S)[1]  # type: ignore[index]


def test_readme_api_example_runs_twice_against_one_redis(fresh_server: RedisServer) -> None:
    code = readme_example()
    assert 'REDIS_URL = "redis://localhost:6379/0"' in code
    code = code.replace("redis://localhost:6379/0", fresh_server.url)
    for run in (1, 2):
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, f"run {run}: {out.stderr[-2000:]}"
        lines = out.stdout.splitlines()
        assert lines[0] == "accepted", (run, lines)
        assert lines[1].startswith("send to engine 0") and "degraded" not in lines[1], lines
        assert lines[2].isdigit(), lines  # a snapshot version


def _published(output: str) -> tuple[int, int, int]:
    m = re.search(r"barrier: published (\d+), forced (\d+), stale \d+, late (\d+)", output)
    assert m is not None, output[-2000:]
    return int(m[1]), int(m[2]), int(m[3])


ONE_RUN = ["--log-level", "warning", "--compare", "none"]


def test_demo_three_times_against_one_redis(fresh_server: RedisServer) -> None:
    """Each run completes its barrier as the first did: no late reports, and most of
    its snapshots unforced (a run stuck behind the previous run's state would only get
    the stall guard's forced ones). The demo's counters are the epoch's: each run's
    share is the difference."""
    totals = []
    for _ in range(3):
        out = subprocess.run(
            [*DEMO, "--redis-url", fresh_server.url, "--duration", "2", *ONE_RUN],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        assert re.search(r"requests: (\d+) sent, \1 served", out.stdout), out.stdout[-1500:]
        totals.append(_published(out.stdout))
    runs = [totals[0]]  # each run's share of the epoch's counters
    for prev, cur in itertools.pairwise(totals):
        runs.append((cur[0] - prev[0], cur[1] - prev[1], cur[2] - prev[2]))
    record(
        "demo run three times on one Redis",
        published=[r[0] for r in runs],
        late=[r[2] for r in runs],
    )
    for published, forced, late in runs:
        assert late == 0 and published > forced, runs


def ready_at(proc: Any) -> float:
    """When a process said it was ready: its first report follows at once."""
    return next(x["_t"] for x in list(proc.lines) if x.get("ready"))


def _first_unforced_with(obs: SnapshotObserver, since: float, incs: dict[str, str]) -> float:
    """Monotonic time of the first unforced snapshot received after ``since`` that holds
    every engine in ``incs`` with that incarnation."""

    def found() -> float | None:
        for t, snap in list(obs.received):
            if t < since or snap.forced:
                continue
            if all(
                e in snap.engines and snap.engines[e].incarnation == inc for e, inc in incs.items()
            ):
                return t
        return None

    wait_until(lambda: found() is not None, 15, f"an unforced snapshot with {incs}")
    t = found()
    assert t is not None
    return t


@pytest.mark.parametrize("tick", [False, True], ids=["lockstep", "tick"])
def test_restarting_one_engine_returns_to_unforced_snapshots_without_an_expiry(
    fresh_server: RedisServer, tick: bool
) -> None:
    url, deployment = fresh_server.url, "restart1"
    g = ProcGroup(url, deployment)
    obs = SnapshotObserver(url, DeploymentKeys(deployment).channel).start()
    try:
        t0 = time.time()
        g.coordinator("c1", dead_after_ms=30_000).wait_ready()
        engines = {e: g.engine(e, t0, tick=tick) for e in ("e0", "e1", "e2")}
        for p in engines.values():
            p.wait_ready()
        wait_until(lambda: len(obs.received) > 20, 15, "snapshots flowing")
        engines["e1"].kill()  # a crash: no leave
        time.sleep(0.5)
        new = g.engine("e1", time.time(), tick=tick)  # its steps count from 0 again
        new.wait_ready()
        ready = ready_at(new)
        t = _first_unforced_with(obs, ready, {"e1": new.lines[0]["incarnation"]})
        record(
            "engine restarted on the deployment's Redis state",
            mode="tick" if tick else "lockstep",
            unforced_after_s=t - ready,
        )
        # the new incarnation replaced the old at once: none waited out dead_after (30 s)
        meta = redis.Redis.from_url(url).hgetall(DeploymentKeys(deployment).meta)
        assert int(meta.get(b"restarted", 0)) >= 1 and int(meta.get(b"expired", 0)) == 0, meta
        assert int(meta.get(b"stale", 0)) == 0 and int(meta.get(b"conflicts", 0)) == 0, meta
    finally:
        obs.stop()
        g.close()


def test_restarting_the_whole_lockstep_group_starts_a_new_step_sequence(
    fresh_server: RedisServer,
) -> None:
    url, deployment = fresh_server.url, "restart-all"
    g = ProcGroup(url, deployment)
    obs = SnapshotObserver(url, DeploymentKeys(deployment).channel).start()
    try:
        procs = start_deployment(g, coordinators=("c1",), dead_after_ms=30_000)
        wait_until(lambda: len(obs.received) > 40, 15, "snapshots flowing")
        for e in ("e0", "e1", "e2"):
            procs[e].kill()  # type: ignore[attr-defined]
        time.sleep(0.5)
        t0 = time.time()  # the new group's shared step clock starts at 0
        new = {e: g.engine(e, t0) for e in ("e0", "e1", "e2")}
        for p in new.values():
            p.wait_ready()
        first = min(ready_at(p) for p in new.values())
        incs = {e: p.lines[0]["incarnation"] for e, p in new.items()}
        t = _first_unforced_with(obs, first, incs)
        record("lockstep group restarted together", unforced_after_s=t - first)
        # the new incarnations replaced the old at once: none waited out dead_after (30 s)
        meta = redis.Redis.from_url(url).hgetall(DeploymentKeys(deployment).meta)
        assert int(meta.get(b"restarted", 0)) >= 3 and int(meta.get(b"expired", 0)) == 0, meta
        # and the group goes on publishing unforced snapshots of the new incarnations, each
        # cut at a step every engine has reached, none going back (how far apart the
        # engines' own steps are depends on how the host schedules them: not checked)
        time.sleep(1.0)
        later = [s for ts, s in list(obs.received) if ts > t + 0.5]
        assert later and not any(s.forced for s in later)
        c = redis.Redis.from_url(url)
        reports = DeploymentKeys(deployment).reports
        # each one's new sequence: its steps' offset into the deployment's order
        offset = {e: parse_record(c.hget(reports, e).decode()).offset for e in incs}  # type: ignore[union-attr]
        for s in later:
            assert {e: c.incarnation for e, c in s.engines.items()} == incs, s
            assert s.step <= min(offset[e] + c.step for e, c in s.engines.items()), s
        steps, versions = [s.step for s in later], [s.version for s in later]
        assert steps == sorted(steps) and versions == sorted(set(versions)), (steps, versions)
    finally:
        obs.stop()
        g.close()


def test_a_hung_engine_is_excluded_by_every_router_and_comes_back(
    fresh_server: RedisServer, routers: Routers
) -> None:
    url, deployment = fresh_server.url, "hung"
    stall_after_ms = 600
    g = ProcGroup(url, deployment)
    obs = SnapshotObserver(url, DeploymentKeys(deployment).channel).start()
    try:
        procs = start_deployment(
            g, coordinators=("c1",), dead_after_ms=5000, stall_after_ms=stall_after_ms
        )
        loops = [routers.add(url, deployment, i, 2) for i in range(2)]
        wait_until(lambda: all(len(lp.log.snapshots) > 5 for lp in loops), 15, "routing")
        hung_at = time.monotonic()
        procs["e1"].signal(signal.SIGUSR1)  # type: ignore[attr-defined]
        # every router stops choosing it: the last decision for e1 of each router
        wait_until(
            lambda: all("e1" in lp.router.core.excluded() for lp in loops), 10, "e1 excluded"
        )
        excluded_at = time.monotonic()
        time.sleep(0.5)
        after = [d for lp in loops for d in lp.decisions_since(excluded_at)]
        assert after and not any(d[1] == "e1" for d in after)
        # the others publish unforced snapshots again
        unforced = [s for t, s in list(obs.received) if t > excluded_at and not s.forced]
        assert unforced and all("e1" in s.stalled for s in unforced)
        record(
            "engine loop hung, process alive",
            stall_after_ms=stall_after_ms,
            excluded_after_s=excluded_at - hung_at,
        )
        # excluded as stalled, its process alive: never expired (dead_after is 5 s)
        meta = redis.Redis.from_url(url).hgetall(DeploymentKeys(deployment).meta)
        assert int(meta.get(b"expired", 0)) == 0, meta
        # it steps again: back in every router
        procs["e1"].signal(signal.SIGUSR1)  # type: ignore[attr-defined]
        wait_until(
            lambda: all("e1" not in lp.router.core.excluded() for lp in loops), 10, "e1 back"
        )
        back = time.monotonic()
        wait_until(
            lambda: any(d[1] == "e1" for lp in loops for d in lp.decisions_since(back)),
            10,
            "e1 routed again",
        )
    finally:
        obs.stop()
        g.close()


def test_a_killed_engine_gets_almost_nothing_while_routers_call_failed(
    fresh_server: RedisServer, routers: Routers
) -> None:
    url, deployment = fresh_server.url, "killed"
    g = ProcGroup(url, deployment)
    engines = tuple(f"e{i}" for i in range(8))
    try:
        procs = start_deployment(g, engines=engines, coordinators=("c1",), dead_after_ms=5000)

        def unreachable(engine: str) -> bool:
            return not procs[engine].alive()  # type: ignore[attr-defined]

        loops = [routers.add(url, deployment, i, 2, unreachable=unreachable) for i in range(2)]
        wait_until(lambda: all(len(lp.log.snapshots) > 5 for lp in loops), 15, "routing")
        procs["e3"].kill()  # type: ignore[attr-defined]
        killed = time.monotonic()
        time.sleep(5.0)
        decided = [d for lp in loops for d in lp.decisions_since(killed)]
        failed = [f for lp in loops for f in lp.log.failed if f[0] >= killed]
        lost = sum(lp.log.lost for lp in loops)
        requests = len(decided) + lost
        to_dead = len(failed)
        record(
            "engine SIGKILLed under load, routers call failed()",
            requests=requests,
            routed_to_dead=to_dead,
            share=to_dead / max(1, requests),
            lost=lost,
        )
        assert requests > 1000
        assert to_dead <= 0.01 * requests
        assert lost == 0
        assert not any(d[1] == "e3" for d in decided)  # every retry landed elsewhere
    finally:
        g.close()


def test_two_processes_under_one_engine_id_is_a_conflict_and_a_restart_is_not(
    redis_url: str, deployment: str, caplog: pytest.LogCaptureFixture
) -> None:
    r = redis.Redis.from_url(redis_url)
    keys = DeploymentKeys(deployment)
    coord = Coordinator(redis_url, deployment, CoordinatorConfig(dead_after_ms=5000))
    metrics = serve_coordinator_metrics(coord, free_port())
    caplog.set_level(logging.ERROR)
    first = redisbal.Reporter(redis_url, deployment, "0", heartbeat_s=0.05)
    other = redisbal.Reporter(redis_url, deployment, "1", heartbeat_s=0.05)
    second: Any = None
    try:
        for step in (1, 2):
            first.report(Counts(step, 1, 1), wait=True)
            other.report(Counts(step, 1, 1), wait=True)
        coord.tick()
        # a plain restart: the first process stops (crash: no leave), a second one starts;
        # a third process started between them (a copied pod spec) is still quiet
        first.close(leave=False)
        zombie = redisbal.Reporter(redis_url, deployment, "0", heartbeat_s=0.05, register=False)
        time.sleep(0.01)  # incarnations order by start ms
        second = redisbal.Reporter(redis_url, deployment, "0", heartbeat_s=0.05)
        assert second.report(Counts(0, 2, 2), wait=True).accepted
        assert other.report(Counts(3, 1, 1), wait=True).version > 0  # the next step: unforced
        coord.tick()
        st = {e["engine"]: e for e in gather_status(r, deployment)["engines"]}
        assert st["0"]["state"] == "live" and st["0"]["incarnation"] == second.incarnation
        assert int(r.hget(keys.meta, "conflicts") or 0) == 0
        assert not [rec for rec in caplog.records if "refused" in rec.getMessage()]
        try:
            # the quiet one starts reporting: two live processes under one id
            got = zombie.report(Counts(3, 9, 9), wait=True)
            assert got.status == "conflict"
            wait_until(lambda: zombie.stats().conflict >= 2, 5, "heartbeats refused too")
            coord.tick()
            coord.watch_health()
            st = {e["engine"]: e for e in gather_status(r, deployment)["engines"]}
            assert st["0"]["state"] == "conflict"
            assert st["0"]["conflict"] == {
                "refused": zombie.incarnation,
                "current": second.incarnation,
            }
            assert int(r.hget(keys.meta, "conflicts") or 0) >= 2
            m = scrape(metrics.url)
            assert val(m, "redisbal_reports_conflict_total", deployment=deployment) >= 2
            errors = [rec.getMessage() for rec in caplog.records if rec.levelno >= logging.ERROR]
            reporter_lines = [m for m in errors if m.startswith("engine 0: reports refused")]
            coordinator_lines = [m for m in errors if m.startswith("coordinator: two processes")]
            assert len(reporter_lines) == 1 and len(coordinator_lines) == 1, errors
            for line in (reporter_lines[0], coordinator_lines[0]):
                assert zombie.incarnation in line and second.incarnation in line
            # routing stays on the newest process's counts
            snap = Snapshot.from_json(r.get(keys.snapshot))  # type: ignore[arg-type]
            assert snap.engines["0"].incarnation == second.incarnation
            assert (snap.engines["0"].waiting, snap.engines["0"].running) == (2, 2)
        finally:
            zombie.close(leave=True)  # its leave takes nothing with it
        assert r.hget(keys.reports, "0") is not None
    finally:
        for rep in (other, second):
            if rep is not None:
                rep.close()
        metrics.shutdown()
        coord.client.close()
