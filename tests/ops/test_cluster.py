"""Redis Cluster: redis+cluster:// URLs, one slot per deployment, deployments spread
over shards, and the whole flow (reporters -> barrier -> snapshot -> routers) on a real
local cluster of three primaries.

Snapshots travel by sharded pub/sub (SSUBSCRIBE / SPUBLISH) on 7.x and by classic
pub/sub on 6.2, which has no sharded pub/sub: both binaries are tested when present.
Routers here poll the stored snapshot only every 30 s, so every snapshot they get
within the test's deadlines came through pub/sub.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from support.cli import REDISBAL, run_cli, scrubbed_env
from support.helpers import await_until
from support.procs import hold_port
from support.topology import (
    ClusterTopology,
    EveryClass,
    apply_acl_lines,
    binaries,
    every_class_flow,
    make_certs,
)

import redisbal
from redisbal import Counts
from redisbal.connection import BadRedisURL, is_cluster, make_client, parse_url
from redisbal.keys import DeploymentKeys
from redisbal.ops.cli_options import command_client
from redisbal.ops.coordinator import Coordinator, CoordinatorConfig

pytestmark = [pytest.mark.servers, pytest.mark.slow]

BINARIES = binaries()
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cluster(server_name: str) -> Iterator[ClusterTopology]:
    with ClusterTopology(BINARIES[server_name]) as topo:
        yield topo


@pytest.fixture
def own_cluster(server_name: str) -> Iterator[ClusterTopology]:
    """A cluster for one test that kills a node. Its node timeout outlasts the test, so
    the cluster never marks that node failed: only the clients can notice."""
    with ClusterTopology(BINARIES[server_name], node_timeout_ms=120_000) as topo:
        yield topo


# -- URL parsing (pure) ---------------------------------------------------------------------------


def test_cluster_url_is_parsed_with_every_seed_node_and_credentials() -> None:
    t = parse_url("rediss+cluster://app:s3cr%40t@10.0.0.1:7000,[::1]:7001?ssl_ca_certs=/ca.pem")
    assert t.kind == "cluster" and t.tls
    assert t.hosts == (("10.0.0.1", 7000), ("::1", 7001))
    assert (t.username, t.password) == ("app", "s3cr@t")
    assert t.options == {"ssl_ca_certs": "/ca.pem"}
    assert "s3cr" not in t.safe_url


@pytest.mark.parametrize(
    "url",
    ["redis+cluster://", "redis+cluster://host", "redis+cluster://h:1,h:x", "redis+clusterx://h:1"],
)
def test_bad_cluster_urls_are_refused_with_a_clear_error(url: str) -> None:
    with pytest.raises(BadRedisURL):
        parse_url(url)


# -- one slot per deployment, deployments spread over shards ---------------------------------------


def test_every_key_of_a_deployment_is_in_one_slot_and_deployments_spread(
    cluster: ClusterTopology,
) -> None:
    """Invariant 7 on a real cluster: CLUSTER KEYSLOT agrees for every key and the
    channel; twelve deployments land on more than one primary."""
    owners = set()
    with cluster.nodes[0].client(socket_timeout=2) as c:
        for i in range(12):
            keys = DeploymentKeys(f"model-{i}")
            names = [*keys.all_keys(), keys.channel]
            slots = {int(c.execute_command("CLUSTER", "KEYSLOT", k)) for k in names}
            assert len(slots) == 1, f"{keys.deployment}: keys in slots {slots}"
            owners.add(cluster.nodes.index(cluster.node_for_key(keys.snapshot)))
    assert len(owners) >= 2, "twelve deployments all hashed to one primary"


# -- the whole flow on the cluster ---------------------------------------------------------------


async def test_full_flow_on_cluster_for_deployments_on_three_shards(
    cluster: ClusterTopology,
) -> None:
    """Per deployment (each on a different primary): a coordinator, a blocking and an
    asyncio reporter, an AsyncRouter and a Router. Every step's snapshot reaches both
    routers through pub/sub (sharded on 7.x, classic on 6.2), the stall guard forces
    over a silent engine, and each deployment's keys live on the primary of its slot."""
    url = cluster.url
    sharded = cluster.version >= (7, 0, 0)
    deps = cluster.deployments_on_distinct_primaries(3, f"flow{int(time.time() * 1000) % 100000}")
    cfg = CoordinatorConfig(join_grace_ms=0, stall_ms=150, idle_publish_ms=60_000)
    coords = [Coordinator(url, d, cfg, interval_s=0.02) for d in deps]
    sync_reps = [redisbal.Reporter(url, d, "e0", heartbeat=False) for d in deps]
    async_reps = [redisbal.AsyncReporter(url, d, "e1", heartbeat=False) for d in deps]
    arouters = [redisbal.AsyncRouter(url, d, 0, 2, poll_s=30.0) for d in deps]
    srouters = [redisbal.Router(url, d, 1, 2, poll_s=30.0) for d in deps]
    try:
        assert all(is_cluster(c.client) for c in coords)
        for c in coords:
            c.tick()  # lease + config
        for rep in sync_reps:
            rep.register(wait=True)  # idempotent (a blocking reporter registers when built)
        for arep in async_reps:
            assert await arep.register(wait=True)
        for ar in arouters:
            await ar.start()
        for sr in srouters:
            await asyncio.to_thread(sr.start)
        for step in range(1, 4):
            for rep, arep in zip(sync_reps, async_reps, strict=True):
                assert rep.report(Counts(step=step, waiting=step, running=10), wait=True).accepted
                res = await arep.report(Counts(step=step, waiting=0, running=10 + step), wait=True)
                assert res.accepted and res.version == step, res

            def all_routers_at(step: int = step) -> bool:
                return all(
                    r.snapshot is not None and r.snapshot.cut == (0, step)
                    for r in [*arouters, *srouters]
                )

            await await_until(all_routers_at, 10, f"every router at step {step}")
        for ar in arouters:
            snap = ar.snapshot
            assert snap is not None and snap.engines["e0"].waiting == 3
            assert snap.engines["e1"].running == 13
            assert ar.route().engine_id in ("e0", "e1")
            assert not ar.degraded

        # the stall guard on the cluster: e1 goes quiet, the coordinator forces step 4
        for rep in sync_reps:
            rep.report(Counts(step=4, waiting=4, running=10), wait=True)

        def forced_everywhere() -> bool:
            for c in coords:
                c.tick()
            return all(r.snapshot is not None and r.snapshot.forced for r in arouters)

        await await_until(forced_everywhere, 10, "forced snapshots", interval=0.05)
        for ar in arouters:
            snap = ar.snapshot
            assert snap is not None and snap.forced and snap.cut == (0, 4)
            assert set(snap.laggards) == {"e1"}

        # where things live: each deployment on its own primary, subscribed there
        for d in deps:
            keys = DeploymentKeys(d)
            owner = cluster.node_for_key(keys.snapshot)
            with owner.client(socket_timeout=2) as c:
                assert c.exists(keys.snapshot, keys.meta, keys.reports) == 3
                if sharded:
                    got = c.execute_command("PUBSUB", "SHARDNUMSUB", keys.channel)
                    assert int(got[1]) == 2, got  # the AsyncRouter and the Router
                slot = int(c.execute_command("CLUSTER", "KEYSLOT", keys.snapshot))
                assert int(c.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot)) >= 3
            for n in cluster.nodes:
                if n is not owner:
                    with n.client(socket_timeout=2) as c:
                        assert int(c.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot)) == 0
        if not sharded:
            # 6.2: classic subscriptions (PUBSUB NUMSUB is per node; add them up)
            for d in deps:
                ch = DeploymentKeys(d).channel
                total = 0
                for n in cluster.nodes:
                    with n.client(socket_timeout=2) as c:
                        total += int(c.execute_command("PUBSUB", "NUMSUB", ch)[1])
                assert total == 2
    finally:
        for sr in srouters:
            await asyncio.to_thread(sr.close)
        for ar in arouters:
            await ar.aclose()
        for rep in sync_reps:
            rep.close()
        for arep in async_reps:
            await arep.aclose()
        for c in coords:
            c.release()
            c.client.close()


