"""engine-sim's KV-cache events, in vLLM's wire format (``engine-sim --kv-events``).

An HTTP engine with a prefix cache (``--cache-blocks``) publishes what its cache stores
and evicts as vLLM's ZeroMQ publisher does (``integrations/kv_events.py``), so the
peers' KV-aware routers and ``redisbal kv-events`` can follow it. Its engine block
hashes are ``prefix_cache.text_blocks``' ints, a block's parent the block before it,
and its token ids the HTTP engines' (4 characters a token).

Only :class:`PublishingCache` publishes: an engine without ``--kv-events`` keeps the
plain ``PrefixCache`` and pays nothing. Each insert is one batch: the blocks from the
first one not cached on (vLLM recomputes every block after a miss and stores them all
again, so their names reach the subscriber again) as one BlockStored, and the LRU's
evictions as one BlockRemoved.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Any

from redisbal.errors import InvalidArgument, SetupFailed
from redisbal.integrations.kv_events import (
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    encode_message,
    load_zmq,
)
from redisbal.routing.cache_view import BLOCK_TOKENS, CHARS_PER_TOKEN
from redisbal.routing.cache_view import sim_token_ids as token_ids
from redisbal.sim.prefix_cache import PrefixCache

_BLOCK_CHARS = BLOCK_TOKENS * CHARS_PER_TOKEN


def _u64(block: Any) -> Any:
    """A block hash as vLLM publishes it: an unsigned 64-bit integer (engine-sim's are
    signed; vllm-router refuses a negative one)."""
    return block & 0xFFFFFFFFFFFFFFFF if isinstance(block, int) else block


class TextBlocks(tuple[int, ...]):
    """A prompt's blocks (``text_blocks``) that remember the text they were made from,
    so a publishing cache can send each block's token ids."""

    text: str

    def __new__(cls, blocks: Sequence[int], text: str) -> TextBlocks:
        self = super().__new__(cls, blocks)
        self.text = text
        return self


def offset_endpoint(endpoint: str, index: int) -> str:
    """Engine ``index``'s endpoint: the port plus the index (as vLLM offsets its data-
    parallel ranks' ports)."""
    host, sep, port = endpoint.rpartition(":")
    if not endpoint.startswith("tcp://") or not sep or not port.isdigit():
        raise InvalidArgument(f"{endpoint!r} is not a ZeroMQ endpoint like tcp://127.0.0.1:5557")
    p = int(port) + index
    if not 0 < p <= 65535:
        raise InvalidArgument(f"{endpoint!r}: port {p} (+ engine index) is out of range")
    return f"{host}:{p}"


class Publisher:
    """A bound ZeroMQ PUB socket sending batches with vLLM's seq numbers (from 0)."""

    def __init__(self, endpoint: str, topic: bytes = b"") -> None:
        zmq = load_zmq()
        self.endpoint = endpoint
        self.topic = topic
        self.seq = 0
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._noblock = zmq.NOBLOCK
        self._again = zmq.Again
        try:
            self._sock.bind(endpoint)
        except zmq.ZMQError as exc:
            self._ctx.destroy(linger=0)
            raise SetupFailed(f"--kv-events: cannot bind {endpoint}: {exc}") from None

    def publish(self, events: list[Event]) -> None:
        msg = encode_message(self.topic, self.seq, EventBatch(time.time(), events, 0))
        self.seq += 1
        # PUB drops past its high-water mark, as vLLM's does: subscribers see the gap
        with contextlib.suppress(self._again):
            self._sock.send_multipart(msg, flags=self._noblock)

    def close(self) -> None:
        self._ctx.destroy(linger=0)


class PublishingCache(PrefixCache):
    """A ``PrefixCache`` that publishes its stores and evictions."""

    __slots__ = ("publisher",)

    def __init__(self, capacity_blocks: int, publisher: Publisher) -> None:
        super().__init__(capacity_blocks)
        self.publisher = publisher

    def insert(self, blocks: Sequence[int]) -> None:
        """``PrefixCache.insert``, publishing what it stored and evicted."""
        cached = self.blocks
        first = len(blocks)
        for i, b in enumerate(blocks):
            if b in cached:
                cached.move_to_end(b)
            else:
                first = min(first, i)
                cached[b] = None
        evicted: list[int | bytes] = []
        while len(cached) > self.capacity:
            evicted.append(cached.popitem(last=False)[0])
        events: list[Event] = []
        text: Any = getattr(blocks, "text", None)
        if first < len(blocks) and isinstance(text, str):
            events.append(
                BlockStored(
                    [_u64(b) for b in blocks[first:]],
                    _u64(blocks[first - 1]) if first else None,
                    token_ids(text[first * _BLOCK_CHARS : len(blocks) * _BLOCK_CHARS]),
                    BLOCK_TOKENS,
                    medium="GPU",  # as vLLM's GPU block pool says (vllm-router needs it)
                )
            )
        if evicted:
            events.append(BlockRemoved([_u64(b) for b in evicted], "GPU"))
        if events:
            self.publisher.publish(events)
