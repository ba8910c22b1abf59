"""engine-sim's KV events: what its prefix cache publishes, and on which endpoint each
engine of a process publishes (vLLM's wire format, read back by the subscriber's decoder
from a real SUB socket)."""

from __future__ import annotations

import asyncio
import signal
import subprocess

import openai
import pytest
import zmq
import zmq.asyncio
from support.cli import REDISBAL, scrubbed_env
from support.gateway_stack import MODEL
from support.procs import free_port_block

from redisbal.errors import InvalidArgument
from redisbal.integrations.kv_events import BlockRemoved, BlockStored, Event, decode_message
from redisbal.routing.cache_view import sim_token_ids as token_ids
from redisbal.sim.kv_publisher import PublishingCache, TextBlocks, offset_endpoint
from redisbal.sim.prefix_cache import text_blocks

pytestmark = pytest.mark.gateway  # (the HTTP engines need the gateway extra's aiohttp)


class Recorder:
    def __init__(self) -> None:
        self.batches: list[list[Event]] = []

    def publish(self, events: list[Event]) -> None:
        self.batches.append(events)


def blocks(text: str) -> TextBlocks:
    return TextBlocks(text_blocks(text), text)


def u64(hashes: list[int]) -> list[int]:
    """Hashes as vLLM publishes them: unsigned 64-bit (engine-sim's own are signed)."""
    return [h & 0xFFFFFFFFFFFFFFFF for h in hashes]


def test_stored_from_the_first_miss_on_and_evictions_removed() -> None:
    rec = Recorder()
    cache = PublishingCache(6, rec)  # type: ignore[arg-type]
    a = blocks("a" * 64 * 4)
    cache.insert(a)
    assert rec.batches == [[BlockStored(u64(list(a)), None, token_ids("a" * 256), 16, None, "GPU")]]
    cache.insert(blocks("a" * 64 * 4))  # all cached: nothing to say
    assert len(rec.batches) == 1
    b = blocks("a" * 64 * 2 + "b" * 64 * 3)  # shares 2 blocks, 3 new: 1 evicted
    cache.insert(b)
    stored, removed = rec.batches[-1]
    assert stored == BlockStored(
        u64(list(b[2:])), u64([b[1]])[0], token_ids("b" * 192), 16, None, "GPU"
    )
    assert removed == BlockRemoved(u64([a[2]]), "GPU")  # the least recently used
    assert list(cache.blocks) == [a[3], *b]  # the model itself is PrefixCache's


def test_each_engine_publishes_on_its_own_port() -> None:
    assert offset_endpoint("tcp://127.0.0.1:5557", 3) == "tcp://127.0.0.1:5560"
    for bad in ("tcp://127.0.0.1", "udp://h:1", "tcp://127.0.0.1:65535"):
        with pytest.raises(InvalidArgument):
            offset_endpoint(bad, 1)


async def test_engine_k_of_a_process_publishes_on_port_plus_k() -> None:
    """`engine-sim -n 2 --kv-events tcp://127.0.0.1:K` as users run it: engine 1 on K+1."""
    http, kv = free_port_block(2), free_port_block(2)
    proc = subprocess.Popen(
        [REDISBAL, "engine-sim", "--no-report", "--http-port", str(http), "-n", "2",
         "--cache-blocks", "64", "--kv-events", f"tcp://127.0.0.1:{kv}", "--no-summary"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=scrubbed_env(),
    )  # fmt: skip
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{kv + 1}")
    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{http + 1}/v1", api_key="x", max_retries=0, timeout=30
    )
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 60)
        assert "http engines ready" in line, line
        got = None
        for i in range(200):  # until the SUB socket is connected and hears engine 1
            await client.completions.create(model=MODEL, prompt=f"{i:04d}" * 40, max_tokens=1)
            if await sub.poll(50):
                got = decode_message(await sub.recv_multipart())
                break
        assert got is not None, "engine 1 published nothing on its port"
        assert isinstance(got[1].events[0], BlockStored)
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 30) == 0
    finally:
        await client.close()
        ctx.destroy(linger=0)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