async def test_a_deployment_does_not_depend_on_the_primary_of_slot_0(
    own_cluster: ClusterTopology,
) -> None:
    """redis-py's cluster clients take the first primary of the slot map (slot 0's) as
    their default node, and asked it COMMAND GETKEYS for every FCALL and COMMAND at
    every re-initialization (after CLUSTERDOWN, say): with that primary dead, every
    deployment on the cluster failed until a replica took over. Here it is killed and a
    deployment on another primary goes on: the coordinator's and the reporter's calls,
    the router's feed, and a client that re-initializes."""
    cluster = own_cluster
    url = cluster.url
    doomed = cluster.slot_owner(0)[0]
    names = (f"slot0-{int(time.time() * 1000) % 100000}-{i}" for i in range(500))
    dep = next(d for d in names if cluster.node_for_key(DeploymentKeys(d).snapshot) is not doomed)
    keys = DeploymentKeys(dep)
    cfg = CoordinatorConfig(join_grace_ms=0, idle_publish_ms=60_000)
    coord = Coordinator(url, dep, cfg, interval_s=0.02)
    rep = redisbal.Reporter(url, dep, "e0", heartbeat=False)
    router = redisbal.AsyncRouter(url, dep, 0, 1, poll_s=30.0)
    client = make_client(url, asyncio=True)
    held = None
    try:
        coord.tick()  # lease + config
        rep.register(wait=True)
        await router.start()
        assert rep.report(Counts(step=1, waiting=1, running=1), wait=True).accepted
        await await_until(lambda: router.snapshot is not None, 10, "a first snapshot")
        assert await client.get(keys.snapshot) is not None

        doomed.kill()
        held = hold_port(cluster.ports[cluster.nodes.index(doomed)])  # refused, not taken
        coord.tick()  # FCALL on 7.x: its keys are read locally, no GETKEYS anywhere
        res = rep.report(Counts(step=2, waiting=2, running=1), wait=True)
        assert res.accepted, res

        def at_step_2() -> bool:
            snap = router.snapshot
            return snap is not None and snap.engines["e0"].waiting == 2

        await await_until(at_step_2, 10, "the step 2 snapshot through pub/sub")
        assert not router.degraded and router.last_error is None
        # what redis-py does on CLUSTERDOWN: drop every connection, re-initialize on the
        # next call (and ask for the COMMAND table again: from the dead default node)
        await client.aclose()
        assert await client.get(keys.snapshot) is not None
    finally:
        await client.aclose()
        await router.aclose()
        rep.close()
        coord.client.close()
        if held is not None:
            held.close()


