"""engine-sim publishing KV events in vLLM's wire format, `kv-events` following it into
a real Redis, and a router's reader on another connection seeing what the engine holds:
stored, evicted, and cleared when the engine restarts."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable

import openai
import pytest
from support.gateway_stack import FAST, MODEL
from support.helpers import await_until
from support.kv_events import following
from support.procs import free_port_block

from redisbal.integrations.kv_events import Source, Subscriber
from redisbal.routing.cache_view import anchors, chain_hashes
from redisbal.sim.http_engine import HttpEngine
from redisbal.sim.kv_publisher import Publisher, PublishingCache
from redisbal.sim.peer_router_endpoints import token_ids
from redisbal.sim.prefix_cache import text_blocks

pytestmark = pytest.mark.gateway  # (the HTTP engine needs the gateway extra's aiohttp)

CACHE = dataclasses.replace(FAST, cache_blocks=64)  # 64 blocks of 16 tokens (64 characters)
SHARED = "".join(f"system prompt line {i:03d}. " for i in range(50))[:1024]  # 16 blocks


def request_anchors(text: str) -> list[int]:
    return anchors(chain_hashes(token_ids(text)))


@contextlib.asynccontextmanager
async def engine_at(endpoint: str, engine_id: str = "e0") -> AsyncIterator[HttpEngine]:
    engine = HttpEngine(engine_id, redis_url=None, deployment="d", port=0, params=CACHE,
                        kv_events=endpoint)  # fmt: skip
    await engine.start()
    try:
        yield engine
    finally:
        await asyncio.wait_for(engine.stop(drain_s=1), 30)


async def ask(engine: HttpEngine, prompt: str) -> None:
    client = openai.AsyncOpenAI(base_url=engine.url + "/v1", api_key="x", max_retries=0, timeout=30)
    try:
        await client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    finally:
        await client.close()


async def subscribed(
    sub: Subscriber, engine: HttpEngine, heard: Callable[[], bool] | None = None
) -> None:
    """Send distinct short prompts until the subscriber hears the engine (a SUB socket
    misses what is published before it connects), or until ``heard()``."""
    t = sub.trackers["e0"]
    seen = t.stats.batches
    for i in range(200):
        await ask(engine, f"warm-up {i} " * 10)
        if heard() if heard is not None else t.stats.batches > seen:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"the subscriber never heard the engine: seq {t.seq}, {t.stats}")


async def test_the_view_follows_what_the_engine_caches(redis_url: str, deployment: str) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port_block(1)}"
    async with (
        engine_at(endpoint) as engine,
        following(redis_url, deployment, [Source("e0", endpoint)]) as (sub, view),
    ):
        await subscribed(sub, engine)
        prompts = [SHARED + f" user question {i}" for i in range(3)]
        for p in prompts:
            await ask(engine, p)
        want = request_anchors(SHARED)
        assert len(want) == 4
        await await_until(lambda: view.matched_blocks("e0", want) == 16, what="prefix held")
        assert engine.model.cache is not None  # and the engine does hold it
        assert engine.model.cache.match(text_blocks(SHARED)) == 16

        # other prompts push the shared prefix out of the 64-block cache
        for i in range(8):
            await ask(engine, "".join(f"other text {i} {j:04d} " for j in range(60))[:1024])
        await await_until(lambda: view.matched_blocks("e0", want) == 0, what="prefix evicted")

        await ask(engine, SHARED + " back again")
        await await_until(lambda: view.matched_blocks("e0", want) == 16, what="stored again")
        assert not sub.malformed


async def test_a_restarted_publisher_clears_the_view(redis_url: str, deployment: str) -> None:
    """The engine's publisher starts over on the same endpoint (seq from 0, as a
    restarted vLLM's): its old blocks leave the view."""
    endpoint = f"tcp://127.0.0.1:{free_port_block(1)}"
    want = request_anchors(SHARED)
    async with (
        engine_at(endpoint) as engine,
        following(redis_url, deployment, [Source("e0", endpoint)]) as (sub, view),
    ):
        await subscribed(sub, engine)
        for i in range(20):  # the old publisher's seq gets well ahead
            await ask(engine, SHARED + f" question {i}")
        await await_until(lambda: view.matched_blocks("e0", want) == 16, what="held")
        stats = sub.trackers["e0"].stats
        clears = stats.clears
        assert engine.kv_publisher is not None and isinstance(engine.model.cache, PublishingCache)
        engine.kv_publisher.close()  # (a restarted engine's cache is empty too)
        engine.model.cache = PublishingCache(CACHE.cache_blocks, Publisher(endpoint))
        engine.kv_publisher = engine.model.cache.publisher
        # until the restart is heard (the old publisher's last batches may still be on
        # their way)
        await subscribed(sub, engine, lambda: stats.clears > clears)
        await await_until(lambda: view.matched_blocks("e0", want) == 0, what="cleared")
