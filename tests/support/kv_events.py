"""Shared by the KV-event tests: a ``redisbal kv-events`` subscriber writing to a real
Redis, and a router's view of it read from another connection."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import redis.asyncio

from redisbal.integrations.kv_events import Source, Subscriber
from redisbal.keys import DeploymentKeys
from redisbal.routing.cache_sync import sync_view
from redisbal.routing.cache_view import CacheView


@contextlib.asynccontextmanager
async def following(
    redis_url: str, deployment: str, sources: list[Source], view: CacheView | None = None
) -> AsyncIterator[tuple[Subscriber, CacheView]]:
    """A subscriber writing to Redis, and a router's view (``view``: a RouterCore's, say)
    kept fresh from another connection (as a router's loop does)."""
    writer = redis.asyncio.Redis.from_url(redis_url)
    reader = redis.asyncio.Redis.from_url(redis_url)
    sub = Subscriber(writer, deployment, sources, flush_s=0.01)
    view = CacheView() if view is None else view
    stop = asyncio.Event()

    async def router() -> None:  # (stopped by the event: a redis-py call cancelled
        cursor = None  # mid-pipeline can leave its pool's release waiting for ever)
        while not stop.is_set():
            cursor = await sync_view(reader, DeploymentKeys(deployment), view, cursor)
            await asyncio.sleep(0.01)

    run = asyncio.create_task(sub.run(stop))
    sync = asyncio.create_task(router())
    try:
        yield sub, view
    finally:
        stop.set()
        await asyncio.wait_for(run, 30)
        await asyncio.wait_for(sync, 30)
        await writer.aclose()
        await reader.aclose()