def test_status_ends_in_one_line_when_the_deployments_primary_stops_answering(
    own_cluster: ClusterTopology,
) -> None:
    """The primary of the deployment's slot SIGSTOPped (it accepts connections and answers
    nothing): ``redisbal status`` ends with one line and exit status 1. Its client tries a
    call at most twice: redis-py's cluster client tries 11 times about a second apart,
    and status took 25 s to say what it says in 4. The deadline only catches a hang."""
    cluster, dep = own_cluster, "stopped-primary"
    owner = cluster.node_for_key(DeploymentKeys(dep).snapshot)
    port = cluster.ports[cluster.nodes.index(owner)]
    client = command_client(cluster.url)
    try:
        assert client.retry.get_retries() == 1
    finally:
        client.close()
    assert owner.proc is not None
    owner.proc.send_signal(signal.SIGSTOP)
    try:
        out = run_cli("--redis-url", cluster.url, "--deployment", dep, "status", timeout=120)
    finally:
        owner.proc.send_signal(signal.SIGCONT)
    assert out.returncode == 1, out.stderr
    line = f"Error: cannot reach Redis at {cluster.url}: Timeout reading from 127.0.0.1:{port}"
    assert [x for x in out.stderr.splitlines() if x.startswith("Error:")] == [line], out.stderr
    assert "Traceback" not in out.stderr


def test_scripts_reload_after_script_flush_on_every_node(cluster: ClusterTopology) -> None:
    """NOSCRIPT on the slot's node (SCRIPT FLUSH, or a node that never saw the
    script) is handled by register_script: the report still goes through."""
    dep = f"flush{int(time.time() * 1000) % 100000}"
    rep = redisbal.Reporter(cluster.url, dep, "e0", heartbeat=False)
    try:
        assert rep.report(Counts(step=1, waiting=1, running=1), wait=True).accepted
        for n in cluster.nodes:
            with n.client() as c:
                c.script_flush()
        assert rep.report(Counts(step=2, waiting=1, running=1), wait=True).accepted
    finally:
        rep.close()


