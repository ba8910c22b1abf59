"""Auto client indexes (redisbal.routing.lease) against a real redis-server."""

from __future__ import annotations

import asyncio

import pytest
import redis
from support.helpers import Barrier, await_until, server_ms

from redisbal.connection import make_client
from redisbal.keys import DeploymentKeys
from redisbal.routing.lease import ClientLease, apply_lease
from redisbal.routing.router import AsyncRouter
from redisbal.routing.router_core import RouterCore

pytestmark = pytest.mark.servers


async def test_lowest_free_index_count_follows_live_leases(redis_url: str, deployment: str) -> None:
    keys = DeploymentKeys(deployment)
    client = make_client(redis_url, asyncio=True)
    try:
        a, b, c = (ClientLease(client, keys, ttl_s=0.5) for _ in range(3))
        assert await a.renew() == (0, 1)
        assert await b.renew() == (1, 2)
        assert await c.renew() == (2, 3)
        assert await a.renew() == (0, 3)  # renewing keeps the index
        await b.aclose()  # released: index 1 is free again
        d = ClientLease(client, keys, ttl_s=0.5)
        assert await d.renew() == (1, 3)
        await c.aclose()
        # the highest left: the count drops to the live leases
        assert await a.renew() == (0, 2)
        await asyncio.sleep(0.6)  # d stops renewing: its lease expires
        assert await a.renew() == (0, 1)
        # an index is never moved while its lease lives: a lone index 1 counts as 2
        e = ClientLease(client, keys, ttl_s=0.5)
        assert await e.renew() == (1, 2)
        await a.aclose()
        assert await e.renew() == (1, 2)
    finally:
        await client.aclose()


async def test_leases_lost_with_redis_state_come_back_at_their_own_indexes(
    redis_url: str, r: redis.Redis, deployment: str
) -> None:
    """Redis restarted empty: whichever replica renews first must not take the lowest
    index from the other (both would then route as index 0 until the other renewed,
    and the two would end up swapped, each reading the other's admitted counts)."""
    keys = DeploymentKeys(deployment)
    client = make_client(redis_url, asyncio=True)
    try:
        a, b = ClientLease(client, keys), ClientLease(client, keys)
        assert await a.renew() == (0, 1)
        assert await b.renew() == (1, 2)
        r.delete(keys.clients)  # the state lost, as after a restart without persistence
        assert await b.renew() == (1, 2)  # the higher index renews first: kept
        assert await a.renew() == (0, 2)
        # a new replica still takes the lowest free index
        c = ClientLease(client, keys)
        r.delete(keys.clients)
        assert await b.renew() == (1, 2)
        assert await c.renew() == (0, 2)
        assert await a.renew() == (2, 3)  # its index was taken meanwhile: the next free one
    finally:
        await client.aclose()


def test_apply_lease_moves_the_core_and_restarts_the_share_estimate() -> None:
    core = RouterCore(0, 1)
    apply_lease(core, 2, 3)
    assert (core.client_index, core.client_count) == (2, 3)
    assert core.share == pytest.approx(1 / 3) and core.pending_weight == 3.0
    apply_lease(core, 2, 1)  # a count below index + 1 is raised to it
    assert core.client_count == 3


async def test_router_with_auto_index(redis_url: str, deployment: str) -> None:
    r1 = AsyncRouter(redis_url, deployment, "auto", lease_ttl_s=0.6)
    r2 = AsyncRouter(redis_url, deployment, "auto", lease_ttl_s=0.6)
    await r1.start()
    await r2.start()
    try:
        assert r1.client_index == 0 and r2.client_index == 1
        assert r2.core.client_count == 2
        # r1 learns the count at its next renewal
        await await_until(lambda: r1.core.client_count == 2, 5, "r1 counts both")
    finally:
        await r2.aclose()
        await r1.aclose()
    with pytest.raises(ValueError, match="client_index"):
        AsyncRouter(redis_url, deployment, "automatic")


async def test_a_router_moved_to_another_index_reconciles_against_that_index(
    redis_url: str, r: redis.Redis, deployment: str
) -> None:
    """A lease lost (an outage longer than its TTL) may come back as another index,
    whose admitted counts hold none of this router's routes so far: they must not all
    count as pending from then on."""
    keys = DeploymentKeys(deployment)
    bar = Barrier(r, keys)
    bar.configure()
    bar.register("e0", "e1")
    bar.report("e0", 1, adm="0")
    bar.report("e1", 1, adm="0")
    router = AsyncRouter(redis_url, deployment, "auto", lease_ttl_s=0.3, poll_s=0.05)
    await router.start(wait=5)
    try:
        assert router.client_index == 0
        for _ in range(10):
            router.finished(router.route("e0"))
        bar.report("e0", 2, adm="10")  # e0 took them all
        bar.report("e1", 2, adm="0")
        await await_until(lambda: router.snapshot.step == 2, 5, "step 2")  # type: ignore[union-attr]
        assert router.core.by_id["e0"].pending == 0
        # the lease is lost and index 0 taken by another router meanwhile
        r.delete(keys.clients)
        r.zadd(keys.clients, {"0:other": server_ms(r) + 60_000})
        await await_until(lambda: router.client_index == 1, 5, "moved to index 1")
        bar.report("e0", 3, adm="10,0")  # nothing came from index 1 yet
        bar.report("e1", 3, adm="0,0")
        await await_until(lambda: router.snapshot.step == 3, 5, "step 3")  # type: ignore[union-attr]
        assert router.core.by_id["e0"].pending == 0, "routes admitted under index 0 count again"
        router.route("e0")  # a route under the new index: pending until admitted there
        bar.report("e0", 4, adm="10,0")
        bar.report("e1", 4, adm="0,0")
        await await_until(lambda: router.snapshot.step == 4, 5, "step 4")  # type: ignore[union-attr]
        assert router.core.by_id["e0"].pending == 1
        bar.report("e0", 5, adm="10,1")
        bar.report("e1", 5, adm="0,0")
        await await_until(lambda: router.snapshot.step == 5, 5, "step 5")  # type: ignore[union-attr]
        assert router.core.by_id["e0"].pending == 0
    finally:
        await router.aclose()


def test_a_new_count_restarts_the_share_estimate() -> None:
    """A router that leased its index alone estimated a share of 1.0; when a second
    router joins (same index, count 2) its own routes must stand for the other's too."""
    core = RouterCore(0, 1)
    apply_lease(core, 0, 1)
    core._update_share(100, 100)  # alone: everything admitted was its own
    core._update_share(300, 300)
    assert core.share == 1.0 and core.pending_weight == 1.0
    apply_lease(core, 0, 2)
    assert core.share == pytest.approx(0.5) and core.pending_weight == 2.0
    assert core.share_estimate.totals is None  # the next deltas are measured from the next snapshot
    core._update_share(300, 300)
    core._update_share(315, 320)  # 15 of the next 20 admissions
    moved = 0.5 + 20 / 2000 * (15 / 20 - 0.5)
    assert core.share == pytest.approx(moved)
    apply_lease(core, 0, 2)  # the same lease renewed: the estimate goes on
    assert core.share == pytest.approx(moved) and core.share_estimate.totals == (315, 320)
