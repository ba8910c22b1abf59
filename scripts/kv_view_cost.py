#!/usr/bin/env python3
"""What the engines' cache views cost in Redis (routing/cache_sync.py), on a real server:

1. memory: bytes per engine for a full view (``MEMORY USAGE`` of its SET), at a few
   sizes up to kv-events' bound;
2. steady state: ``--engines`` writers (one per engine, as ``redisbal kv-events``
   writes: one change every ``--flush-ms``, anchors added and as many evicted) and
   ``--routers`` readers calling ``sync_view`` every ``--sync-ms``; the bytes Redis
   sends each reader are counted by a relay in front of the server (Redis 7.0 keeps
   no per-client byte count). Also with no change at all (an idle deployment).

The change rate models an engine prefilling ``--new-tokens-per-s`` uncached tokens a
second, every one stored (16-token blocks, every 4th an anchor) and as many evicted:
the cache full, the worst case for the stream.

    python scripts/kv_view_cost.py [--engines 64] [--routers 16] [--seconds 10]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time

import redis.asyncio

from redisbal.keys import DeploymentKeys
from redisbal.routing.cache_sync import server_ms, sync_view, write_change
from redisbal.routing.cache_view import ANCHOR_STRIDE, BLOCK_TOKENS, CacheView
from redisbal.sim.embedded import RedisServer


class Relay:
    """A TCP relay to Redis that counts the bytes the server sends back."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.bytes_out = 0
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _serve(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        sr, sw = await asyncio.open_connection("127.0.0.1", self.port)

        async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter, count: bool) -> None:
            while data := await r.read(65536):
                if count:
                    self.bytes_out += len(data)
                w.write(data)
                await w.drain()
            w.close()

        await asyncio.gather(pipe(cr, sw, False), pipe(sr, cw, True), return_exceptions=True)


async def memory(url: str) -> None:
    client = redis.asyncio.Redis.from_url(url)
    keys = DeploymentKeys("memory")
    rng = random.Random(1)
    now = await server_ms(client)
    print("full view in Redis, one engine:")
    for n in (512, 2048, 8192):
        engine = f"e{n}"
        await write_change(
            client, keys, engine, added=[rng.getrandbits(64) for _ in range(n)],
            cleared=True, now_ms=now,
        )  # fmt: skip
        used = await client.memory_usage(keys.kv_view(engine), samples=0) or 0
        print(f"  {n:5d} anchors ({n * ANCHOR_STRIDE * BLOCK_TOKENS:7d} tokens): "
              f"SET {used:8d} B = {used / n:5.1f} B/anchor (packed: {8 * n} B)")  # fmt: skip
    await client.delete(*keys.all_keys(), *(keys.kv_view(f"e{n}") for n in (512, 2048, 8192)))
    await client.aclose()


async def steady(url: str, port: int, args: argparse.Namespace, changing: bool) -> None:
    keys = DeploymentKeys("steady" if changing else "idle")
    writer = redis.asyncio.Redis.from_url(url)
    relay = Relay(port)
    rport = await relay.start()
    readers = [redis.asyncio.Redis(host="127.0.0.1", port=rport) for _ in range(args.routers)]
    per_flush = args.new_tokens_per_s / BLOCK_TOKENS / ANCHOR_STRIDE * args.flush_ms / 1000
    rng = random.Random(2)
    held: dict[str, list[int]] = {f"e{i}": [] for i in range(args.engines)}
    now = await server_ms(writer)
    for e, anchors in held.items():  # a full cache to start from
        anchors.extend(rng.getrandbits(64) for _ in range(args.anchors))
        await write_change(writer, keys, e, added=anchors, cleared=True, now_ms=now)
    views = [CacheView() for _ in readers]
    cursors = [await sync_view(r, keys, v) for r, v in zip(readers, views, strict=True)]
    stop = time.monotonic() + args.seconds
    writes = changed = 0
    carry = 0.0

    async def write_loop() -> None:
        nonlocal writes, changed, carry
        while time.monotonic() < stop:
            t0 = time.monotonic()
            now = await server_ms(writer)
            todo = []
            for e, anchors in held.items():
                carry += per_flush
                k, carry = int(carry), carry - int(carry)
                if not k:
                    continue
                new = [rng.getrandbits(64) for _ in range(k)]
                gone, anchors[:k] = anchors[:k], []
                anchors.extend(new)
                todo.append(write_change(writer, keys, e, added=new, removed=gone, now_ms=now))
                changed += k
            await asyncio.gather(*todo)  # the engines' subscribers write side by side
            writes += len(todo)
            await asyncio.sleep(max(0.0, args.flush_ms / 1000 - (time.monotonic() - t0)))

    async def read_loop(i: int) -> None:
        while time.monotonic() < stop:
            cursors[i] = await sync_view(readers[i], keys, views[i], cursors[i])
            await asyncio.sleep(args.sync_ms / 1000)

    base = relay.bytes_out
    t0 = time.monotonic()
    loops = [read_loop(i) for i in range(args.routers)]
    await asyncio.gather(*([*loops, write_loop()] if changing else loops))
    took = time.monotonic() - t0
    sent = relay.bytes_out - base
    for i, r in enumerate(readers):  # one more read each: they saw every change?
        await sync_view(r, keys, views[i], cursors[i])
    agree = all(v.engines == views[0].engines for v in views) and all(
        views[0].engines[e] == set(a) for e, a in held.items()
    )
    stream = await writer.memory_usage(keys.kv_changes, samples=0) or 0
    label = "steady" if changing else "idle"
    rate = changed / took
    print(f"{label}: {args.engines} engines x {args.routers} routers, "
          f"{rate:.0f} anchors/s added and as many removed (done, not asked: the writers "
          f"run on this machine's CPU), {writes / took:.0f} writes/s, "
          f"sync every {args.sync_ms} ms, {took:.1f} s")  # fmt: skip
    each = f" ({sent / args.routers / took / max(rate, 1):.1f} B per anchor added and one removed)"
    print(f"  read per router: {sent / args.routers / took:9.0f} B/s{each if rate else ''}; "
          f"all {args.routers} routers: {sent / took:9.0f} B/s")  # fmt: skip
    print(f"  stream in Redis: {stream} B; every view equal to the writers': {agree}")
    for r in readers:
        await r.aclose()
    await writer.aclose()


async def main(args: argparse.Namespace) -> None:
    server = RedisServer(tcp=True).start()
    try:
        print(f"redis-server {server.version}")
        await memory(server.url)
        await steady(server.url, server.port, args, changing=False)
        await steady(server.url, server.port, args, changing=True)
    finally:
        server.cleanup()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", type=int, default=64)
    p.add_argument("--routers", type=int, default=16)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--anchors", type=int, default=2048, help="anchors each engine holds")
    p.add_argument("--new-tokens-per-s", type=float, default=10_000.0)
    p.add_argument("--flush-ms", type=float, default=50.0)
    p.add_argument("--sync-ms", type=float, default=100.0)
    sys.exit(asyncio.run(main(p.parse_args())))