def test_cluster_client_refuses_a_cross_slot_script_call(cluster: ClusterTopology) -> None:
    """The guard that makes the one-slot rule matter: keys of two deployments in one
    script call are refused by the cluster, so redisbal never does it."""
    client = make_client(cluster.url)
    try:
        a, b = cluster.deployments_on_distinct_primaries(2, "xslot")
        with pytest.raises(redis.exceptions.RedisClusterException):
            client.eval("return 1", 2, DeploymentKeys(a).snapshot, DeploymentKeys(b).snapshot)
    finally:
        client.close()


def test_local_cluster_script_and_the_cli_on_it() -> None:
    """scripts/local_cluster.py starts a cluster and prints its URL; the CLI's
    coordinator, engine-sim, api and status all run on it."""
    env = scrubbed_env()
    script = subprocess.Popen(
        [sys.executable, str(ROOT / "scripts" / "local_cluster.py"), "--duration", "60"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    procs: list[subprocess.Popen[str]] = []
    try:
        assert script.stdout is not None
        url = ""
        deadline = time.monotonic() + 30
        while not url and time.monotonic() < deadline:
            line = script.stdout.readline()
            if line.startswith("export REDISBAL_REDIS_URL="):
                url = line.split("=", 1)[1].strip()
        assert url.startswith("redis+cluster://127.0.0.1:"), url
        env["REDISBAL_REDIS_URL"] = url
        env["REDISBAL_DEPLOYMENT"] = "clicluster"
        procs.append(
            subprocess.Popen(
                [
                    REDISBAL,
                    "coordinator",
                    "--expect",
                    "2",
                    "--join-grace-ms",
                    "0",
                    "--duration",
                    "20",
                ],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
        procs.append(
            subprocess.Popen(
                [REDISBAL, "engine-sim", "--engines", "2", "--duration", "20", "--no-summary"],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
        api = subprocess.run(
            [REDISBAL, "api", "--burst", "40", "--burst-every", "0.5", "--duration", "2",
             "--wait-engines", "15", "--drain-timeout", "15", "--quiet"],
            env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert api.returncode == 0, api.stderr[-2000:]
        st = subprocess.run(
            [REDISBAL, "status", "--json"], env=env, capture_output=True, text=True, timeout=30
        )
        assert st.returncode == 0, st.stderr
        status = json.loads(st.stdout)
        assert {e["engine"] for e in status["engines"]} == {"0", "1"}, status
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(10)
        script.terminate()
        script.wait(30)
        for p in (*procs, script):  # their pipes too: an open one warns when collected
            for pipe in (p.stdout, p.stderr):
                if pipe is not None:
                    pipe.close()


async def test_least_privilege_users_on_cluster(cluster: ClusterTopology) -> None:
    """The ACL lines of docs/DEPLOY.md plus its cluster additions, on every node (the
    6.2 variant on 6.2): each role does its job on the cluster, and the router user
    still cannot write."""
    dep = cluster.deployments_on_distinct_primaries(1, f"acl{int(time.time() * 1000) % 100000}")[0]
    secret = "cluster-acl-pw"
    users: dict[str, str] = {}
    for node in cluster.nodes:
        with node.client() as c:
            users = apply_acl_lines(
                c, dep, secret, ("acl", "acl-cluster"), sharded=cluster.version >= (7,)
            )
    hosts = ",".join(f"127.0.0.1:{p}" for p in cluster.ports)

    def url(role: str) -> str:
        return f"redis+cluster://{users[role]}:{role}-{secret}@{hosts}"

    async with EveryClass(
        url("coordinator"), dep, engine_url=url("engine"), router_url=url("router")
    ) as flow:
        await flow.run(exchange=cluster.version >= (7,))  # (6.2: no selector for routes)
        assert flow.coord.stats.errors == 0
        writer = make_client(url("router"))
        try:
            with pytest.raises(redis.exceptions.NoPermissionError):
                writer.set(DeploymentKeys(dep).snapshot, "forged")
        finally:
            writer.close()


def test_tls_cluster_with_client_certificates(tmp_path: Path) -> None:
    """rediss+cluster://: every node TLS-only (clients and cluster bus) with client
    certificates; reporters, routers and the coordinator work through it."""
    if "system" not in BINARIES:
        pytest.skip("needs Debian's TLS-capable redis-server")
    with ClusterTopology(BINARIES["system"], certs=make_certs(tmp_path)) as tls_cluster:
        assert parse_url(tls_cluster.url).tls
        asyncio.run(every_class_flow(tls_cluster.url, "tlsdep"))
