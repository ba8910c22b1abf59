"""The distributed setups, failed over for real, under load.

- A Redis Cluster of three primaries with one replica each (6 nodes), three
  deployments on three different primaries, each with a coordinator and two lockstep
  engines as real processes and an in-process router routing continuously. The
  primary holding one deployment's slot (and slot 0: the default node of redis-py's
  cluster clients) is SIGKILLed: that deployment's router keeps routing (degraded
  meanwhile, route() never raises), its engines' reports resume against the promoted
  replica, versions never go back within an epoch, and the other deployments' routers
  never degrade (their snapshots pause only while Redis refuses every slot, as it does
  with ``cluster-require-full-coverage yes``, the default). The old primary is
  restarted (it rejoins as a replica), then a manual ``CLUSTER FAILOVER`` hands the
  slot back gracefully.
- The same cluster, a deployment's slot migrated to another primary while it runs
  (``CLUSTER SETSLOT`` + ``MIGRATE``, as ``redis-cli --cluster reshard`` does): the
  clients follow ASK/MOVED, the Lua keeps all keys in one slot, nothing is lost.
- Sentinel with TLS on every port (data nodes, replication and the sentinels), client
  certificates, a ``rediss+sentinel://`` URL, a failover under load.

Every scenario records its recovery figures with ``procs.record`` (docs/RELIABILITY.md).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from support.procs import (
    ProcGroup,
    RouteLoop,
    Routers,
    assert_routing_never_failed,
    hold_port,
    record,
    synced,
    wait_until,
)
from support.topology import ClusterTopology, SentinelTopology, binaries, make_certs

from redisbal.bench.isolation import run_isolation
from redisbal.keys import DeploymentKeys

BINARIES = binaries()
ENGINES = ("e0", "e1")
# cluster-node-timeout: how long a primary must be unreachable before its replica takes
# over. Engines cannot report meanwhile, so dead_after_ms stays well above it.
NODE_TIMEOUT_MS = 1500
DEAD_AFTER_MS = 8000

pytestmark = [pytest.mark.servers, pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def cluster(server_name: str) -> Iterator[ClusterTopology]:
    """3 primaries x 1 replica, on every server binary."""
    with ClusterTopology(
        BINARIES[server_name], replicas=1, node_timeout_ms=NODE_TIMEOUT_MS
    ) as topo:
        yield topo


def start(g: ProcGroup, **coord_opts: object) -> None:
    """A coordinator and lockstep engines stepping on a shared 50 ms clock."""
    t0 = time.time()
    procs = [g.coordinator("c1", dead_after_ms=DEAD_AFTER_MS, **coord_opts)]
    procs += [g.engine(e, t0) for e in ENGINES]
    for p in procs:
        p.wait_ready()


def snapshots_between(loop: RouteLoop, t0: float, t1: float) -> list[tuple[float, str, int]]:
    return [(t, e, v) for t, e, v, _ in list(loop.log.snapshots) if t0 <= t < t1]


def max_gap(loop: RouteLoop, t0: float, t1: float) -> float:
    """The longest time in [t0, t1] in which the router adopted no new snapshot."""
    times = [t0, *(t for t, _, _ in snapshots_between(loop, t0, t1)), t1]
    return max(b - a for a, b in itertools.pairwise(times))


def degraded_between(loop: RouteLoop, t0: float, t1: float) -> int:
    return sum(1 for t, _e, _v, deg, _done in list(loop.log.decisions) if t0 <= t < t1 and deg)


def first_snapshot_after(loop: RouteLoop, t: float, after: tuple[str, int]) -> float | None:
    """When the router first adopted a snapshot newer than ``after`` (epoch, version)."""
    epoch, version = after
    for ts, e, v, _ in list(loop.log.snapshots):
        if ts >= t and (e != epoch or v > version):
            return ts
    return None


def engine_outcomes(g: ProcGroup) -> dict[str, int]:
    """Report outcomes over all engine processes, by status (accepted, unavailable, ...)."""
    out: dict[str, int] = {}
    for p in g.procs:
        if p.role != "engine":
            continue
        for k, v in p.last().items():
            if isinstance(v, int) and k not in ("step", "_t") and not isinstance(v, bool):
                out[k] = out.get(k, 0) + v
    return out


def test_cluster_primary_killed_then_manual_failover(
    cluster: ClusterTopology, routers: Routers
) -> None:
    url = cluster.url
    tag = f"fo{int(time.time() * 1000) % 100000}"
    deps = cluster.deployments_on_distinct_primaries(3, tag)
    # the victim: the primary of slot 0, which redis-py's clients take as their default
    # node; other deployments must not depend on it (they did: COMMAND GETKEYS, COMMAND)
    slot0_primary = cluster.slot_owner(0)[0]
    deps.sort(key=lambda d: cluster.node_for_key(DeploymentKeys(d).snapshot) is not slot0_primary)
    groups = [ProcGroup(url, d) for d in deps]
    try:
        for g in groups:
            start(g)
        loops = [routers.add(url, d, 0, 1) for d in deps]
        wait_until(lambda: all(synced(lp, ENGINES) for lp in loops), 30, "routers in sync")
        victim, others = loops[0], loops[1:]
        slot = cluster.slot_of(DeploymentKeys(deps[0]).snapshot)
        old_primary, replicas = cluster.slot_owner(slot)
        assert old_primary is slot0_primary and replicas, "the victim's primary"
        wait_until(lambda: victim.current() is not None, 5, "a snapshot")
        before = victim.current()
        assert before is not None
        epoch_before = before[0]

        # -- SIGKILL the primary of the victim's slot ------------------------------------
        old_port = cluster.ports[cluster.nodes.index(old_primary)]
        old_primary.kill()
        t_kill = time.monotonic()
        held = hold_port(old_port)  # nobody may take the dead primary's address meanwhile

        def promoted() -> bool:
            primary, _ = cluster.slot_owner(slot)
            return primary is not old_primary and cluster.role(primary) == "master"

        wait_until(promoted, 30, "the replica to be promoted")
        t_promoted = time.monotonic() - t_kill
        wait_until(lambda: first_snapshot_after(victim, t_kill, before), 30, "a new snapshot")
        t_first = (first_snapshot_after(victim, t_kill, before) or 0.0) - t_kill
        wait_until(lambda: synced(victim, ENGINES), 30, "the victim's router back in sync")
        t_synced = time.monotonic() - t_kill
        t_end = time.monotonic()
        now = victim.current()
        assert now is not None
        degraded = degraded_between(victim, t_kill, t_end)
        # the other deployments saw nothing: no degraded decision, and new snapshots
        # while the victim's slot had no primary (one that waited on the dead node would
        # get none before the promotion); their longest gap is recorded, not asserted
        others_gap = max(max_gap(lp, t_kill, t_end) for lp in others)
        for lp in others:
            assert degraded_between(lp, t_kill, t_end) == 0
            assert snapshots_between(lp, t_kill, t_kill + t_promoted), "no snapshot meanwhile"
        held.close()

        # -- the old primary comes back as a replica ---------------------------------------
        old_primary.start()
        wait_until(lambda: cluster.role(old_primary) == "slave", 30, "the old primary to rejoin")

        def known_as_replica() -> bool:
            # by every primary: one that still takes it for a primary denies it its vote
            # ("it is a master node"), and the manual failover below times out
            primaries = [n for n in cluster.nodes if cluster.role(n) == "master"]
            return all(old_primary in cluster.slot_owner(slot, via=n)[1] for n in primaries)

        wait_until(known_as_replica, 30, "every primary to see it replicate the slot")

        # -- manual, graceful CLUSTER FAILOVER back to it ----------------------------------
        def caught_up() -> bool:
            with old_primary.client(socket_timeout=2, decode_responses=True) as c:
                return c.info("replication").get("master_link_status") == "up"

        wait_until(caught_up, 30, "the rejoined node's replication link")
        wait_until(lambda: synced(victim, ENGINES), 30, "the victim in sync")
        before_manual = victim.current()
        assert before_manual is not None
        with old_primary.client(socket_timeout=5) as c:
            c.execute_command("CLUSTER", "FAILOVER")
        t_manual = time.monotonic()
        wait_until(
            lambda: (
                cluster.slot_owner(slot)[0] is old_primary and cluster.role(old_primary) == "master"
            ),
            30,
            "the manual failover",
        )
        t_manual_promoted = time.monotonic() - t_manual
        wait_until(lambda: first_snapshot_after(victim, t_manual, before_manual), 30, "a snapshot")
        t_manual_first = (first_snapshot_after(victim, t_manual, before_manual) or 0) - t_manual
        wait_until(lambda: synced(victim, ENGINES), 30, "in sync after the manual failover")
        after_manual = victim.current()
        assert after_manual is not None
        manual_degraded = degraded_between(victim, t_manual, time.monotonic())
        t_done = time.monotonic()
        for lp in others:
            assert degraded_between(lp, t_manual, t_done) == 0
    finally:
        for g in groups:
            g.close()
    assert_routing_never_failed(*loops)
    # a manual failover waits for the replica to catch up: no state is lost
    assert after_manual[0] == before_manual[0], "the manual failover lost state"
    record(
        "cluster_primary_killed",
        binary=".".join(map(str, cluster.version)),
        node_timeout_ms=NODE_TIMEOUT_MS,
        kill_to_promoted_s=t_promoted,
        kill_to_first_snapshot_s=t_first,
        kill_to_router_in_sync_s=t_synced,
        epoch_changed=now[0] != epoch_before,
        degraded_decisions=degraded,
        other_deployments_degraded_decisions=0,
        other_deployments_longest_snapshot_gap_s=others_gap,
        engine_report_outcomes=engine_outcomes(groups[0]),
    )
    record(
        "cluster_manual_failover",
        binary=".".join(map(str, cluster.version)),
        failover_to_promoted_s=t_manual_promoted,
        failover_to_first_snapshot_s=t_manual_first,
        degraded_decisions=manual_degraded,
        epoch_changed=False,
    )


async def test_cluster_failover_of_one_deployment_never_holds_another_in_one_process() -> None:
    """One process reports two deployments through one sender; the primary of one (the
    default node of redis-py's cluster clients too) is SIGKILLed. With
    ``cluster-require-full-coverage no`` the other's primary serves on: none of its
    reports fails and its barrier keeps completing steps until the replica is promoted
    (it waited on the victim's timeouts and back-off before: 5-8 steps and a pause of
    1.7-1.8 s). Its longest pause is recorded (scripts/bench_isolation.py measures it)."""
    binary = BINARIES.get("system") or next(iter(BINARIES.values()))
    with ClusterTopology(
        binary, replicas=1, node_timeout_ms=NODE_TIMEOUT_MS, full_coverage=False
    ) as cluster:
        slot0 = cluster.slot_owner(0)[0]
        deps = cluster.deployments_on_distinct_primaries(3, f"iso{int(time.time()) % 100000}")
        deps.sort(key=lambda d: cluster.node_for_key(DeploymentKeys(d).snapshot) is not slot0)
        slot = cluster.slot_of(DeploymentKeys(deps[0]).snapshot)
        old = cluster.slot_owner(slot)[0]

        def promoted() -> bool:
            primary, _ = cluster.slot_owner(slot)
            return primary is not old and cluster.role(primary) == "master"

        out = await run_isolation(cluster.url, deps[0], deps[1], old.kill, promoted)
    record(
        "cluster_failover_other_deployment",
        kill_to_promoted_s=out.promoted_s,
        kill_to_victim_accepted_s=out.victim_back_s,
        other_steps_while_down=out.other_steps_while_down,
        other_max_gap_s=out.other_max_gap_s,
        load_avg=out.load_avg[0],
    )
    assert out.other_failed == 0, "a report of the other deployment failed"
    assert out.other_steps_while_down >= 20, out


def _migrate_slot(cluster: ClusterTopology, slot: int, dst: object) -> int:
    """Move ``slot`` to primary ``dst`` while clients use it, the way ``redis-cli
    --cluster reshard`` does; returns the number of keys moved."""
    src, _ = cluster.slot_owner(slot)
    assert src is not dst
    src_id, dst_id = cluster.node_id(src), cluster.node_id(dst)  # type: ignore[arg-type]
    dst_port = cluster.ports[cluster.nodes.index(dst)]  # type: ignore[arg-type]
    moved = 0
    with dst.client(socket_timeout=5) as d, src.client(socket_timeout=5) as s:  # type: ignore[attr-defined]
        d.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
        s.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
        while keys := s.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1):
            s.execute_command("MIGRATE", "127.0.0.1", dst_port, "", 0, 5000, "KEYS", *keys)
            moved += len(keys)
            time.sleep(0.15)  # let the clients hit the half-migrated slot (ASK, TRYAGAIN)
        for node in cluster.nodes:
            if cluster.role(node) == "master":
                with node.client(socket_timeout=5) as c:
                    c.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
    return moved


def test_cluster_slot_migrated_while_running(cluster: ClusterTopology, routers: Routers) -> None:
    url = cluster.url
    dep = cluster.deployments_on_distinct_primaries(1, f"mig{int(time.time() * 1000) % 100000}")[0]
    keys = DeploymentKeys(dep)
    slot = cluster.slot_of(keys.snapshot)
    with ProcGroup(url, dep) as g:
        start(g)
        loop = routers.add(url, dep, 0, 1)
        wait_until(lambda: synced(loop, ENGINES), 30, "router in sync")
        src, _ = cluster.slot_owner(slot)
        dst = next(n for n in cluster.nodes if n is not src and cluster.role(n) == "master")
        before = loop.current()
        assert before is not None
        t0 = time.monotonic()
        moved = _migrate_slot(cluster, slot, dst)
        t_migrated = time.monotonic() - t0
        assert cluster.slot_owner(slot)[0] is dst
        moved_at = time.monotonic()
        at_move = loop.current() or before
        wait_until(lambda: first_snapshot_after(loop, moved_at, at_move), 10, "a snapshot after")
        wait_until(lambda: synced(loop, ENGINES, before[0]), 10, "in sync, same epoch")
        after = loop.current()
        outcomes = engine_outcomes(g)
    with dst.client(socket_timeout=2) as c:
        assert c.exists(keys.snapshot, keys.reports) == 2, "the deployment's keys did not move"
    assert_routing_never_failed(loop)
    assert after is not None and after[0] == before[0], "the migration lost state"
    # TRYAGAIN / ASK while the slot is half-migrated are transient: retried, never errors
    assert outcomes.get("error", 0) == 0, outcomes
    record(
        "cluster_slot_migration",
        binary=".".join(map(str, cluster.version)),
        keys_moved=moved,
        migration_s=t_migrated,
        versions_during=after[1] - before[1],
        degraded_decisions=degraded_between(loop, t0, time.monotonic()),
        engine_report_outcomes=outcomes,
    )


@pytest.mark.skipif("system" not in BINARIES, reason="TLS needs Debian's redis-server")
def test_tls_sentinel_failover_under_load(
    tmp_path: Path, deployment: str, routers: Routers
) -> None:
    """rediss+sentinel:// with TLS on every port and client certificates everywhere."""
    certs = make_certs(tmp_path / "certs")
    with SentinelTopology(BINARIES["system"], certs=certs) as topo:
        url = topo.url
        assert url.startswith("rediss+sentinel://")
        with ProcGroup(url, deployment) as g:
            start(g)
            loops = [routers.add(url, deployment, i, 2) for i in range(2)]
            wait_until(lambda: all(synced(lp, ENGINES) for lp in loops), 30, "routers in sync")
            # nothing answers in plain text on the data or sentinel ports
            with pytest.raises(redis.ConnectionError):
                redis.Redis("127.0.0.1", topo.ports[0], socket_timeout=1).ping()
            with pytest.raises(redis.ConnectionError):
                redis.Redis("127.0.0.1", topo.sentinels[0].port, socket_timeout=1).ping()
            old = topo.kill_primary()
            t_kill = time.monotonic()
            held = hold_port(old)
            topo.wait_failover(old, timeout=40)
            t_promoted = time.monotonic() - t_kill
            wait_until(lambda: all(synced(lp, ENGINES) for lp in loops), 30, "resync")
            t_synced = time.monotonic() - t_kill
            outcomes = engine_outcomes(g)
            held.close()
    assert_routing_never_failed(*loops)
    record(
        "tls_sentinel_failover",
        binary="7.0",
        kill_to_promoted_s=t_promoted,
        kill_to_routers_in_sync_s=t_synced,
        degraded_decisions=sum(degraded_between(lp, t_kill, t_kill + t_synced) for lp in loops),
        engine_report_outcomes=outcomes,
    )
