"""What the subscriber recovers from: batches missed, filled from a replay socket
(vLLM's ROUTER protocol, served here by a real ZeroMQ socket) without clearing the
engine's view, or clearing it without one; and a view Redis lost, written whole."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import redis.asyncio
import zmq
import zmq.asyncio
from support.procs import free_port_block

from redisbal.integrations.kv_events import (
    END_SEQ,
    BlockStored,
    EventBatch,
    Source,
    Subscriber,
    decode_message,
    encode_message,
)
from redisbal.keys import DeploymentKeys
from redisbal.routing.cache_sync import sync_view
from redisbal.routing.cache_view import CacheView, anchors, chain_hashes

TOKENS = list(range(500, 500 + 16 * 40))


def message(seq: int) -> list[bytes]:
    """Batch ``seq`` stores block ``seq`` (parent: block ``seq - 1``)."""
    ev = BlockStored([seq + 1], seq or None, TOKENS[seq * 16 : (seq + 1) * 16], 16, None, "GPU")
    return encode_message(b"kv-events", seq, EventBatch(1.0, [ev], 0))


@contextlib.asynccontextmanager
async def replay_server(endpoint: str, sent: list[list[bytes]]) -> AsyncIterator[list[int]]:
    """Answers each request with the buffered batches from its start on, then the end
    marker; yields the starts asked for."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(endpoint)
    asked: list[int] = []

    async def serve() -> None:
        while True:
            ident, _, start = await sock.recv_multipart()
            asked.append(int.from_bytes(start, "big"))
            for _, seq, payload in sent:
                if int.from_bytes(seq, "big") >= asked[-1]:
                    await sock.send_multipart([ident, b"", seq, payload])
            await sock.send_multipart([ident, b"", END_SEQ.to_bytes(8, "big", signed=True), b""])

    task = asyncio.create_task(serve())
    try:
        yield asked
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        ctx.destroy(linger=0)


async def test_replay_fills_the_start_and_a_gap(redis_url: str, deployment: str) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port_block(1)}"
    buffered = [message(s) for s in range(12)]
    source = Source("e0", "tcp://127.0.0.1:1", replay=endpoint)
    client = redis.asyncio.Redis.from_url(redis_url)
    sub = Subscriber(client, deployment, [source])
    tracker = sub.trackers["e0"]
    try:
        async with replay_server(endpoint, buffered) as asked:
            await sub.receive(source, buffered[3])  # the first heard: 0..2 were missed
            assert asked == [0] and tracker.seq == 3
            await sub.receive(source, buffered[4])
            await sub.receive(source, buffered[7])  # 5 and 6 missed
            assert asked == [0, 5] and tracker.seq == 7
            for s in range(8, 12):
                await sub.receive(source, buffered[s])
        whole = anchors(chain_hashes(TOKENS[: 12 * 16]))
        assert list(tracker.anchors) == whole  # every block named: nothing skipped
        assert tracker.stats.clears == 0 and tracker.stats.skipped == 0
    finally:
        sub.close()
        await client.aclose()


async def test_without_an_answer_the_gap_clears_the_view(redis_url: str, deployment: str) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port_block(1)}"  # nobody serves it
    source = Source("e0", "tcp://127.0.0.1:1", replay=endpoint)
    client = redis.asyncio.Redis.from_url(redis_url)
    sub = Subscriber(client, deployment, [source], replay_timeout_s=0.2)
    tracker = sub.trackers["e0"]
    try:
        await sub.receive(source, message(0))
        for s in range(1, 4):
            await sub.receive(source, message(s))
        assert len(tracker.anchors) == 1
        await sub.receive(source, message(6))  # 4 and 5 missed, no replay: cleared
        assert tracker.stats.clears == 1 and not tracker.anchors and tracker.stats.skipped == 1
    finally:
        sub.close()
        await client.aclose()


async def test_a_view_redis_lost_is_written_whole(redis_url: str, deployment: str) -> None:
    """Redis restarted empty: the next write finds the engine gone from the roster, and
    the one after writes every anchor again (a router bootstrapping then sees them all)."""
    source = Source("e0", "tcp://127.0.0.1:1")
    client = redis.asyncio.Redis.from_url(redis_url)
    sub = Subscriber(client, deployment, [source])
    keys = DeploymentKeys(deployment)
    try:
        for s in range(8):
            sub.handle(source, s, decode_message(message(s))[1])
        await sub.flush()
        assert await client.scard(keys.kv_view("e0")) == 2
        await client.delete(*keys.all_keys(), keys.kv_view("e0"))
        for s in range(8, 12):
            sub.handle(source, s, decode_message(message(s))[1])
        await sub.flush()  # only the new anchor, into an empty Redis: found lost
        await sub.flush()  # written whole
        assert await client.scard(keys.kv_view("e0")) == 3
        view = CacheView()
        await sync_view(client, keys, view)
        assert view.engines["e0"] == set(anchors(chain_hashes(TOKENS[: 12 * 16])))
    finally:
        sub.close()
        await client.aclose()
