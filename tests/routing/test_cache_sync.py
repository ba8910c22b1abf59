"""The cache views in Redis: written as deltas, read back by routers (a real server)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import redis.asyncio

from redisbal.keys import DeploymentKeys
from redisbal.routing import cache_sync
from redisbal.routing.cache_sync import (
    SyncCursor,
    drop_views,
    refresh_views,
    server_ms,
    sync_view,
    write_change,
)
from redisbal.routing.cache_view import CacheView


@contextlib.asynccontextmanager
async def connected(url: str) -> AsyncIterator[redis.asyncio.Redis]:
    client = redis.asyncio.Redis.from_url(url)
    try:
        yield client
    finally:
        await client.aclose()


async def test_a_router_bootstraps_then_reads_only_the_changes(
    redis_url: str, keys: DeploymentKeys
) -> None:
    async with connected(redis_url) as ar:
        now = await server_ms(ar)
        await write_change(ar, keys, "e0", added=[1, 2, 3], cleared=True, now_ms=now)
        await write_change(ar, keys, "e1", added=[2**64 - 1], cleared=True, now_ms=now)
        await write_change(ar, keys, "e0", added=[4], removed=[1], now_ms=now)
        view = CacheView()
        cur = await sync_view(ar, keys, view)
        assert view.engines == {"e0": {2, 3, 4}, "e1": {2**64 - 1}} and cur.bootstraps == 1
        other = CacheView()  # a second router, following from the start of the stream
        other_cur = await sync_view(ar, keys, other)

        await write_change(ar, keys, "e1", removed=[2**64 - 1], added=[9], now_ms=now)
        await write_change(ar, keys, "e0", cleared=True, added=[5], now_ms=now)
        cur = await sync_view(ar, keys, view, cur)
        assert view.engines == {"e0": {5}, "e1": {9}} and cur.bootstraps == 1
        await drop_views(ar, keys, ["e1"], now_ms=now)
        cur = await sync_view(ar, keys, view, cur)
        assert view.engines == {"e0": {5}}
        await sync_view(ar, keys, other, other_cur)
        assert other.engines == view.engines
        fresh = CacheView()
        await sync_view(ar, keys, fresh)
        assert fresh.engines == view.engines  # what the stream says is what the SETs hold


async def test_steady_reads_are_deltas_only(redis_url: str, keys: DeploymentKeys) -> None:
    """A quiet stream costs a read of nothing: no SET is read once bootstrapped."""
    async with connected(redis_url) as ar:
        now = await server_ms(ar)
        await write_change(ar, keys, "e0", added=range(1, 2000), cleared=True, now_ms=now)
        view = CacheView()
        cur = await sync_view(ar, keys, view)
        before = (await ar.info("stats"))["total_net_output_bytes"]
        for _ in range(5):
            cur = await sync_view(ar, keys, view, cur)
        after = (await ar.info("stats"))["total_net_output_bytes"]
        assert after - before < 2000  # the SET alone is 16 kB
        assert len(view.engines["e0"]) == 1999


async def test_a_reader_silent_too_long_bootstraps_again(
    redis_url: str, keys: DeploymentKeys
) -> None:
    async with connected(redis_url) as ar:
        now = await server_ms(ar)
        await write_change(ar, keys, "e0", added=[1], cleared=True, now_ms=now)
        view = CacheView()
        cur = await sync_view(ar, keys, view)
        # entries after its cursor may have been trimmed: it must not trust the stream
        stale = SyncCursor(cur.last_id, cur.read_ms - cache_sync.RETENTION_MS, cur.roster_ms)
        view.replace("ghost", [7])  # told once, gone from Redis since
        cur = await sync_view(ar, keys, view, stale)
        assert cur.bootstraps == 2 and view.engines == {"e0": {1}}


async def test_expired_views_are_dropped(redis_url: str, keys: DeploymentKeys) -> None:
    """A subscriber that died stops refreshing: its engines' views expire, and readers
    forget them at their next roster read."""
    async with connected(redis_url) as ar:
        now = await server_ms(ar)
        await write_change(ar, keys, "e0", added=[1], cleared=True, now_ms=now)
        await write_change(
            ar, keys, "gone", added=[2], cleared=True, now_ms=now - 10_000, ttl_ms=1_000
        )
        view = CacheView()
        cur = await sync_view(ar, keys, view)
        assert set(view.engines) == {"e0"}  # already expired: never read
        view.replace("gone", [2])  # told before it expired
        cur = SyncCursor(cur.last_id, cur.read_ms, cur.roster_ms - cache_sync.ROSTER_EVERY_MS)
        await sync_view(ar, keys, view, cur)
        assert set(view.engines) == {"e0"}
        assert await ar.pttl(keys.kv_view("e0")) > 0  # every key expires on its own
        assert await ar.pttl(keys.kv_changes) > 0 and await ar.pttl(keys.kv_engines) > 0


async def test_views_learned_from_routes_outlive_every_read(
    redis_url: str, keys: DeploymentKeys
) -> None:
    """An engine without KV events (none in Redis) keeps the view its router learned of
    it through the bootstrap and the roster reads; one whose events arrive is told."""
    async with connected(redis_url) as ar:
        now = await server_ms(ar)
        await write_change(ar, keys, "e0", added=[1], cleared=True, now_ms=now)
        view = CacheView(learn=8)
        view.learn_route("plain", [0, 0, 0, 5])
        view.learn_route("e0", [0, 0, 0, 6])  # before its events were read
        cur = await sync_view(ar, keys, view)
        assert view.engines == {"plain": {5}, "e0": {1}} and view.told == {"e0"}
        cur = SyncCursor(cur.last_id, cur.read_ms, cur.roster_ms - cache_sync.ROSTER_EVERY_MS)
        cur = await sync_view(ar, keys, view, cur)
        stale = SyncCursor(cur.last_id, cur.read_ms - cache_sync.RETENTION_MS, cur.roster_ms)
        cur = await sync_view(ar, keys, view, stale)
        assert cur.bootstraps == 2 and view.engines == {"plain": {5}, "e0": {1}}
        assert view.holders == {5: {"plain"}, 1: {"e0"}}


async def test_old_entries_are_trimmed(redis_url: str, keys: DeploymentKeys) -> None:
    """By age, whole stream nodes at a time (``~``): 300 entries older than the retention
    (given old ids), then one change: the old nodes go, the change stays."""
    async with connected(redis_url) as ar:
        now = await server_ms(ar)
        past = now - 10 * cache_sync.RETENTION_MS
        for i in range(300):
            await ar.xadd(keys.kv_changes, {"e": "e0"}, id=f"{past}-{i + 1}")
        new = (await write_change(ar, keys, "e0", added=[1], now_ms=now)).entry_id
        left = [i for i, _ in await ar.xrange(keys.kv_changes)]
        assert new in left and len(left) < 150


async def test_a_writer_learns_that_redis_lost_a_view(redis_url: str, keys: DeploymentKeys) -> None:
    async with connected(redis_url) as ar:
        now = await server_ms(ar)
        assert (await write_change(ar, keys, "e0", added=[1], cleared=True, now_ms=now)).lost
        assert not (await write_change(ar, keys, "e0", added=[2], now_ms=now)).lost
        assert await refresh_views(ar, keys, ["e0"], now_ms=now) == []
        await ar.delete(*keys.all_keys(), keys.kv_view("e0"))  # a restart without persistence
        assert (await write_change(ar, keys, "e0", added=[3], now_ms=now)).lost
        await ar.delete(*keys.all_keys(), keys.kv_view("e0"))
        assert await refresh_views(ar, keys, ["e0"], now_ms=now) == ["e0"]
