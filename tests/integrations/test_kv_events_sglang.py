"""SGLang's KV events, as its publisher lays them out, followed by ``redisbal kv-events``
into a real Redis, and a router routing on what lands there.

No SGLang runs here (it needs a GPU): the frames are built by hand to the layout of
SGLang's publisher and radix cache, read in sgl-project/sglang
(python/sglang/srt/disaggregation/kv_events.py at 006d053f and 612d5790, and a later
release with ``medium`` and salted blocks; mem_cache/radix_cache.py at 006b0e3d):

- msgspec structs with ``array_like=True`` and ``tag=True``: each event is an array
  led by its class name, the batch ``[ts, events]`` or ``[ts, events, attn_dp_rank]``;
- the radix cache stores one page per BlockStored (``block_size`` = ``--page-size``),
  each page's hash chained from the one before (a signed 64-bit int: the first 8 bytes
  of a SHA-256 over the prior digest and the page's tokens), the first page of a node
  parented by its parent node's last page, the root's children by nil;
- eviction removes leaves: one BlockRemoved per page of the evicted node;
- frames ``[topic, seq, payload]``, topic ``""`` by default, seq 8 bytes big-endian
  from 0."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
from typing import Any

import msgpack
import pytest
import redis.asyncio
import zmq
import zmq.asyncio
from support.helpers import await_until, cache_core
from support.kv_events import following
from support.procs import free_port_block

from redisbal.errors import MalformedData
from redisbal.integrations.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineTracker,
    Source,
    Subscriber,
    decode_message,
)
from redisbal.routing.cache_view import anchors, chain_hashes

PAGE = 16
SYSTEM = list(range(1000, 1000 + 16 * PAGE))  # a 256-token system prompt: 16 pages
QUESTION = list(range(5000, 5000 + 4 * PAGE))  # a user's 64 tokens after it

# the layouts SGLang's releases send: (the batch carries attn_dp_rank, events carry
# medium)
LAYOUTS = {"ts-events": (False, False), "dp-rank": (True, False), "medium": (True, True)}


def page_hashes(tokens: list[int], prior: bytes | None = None) -> list[tuple[int, bytes]]:
    """Each page's (published hash, digest), chained as SGLang's radix cache chains them."""
    out = []
    for i in range(0, len(tokens), PAGE):
        h = hashlib.sha256(prior or b"")
        for t in tokens[i : i + PAGE]:
            h.update(t.to_bytes(4, "little"))
        prior = h.digest()
        out.append((int.from_bytes(prior[:8], "big", signed=True), prior))
    return out


def node_stored(
    tokens: list[int],
    parent: tuple[int, bytes] | None = None,
    *,
    medium: str | None = "GPU",
    salt: str | None = None,
) -> list[list[Any]]:
    """What SGLang's radix cache queues when it inserts a node of ``tokens`` below
    ``parent`` (the parent node's last page): one BlockStored per page."""
    events: list[list[Any]] = []
    prev = parent[0] if parent else None
    for k, (h, _) in enumerate(page_hashes(tokens, parent[1] if parent else None)):
        ev: list[Any] = ["BlockStored", [h], prev, tokens[k * PAGE : (k + 1) * PAGE], PAGE, None]
        if medium is not None:
            ev.append(medium)
        if salt is not None:
            ev.append({"cache_salt": salt})
        events.append(ev)
        prev = h
    return events


def node_removed(
    tokens: list[int], parent: tuple[int, bytes] | None = None, medium: str | None = "GPU"
) -> list[list[Any]]:
    """An evicted node: one BlockRemoved per page."""
    hashes = page_hashes(tokens, parent[1] if parent else None)
    return [["BlockRemoved", [h]] + ([medium] if medium else []) for h, _ in hashes]


def frames(seq: int, events: list[list[Any]], layout: str = "medium") -> list[bytes]:
    """The multipart message SGLang's ZmqEventPublisher sends (default topic "")."""
    rank, _ = LAYOUTS[layout]
    batch: list[Any] = [1765000000.25, events] + ([0] if rank else [])
    return [b"", seq.to_bytes(8, "big"), msgpack.packb(batch)]


def events_of(layout: str) -> list[list[Any]]:
    _, medium = LAYOUTS[layout]
    m = "GPU" if medium else None
    last = page_hashes(SYSTEM)[-1]
    return [
        *node_stored(SYSTEM, medium=m),
        *node_stored(QUESTION, last, medium=m),
        *node_removed(QUESTION, last, medium=m),
        ["AllBlocksCleared"],
    ]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_each_release_s_layout_is_read(layout: str) -> None:
    seq, batch = decode_message(frames(7, events_of(layout), layout))
    assert seq == 7 and batch.unknown == 0
    assert batch.data_parallel_rank == (0 if LAYOUTS[layout][0] else None)
    hashes = page_hashes(SYSTEM)
    first, second = batch.events[0], batch.events[1]
    assert isinstance(first, BlockStored) and isinstance(second, BlockStored)
    assert first.block_hashes == [hashes[0][0]] and first.parent_block_hash is None
    assert second.parent_block_hash == hashes[0][0]  # chained page by page
    assert first.token_ids == SYSTEM[:PAGE] and first.block_size == PAGE
    assert first.medium == ("GPU" if LAYOUTS[layout][1] else None)
    assert first.lora_id is None and first.cache_salt is None
    assert any(h < 0 for h, _ in hashes)  # signed 64-bit hashes, negative ones too
    assert [type(e) for e in batch.events[-5:]] == [BlockRemoved] * 4 + [AllBlocksCleared]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_tracker_names_sglang_pages_as_a_router_names_the_prompt(layout: str) -> None:
    t = EngineTracker("e0")
    _, batch = decode_message(frames(0, events_of(layout)[:20], layout))  # stored only
    t.apply(batch)
    assert list(t.anchors) == anchors(chain_hashes(SYSTEM + QUESTION))
    assert t.stats.skipped == 0
    t.apply(decode_message(frames(1, node_removed(QUESTION, page_hashes(SYSTEM)[-1])))[1])
    assert list(t.anchors) == anchors(chain_hashes(SYSTEM))


def test_salted_and_host_tier_pages_are_not_counted() -> None:
    """A salted page is reused only by requests with its salt (routers do not see
    salts); a page copied to host memory (HiCache) is not on the GPU."""
    t = EngineTracker("e0")
    salted = node_stored(SYSTEM, salt="tenant-a")
    host = node_stored(SYSTEM, medium="CPU_PINNED")
    _, batch = decode_message(frames(0, salted + host))
    assert isinstance(batch.events[0], BlockStored) and batch.events[0].cache_salt == "tenant-a"
    t.apply(batch)
    assert not t.anchors and t.stats.skipped == 32
    t.apply(decode_message(frames(1, node_stored(SYSTEM)))[1])
    assert list(t.anchors) == anchors(chain_hashes(SYSTEM))


def test_eagle_s_token_pair_keys_are_refused_as_malformed() -> None:
    """With EAGLE, SGLang's radix cache keys pages by token pairs, and its events carry
    the pairs as token ids: no view can be named from them."""
    pairs = [[t, t + 1] for t in SYSTEM[:PAGE]]
    with pytest.raises(MalformedData, match="token_ids"):
        decode_message(frames(0, [["BlockStored", [5], None, pairs, PAGE, None, "GPU"]]))


async def test_pages_smaller_than_our_block_are_skipped_and_said_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """SGLang's default page size is 1 token: a page is not a whole 16-token block."""
    source = Source("e0", "tcp://127.0.0.1:1")
    client = redis.asyncio.Redis()  # (never used: nothing is flushed)
    sub = Subscriber(client, "d", [source])
    caplog.set_level(logging.WARNING, "redisbal.kv_events")
    try:
        for seq in range(2):
            tokens = SYSTEM[seq * PAGE : (seq + 1) * PAGE]
            one_token_pages = [["BlockStored", [t], None, [t], 1, None, "GPU"] for t in tokens]
            sub.handle(source, *decode_message(frames(seq, one_token_pages)))
        tracker = sub.trackers["e0"]
        assert not tracker.anchors and tracker.stats.skipped == 2 * PAGE
        said = [r.getMessage() for r in caplog.records if "not a multiple" in r.getMessage()]
        assert len(said) == 1 and "blocks of 1 tokens" in said[0] and "--page-size" in said[0]
    finally:
        sub.close()
        await client.aclose()


async def test_an_sglang_engine_s_cache_reaches_the_routers_and_routing_follows_it(
    redis_url: str, deployment: str
) -> None:
    """A real PUB socket bound as SGLang binds its endpoint (tcp://*:port), the
    subscriber following it into Redis, and a router's view read from there."""
    port = free_port_block(1)
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"tcp://*:{port}")
    core = cache_core({f"e{i}": (0, 4) for i in range(4)})
    sources = [Source("e2", f"tcp://127.0.0.1:{port}")]
    seqs = itertools.count()

    async def publish(events: list[list[Any]]) -> None:
        await pub.send_multipart(frames(next(seqs), events))

    prompt = chain_hashes(SYSTEM + QUESTION)
    system = anchors(chain_hashes(SYSTEM))
    try:
        async with following(redis_url, deployment, sources, core.cache_view) as (sub, view):
            tracker = sub.trackers["e2"]
            for _ in range(500):  # a SUB socket misses what is sent before it connects
                await publish([])  # (empty batches until one is heard)
                if tracker.stats.batches:
                    break
                await asyncio.sleep(0.02)
            assert tracker.stats.batches, "the subscriber never heard the publisher"

            # a first request: SGLang caches its prompt (one node), then a second
            # request with the same system prompt: its question is a child node
            await publish(node_stored(SYSTEM))
            await publish(node_stored(QUESTION, page_hashes(SYSTEM)[-1]))
            held = anchors(prompt)
            await await_until(lambda: view.matched_blocks("e2", held) == 20, what="held")
            d = core.route(blocks=prompt, prompt_tokens=len(prompt) * PAGE)
            assert d.engine_id == "e2" and d.cached == 20

            # the question evicted (a leaf first): the system prompt stays
            await publish(node_removed(QUESTION, page_hashes(SYSTEM)[-1]))
            await await_until(lambda: view.matched_blocks("e2", held) == 16, what="evicted")
            assert view.matched_blocks("e2", system) == 16

            # flush_cache: AllBlocksCleared
            await publish([["AllBlocksCleared"]])
            await await_until(lambda: "e2" not in view.engines or not view.engines["e2"],
                              what="cleared")  # fmt: skip
            assert core.route(blocks=prompt, prompt_tokens=len(prompt) * PAGE).cached == 0
            assert not sub.malformed and tracker.stats.skipped == 0
    finally:
        ctx.destroy(linger=0)
