"""``redisbal kv-events``: follow engines' KV-cache events and keep their views in Redis.

vLLM (``--kv-events-config``) publishes what its prefix cache holds over ZeroMQ: a PUB
socket sends multipart messages ``[topic, seq, payload]``, ``seq`` an 8-byte big-endian
counter from 0 (a new publisher, a restarted engine, starts again at 0) and ``payload``
the msgpack of a batch ``[ts, events, data_parallel_rank]``. Each event is a map tagged
under ``"type"`` (vLLM 0.32; fields with their default value left out):

- ``{"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids",
  "block_size", "lora_id", "medium", "lora_name", ...}`` (later fields: ignored),
- ``{"type": "BlockRemoved", "block_hashes", "medium", ...}``,
- ``{"type": "AllBlocksCleared"}``.

Earlier releases sent each event as a tagged array in the same field order
(``["BlockStored", block_hashes, parent_block_hash, ...]``); both are read.

SGLang (``--kv-events-config``, ``sglang/srt/disaggregation/kv_events.py``) publishes
the same frames, seq and replay protocol, with tagged arrays only:

- the batch is ``[ts, events]`` or ``[ts, events, attn_dp_rank]`` (by release),
- ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
  medium]`` (``medium``, ``"GPU"`` or a host tier such as ``"CPU_PINNED"``, absent in
  early releases), one page a block (``block_size`` = its ``--page-size``, 1 by
  default), block hashes signed 64-bit ints; a block stored under a cache salt carries
  one more field, a map ``{"cache_salt": salt}``,
- ``["BlockRemoved", block_hashes, medium]`` and ``["AllBlocksCleared"]``.

A salted block is reused only by requests with the same salt, which routers do not
see: it is skipped and counted, as LoRA blocks are.

An optional ROUTER socket replays the batches it still buffers: a DEALER sends
``["", start_seq]`` and gets ``["", seq, payload]`` for each, then ``["", -1, ""]``.

The engine's own block hashes depend on its configuration and seed, so each stored
block is named anew by ``cache_view.chain_hashes`` over its token ids, continuing from
its parent's name (:class:`EngineTracker`); only anchors go to Redis
(``routing/cache_sync.py``). A block whose parent is unknown (stored before the
subscriber started, or missed) cannot be named: it is skipped and counted, and so are
its descendants. A removed block takes its descendants with it: an engine matches a
prompt's blocks from the first, so what hangs below a missing block is never reused.
A gap in ``seq`` (missed batches), ``seq`` going backwards (a restarted engine) or a
dropped connection to the publisher clears the engine's view; with a replay socket, a
gap and what was published before the subscriber listened are fetched instead.

Bounded: at most ``max_anchors`` anchors per engine (the oldest stored dropped first),
and at most ``max_anchors * ANCHOR_STRIDE * 4`` named blocks in memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import click

from redisbal.connection import OUTAGE_ERRORS, AsyncRedisClient, make_client, redact
from redisbal.errors import InvalidArgument, MalformedData, MissingExtra
from redisbal.keys import DeploymentKeys, InvalidName, check_name
from redisbal.ops.cli_options import (
    check_reachable,
    common_options,
    redis_errors,
    run_until_signal,
    settings,
)
from redisbal.routing import cache_sync
from redisbal.routing.cache_view import ANCHOR_STRIDE, BLOCK_TOKENS, chain_hashes

log = logging.getLogger("redisbal.kv_events")

EXTRA_HINT = "pip install 'redisbal[kv-events]'"
END_SEQ = -1  # the replay socket's end marker
MAX_ANCHORS = 8192  # per engine: 8192 x 4 blocks x 16 tokens = 512k tokens of prefixes


def load_msgpack() -> Any:
    """msgpack, or MissingExtra naming the extra."""
    try:
        import msgpack
    except ImportError as exc:
        raise MissingExtra(
            f"KV events need the 'kv-events' extra ({exc.name} is missing): {EXTRA_HINT}"
        ) from None
    return msgpack


def load_zmq() -> Any:
    """pyzmq, or MissingExtra naming the extra."""
    try:
        import zmq
        import zmq.asyncio
    except ImportError as exc:
        raise MissingExtra(
            f"KV events need the 'kv-events' extra ({exc.name} is missing): {EXTRA_HINT}"
        ) from None
    return zmq


# -- the wire format -------------------------------------------------------------------------

BlockHash = int | bytes


@dataclass(frozen=True)
class BlockStored:
    """Blocks an engine stored: ``token_ids`` are every token of ``block_hashes``' blocks
    (``block_size`` each), the first block's parent is ``parent_block_hash``."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    cache_salt: str | None = None  # SGLang's salted blocks (its metadata map)


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[BlockHash]
    medium: str | None = None


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared
UNKNOWN = object()  # an event of a kind this version does not know (skipped)


@dataclass
class EventBatch:
    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None
    unknown: int = 0  # events of unknown kinds, skipped


def encode_batch(batch: EventBatch) -> bytes:
    """A batch as vLLM's publisher packs it (tagged maps, as vLLM 0.32 sends and
    vllm-router 0.1.17 requires: it refuses the older array layout)."""
    events: list[dict[str, Any]] = []
    for ev in batch.events:
        if isinstance(ev, BlockStored):
            events.append(
                {
                    "type": "BlockStored",
                    "block_hashes": ev.block_hashes,
                    "parent_block_hash": ev.parent_block_hash,
                    "token_ids": ev.token_ids,
                    "block_size": ev.block_size,
                    "lora_id": ev.lora_id,
                    "medium": ev.medium,
                    "lora_name": None,
                }
            )
        elif isinstance(ev, BlockRemoved):
            events.append(
                {"type": "BlockRemoved", "block_hashes": ev.block_hashes, "medium": ev.medium}
            )
        else:
            events.append({"type": "AllBlocksCleared"})
    packed: bytes = load_msgpack().packb([batch.ts, events, batch.data_parallel_rank])
    return packed


def encode_message(topic: bytes, seq: int, batch: EventBatch) -> list[bytes]:
    """The multipart message a PUB socket sends: topic, seq, payload."""
    return [topic, seq.to_bytes(8, "big"), encode_batch(batch)]


def _hashes(v: Any, what: str) -> list[BlockHash]:
    if not isinstance(v, list) or not all(
        isinstance(h, bytes) or (isinstance(h, int) and not isinstance(h, bool)) for h in v
    ):
        raise MalformedData(f"{what}: block_hashes must be a list of ints or bytes")
    return v


def _opt_hash(v: Any) -> BlockHash | None:
    if v is None or isinstance(v, bytes) or (isinstance(v, int) and not isinstance(v, bool)):
        return v
    raise MalformedData(f"BlockStored: parent_block_hash must be an int, bytes or nil: {v!r}")


def _event(raw: Any) -> Event | object:
    """One event, from either layout: ``[tag, *fields]`` or ``{"type": tag, ...}``."""
    if isinstance(raw, list) and raw and isinstance(raw[0], str):
        tag, f = raw[0], raw[1:]
        names = {
            "BlockStored": (
                "block_hashes",
                "parent_block_hash",
                "token_ids",
                "block_size",
                "lora_id",
                "medium",
            ),
            "BlockRemoved": ("block_hashes", "medium"),
            "AllBlocksCleared": (),
        }.get(tag)
        if names is None:
            return UNKNOWN
        d: dict[str, Any] = dict(zip(names, f, strict=False))  # extra trailing fields: newer
        meta = f[len(names)] if tag == "BlockStored" and len(f) > len(names) else None
        if isinstance(meta, dict):  # SGLang's salted blocks: {"cache_salt": salt}
            d["cache_salt"] = meta.get("cache_salt")
    elif isinstance(raw, dict) and isinstance(raw.get("type"), str):
        tag, d = raw["type"], raw
    else:
        raise MalformedData(f"an event is neither a tagged array nor a tagged map: {raw!r:.80}")
    if tag == "BlockStored":
        hashes = _hashes(d.get("block_hashes"), tag)
        tokens, size = d.get("token_ids"), d.get("block_size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise MalformedData(f"BlockStored: block_size must be a positive int: {size!r}")
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and 0 <= t < 2**32 for t in tokens
        ):
            raise MalformedData("BlockStored: token_ids must be a list of token ids")
        if len(tokens) != len(hashes) * size:
            raise MalformedData(
                f"BlockStored: {len(tokens)} token ids for {len(hashes)} blocks of {size}"
            )
        lora, medium, salt = d.get("lora_id"), d.get("medium"), d.get("cache_salt")
        return BlockStored(
            hashes,
            _opt_hash(d.get("parent_block_hash")),
            tokens,
            size,
            lora if isinstance(lora, int) else None,
            medium if isinstance(medium, str) else None,
            salt if isinstance(salt, str) else None,
        )
    if tag == "BlockRemoved":
        medium = d.get("medium")
        hashes = _hashes(d.get("block_hashes"), tag)
        return BlockRemoved(hashes, medium if isinstance(medium, str) else None)
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    return UNKNOWN


def decode_batch(payload: bytes) -> EventBatch:
    """A batch's payload (MalformedData, one line, when it is not one)."""
    try:
        raw = load_msgpack().unpackb(payload, raw=False, strict_map_key=False)
    except MissingExtra:
        raise
    except Exception as exc:  # msgpack raises several kinds: all mean "not msgpack"
        raise MalformedData(f"payload is not msgpack: {type(exc).__name__}: {exc}") from None
    if isinstance(raw, dict):
        raw = [raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")]
    if not isinstance(raw, list) or len(raw) < 2:
        raise MalformedData(f"payload is not a batch [ts, events, rank]: {raw!r:.80}")
    ts, events = raw[0], raw[1]
    rank = raw[2] if len(raw) > 2 else None
    if not isinstance(ts, int | float) or not isinstance(events, list):
        raise MalformedData(f"payload is not a batch [ts, events, rank]: {raw!r:.80}")
    out: list[Event] = []
    unknown = 0
    for e in events:
        ev = _event(e)
        if ev is UNKNOWN:
            unknown += 1
        else:
            out.append(ev)  # type: ignore[arg-type]
    return EventBatch(float(ts), out, rank if isinstance(rank, int) else None, unknown)


def decode_message(frames: Sequence[bytes]) -> tuple[int, EventBatch]:
    """``[topic, seq, payload]`` as a PUB socket sends it -> (seq, batch)."""
    if len(frames) != 3:
        raise MalformedData(f"a message has 3 frames (topic, seq, payload), got {len(frames)}")
    if len(frames[1]) != 8:
        raise MalformedData(f"seq is 8 bytes, got {len(frames[1])}")
    return int.from_bytes(frames[1], "big", signed=True), decode_batch(frames[2])


# -- one engine's blocks, named by our own hashes ---------------------------------------------


@dataclass
class Delta:
    """What changed in an engine's anchors since the last write: ``cleared`` first, then
    ``removed``, then ``added`` (as ``CacheView.apply`` applies them)."""

    added: set[int] = field(default_factory=set)
    removed: set[int] = field(default_factory=set)
    cleared: bool = False

    def __bool__(self) -> bool:
        return bool(self.added or self.removed or self.cleared)

    def add(self, h: int) -> None:
        self.removed.discard(h)
        self.added.add(h)

    def remove(self, h: int) -> None:
        self.added.discard(h)
        self.removed.add(h)

    def clear(self) -> None:
        self.added.clear()
        self.removed.clear()
        self.cleared = True


@dataclass
class TrackerStats:
    batches: int = 0
    stored: int = 0  # blocks named
    skipped: int = 0  # blocks that could not be named (parent unknown) or were not ours
    removed: int = 0  # blocks removed (their descendants included)
    clears: int = 0  # views cleared: AllBlocksCleared, a gap, a restart
    unknown: int = 0  # events of kinds this version does not know


# a named block: (its own hash, depth in our blocks, the anchors it holds, the engine's
# hash of its parent or None)
_Node = tuple[int, int, tuple[int, ...], BlockHash | None]


class EngineTracker:
    """One engine's blocks: engine block hash -> our own name for it, and the anchors it
    holds (``cache_view``), reference-counted (two engine blocks may share a name).
    ``block_size``: our block (the routers' ``cache_view`` block); an engine block must be
    a whole number of them. Pure: the subscriber feeds it and writes ``take()``."""

    def __init__(
        self,
        engine_id: str,
        block_size: int = BLOCK_TOKENS,
        max_anchors: int = MAX_ANCHORS,
        stride: int = ANCHOR_STRIDE,
    ) -> None:
        if block_size < 1 or max_anchors < 1:
            raise InvalidArgument("block_size and max_anchors must be >= 1")
        self.engine_id = engine_id
        self.block_size = block_size
        self.max_anchors = max_anchors
        self.max_blocks = max_anchors * stride * 4
        self.stride = stride
        self.seq: int | None = None
        self.blocks: dict[BlockHash, _Node] = {}
        self.children: dict[BlockHash, set[BlockHash]] = {}
        self.anchors: OrderedDict[int, int] = OrderedDict()  # anchor -> references
        self.pending = Delta(cleared=True)  # a new subscriber knows nothing yet
        self.stats = TrackerStats()
        self.misfit: int | None = None  # an engine block size not a multiple of ours

    def check_seq(self, seq: int) -> str:
        """ "next", "first", "gap" (batches missed) or "restart" (seq went backwards)."""
        last, self.seq = self.seq, seq
        if last is None:
            return "first"
        if seq == last + 1:
            return "next"
        return "gap" if seq > last else "restart"

    def clear(self) -> None:
        self.blocks.clear()
        self.children.clear()
        self.anchors.clear()
        self.pending.clear()
        self.stats.clears += 1

    def apply(self, batch: EventBatch) -> None:
        self.stats.batches += 1
        self.stats.unknown += batch.unknown
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                self._store(ev)
            elif isinstance(ev, BlockRemoved):
                if ev.medium in (None, "GPU"):
                    for h in ev.block_hashes:
                        self._remove(h)
            else:
                self.clear()

    def _store(self, ev: BlockStored) -> None:
        n = len(ev.block_hashes)
        if ev.block_size % self.block_size:
            self.misfit = ev.block_size  # (said once by the subscriber)
        if (
            ev.lora_id is not None  # LoRA blocks differ from the base model's: not ours
            or ev.cache_salt is not None  # likewise salted ones (SGLang)
            or ev.medium not in (None, "GPU")  # offloaded copies: the GPU's view only
            or ev.block_size % self.block_size
        ):
            self.stats.skipped += n
            return
        parent = ev.parent_block_hash
        if parent is None:
            own, depth = None, 0
        else:
            node = self.blocks.get(parent)
            if node is None:  # stored before we listened, missed, or removed
                self.stats.skipped += n
                return
            own, depth = node[0], node[1]
        per = ev.block_size // self.block_size
        names = chain_hashes(ev.token_ids, self.block_size, own)
        for i, h in enumerate(ev.block_hashes):
            mine = names[i * per : (i + 1) * per]
            new_anchors = tuple(
                name for k, name in enumerate(mine, depth + 1) if k % self.stride == 0
            )
            depth += per
            if h in self.blocks:  # stored again (recomputed): same name, nothing new
                parent = h
                continue
            self.blocks[h] = (mine[-1], depth, new_anchors, parent)
            if parent is not None:
                self.children.setdefault(parent, set()).add(h)
            for a in new_anchors:
                self._ref(a)
            parent = h
            self.stats.stored += 1
        while len(self.blocks) > self.max_blocks:  # forget the oldest names
            self._remove(next(iter(self.blocks)))

    def _ref(self, anchor: int) -> None:
        refs = self.anchors.pop(anchor, 0)
        self.anchors[anchor] = refs + 1  # (re)stored: the newest
        if not refs:
            self.pending.add(anchor)
        while len(self.anchors) > self.max_anchors:
            oldest, _ = self.anchors.popitem(last=False)
            self.pending.remove(oldest)

    def _remove(self, h: BlockHash) -> None:
        """Remove a block and every block below it."""
        stack = [h]
        while stack:
            b = stack.pop()
            node = self.blocks.pop(b, None)
            if node is None:
                continue
            self.stats.removed += 1
            for a in node[2]:
                refs = self.anchors.get(a)
                if refs is None:
                    continue  # dropped by the bound already
                if refs > 1:
                    self.anchors[a] = refs - 1
                else:
                    del self.anchors[a]
                    self.pending.remove(a)
            parent = node[3]
            if parent is not None and (sib := self.children.get(parent)) is not None:
                sib.discard(b)
                if not sib:
                    del self.children[parent]
            stack.extend(self.children.pop(b, ()))

    def take(self) -> Delta | None:
        """The changes since the last take (None if none)."""
        if not self.pending:
            return None
        d, self.pending = self.pending, Delta()
        return d

    def full(self) -> Delta:
        """The whole view as one change (after Redis lost writes): cleared, then all."""
        self.pending = Delta()
        return Delta(added=set(self.anchors), cleared=True)


# -- the subscriber ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Source:
    """An engine and where it publishes (a ZeroMQ endpoint), and its replay socket."""

    engine_id: str
    endpoint: str
    replay: str | None = None


def check_endpoint(value: str) -> str:
    """A ZeroMQ endpoint to connect to: tcp://host:port or ipc://path (InvalidArgument)."""
    parts = urlsplit(value)
    if parts.scheme == "ipc" and len(value) > len("ipc://"):
        return value
    if parts.scheme != "tcp" or not parts.hostname or parts.path or parts.query:
        raise InvalidArgument(f"{value!r} is not a ZeroMQ endpoint like tcp://host:5557")
    try:
        port = parts.port
    except ValueError:
        port = None
    if port is None or port == 0 or parts.hostname == "*":
        raise InvalidArgument(f"{value!r}: give the host and port to connect to (tcp://host:5557)")
    return value


def parse_pair(value: str, what: str) -> tuple[str, str]:
    """``ENGINE_ID=ENDPOINT`` (InvalidArgument / InvalidName, one line)."""
    engine, sep, endpoint = value.partition("=")
    if not sep:
        raise InvalidArgument(f"{what} {value!r}: use ENGINE_ID=tcp://host:port")
    try:
        return check_name(engine, "engine id"), check_endpoint(endpoint)
    except InvalidName as exc:
        raise InvalidName(f"{what}: {exc}") from None
    except InvalidArgument as exc:
        raise InvalidArgument(f"{what}: {exc}") from None


def make_sources(sources: Sequence[str], replays: Sequence[str] = ()) -> list[Source]:
    pairs = [parse_pair(v, "--source") for v in sources]
    ids = [e for e, _ in pairs]
    dup = sorted({e for e in ids if ids.count(e) > 1})
    if dup:
        raise InvalidArgument(f"--source names engine {dup[0]!r} twice")
    replay = dict(parse_pair(v, "--replay") for v in replays)
    unknown = sorted(set(replay) - set(ids))
    if unknown:
        raise InvalidArgument(f"--replay names engine {unknown[0]!r}, which no --source names")
    return [Source(e, ep, replay.get(e)) for e, ep in pairs]


class Subscriber:
    """Follows each source's publisher and writes its engine's anchors to Redis, every
    ``flush_s`` at most once per engine (the changes of that time merged)."""

    def __init__(
        self,
        client: AsyncRedisClient,
        deployment: str,
        sources: Sequence[Source],
        *,
        block_size: int = BLOCK_TOKENS,
        max_anchors: int = MAX_ANCHORS,
        flush_s: float = 0.05,
        ttl_ms: int = cache_sync.VIEW_TTL_MS,
        replay_timeout_s: float = 2.0,
    ) -> None:
        self.client = client
        self.keys = DeploymentKeys(deployment)
        self.sources = list(sources)
        self.trackers = {
            s.engine_id: EngineTracker(s.engine_id, block_size, max_anchors) for s in sources
        }
        self.flush_s = flush_s
        self.ttl_ms = ttl_ms
        self.replay_timeout_s = replay_timeout_s
        self.malformed = 0
        self.writes = 0
        self._said: set[str] = set()  # what was logged once
        self._dirty: set[str] = set()  # engines whose last write failed: write in full
        self._disconnected: set[str] = set()  # engines whose publisher's connection dropped
        self._offset_ms = 0  # Redis server clock - ours
        self._zmq = load_zmq()
        self._ctx = self._zmq.asyncio.Context()

    def _once(self, key: str, msg: str, *args: Any) -> None:
        if key not in self._said:
            self._said.add(key)
            log.warning(msg, *args)

    def now_ms(self) -> int:
        return int(time.time() * 1000) + self._offset_ms

    async def _sync_clock(self) -> None:
        self._offset_ms = await cache_sync.server_ms(self.client) - int(time.time() * 1000)

    # -- events in

    def decode(self, source: Source, frames: Sequence[bytes]) -> tuple[int, EventBatch] | None:
        """A message, or None when it is malformed (counted, logged once per engine)."""
        try:
            return decode_message(frames)
        except MalformedData as exc:
            self.malformed += 1
            self._once(
                f"bad:{source.engine_id}",
                "kv-events: %s: malformed message skipped (counted; logged once): %s",
                source.engine_id,
                exc,
            )
            return None

    def handle(self, source: Source, seq: int, batch: EventBatch) -> None:
        """Apply one batch; a gap or a restart clears the engine's view first."""
        tracker = self.trackers[source.engine_id]
        last = tracker.seq
        state = tracker.check_seq(seq)
        if state in ("gap", "restart"):
            log.info(
                "kv-events: %s: %s (seq %d after %d): view cleared",
                source.engine_id,
                "batches missed" if state == "gap" else "publisher restarted",
                seq,
                last,
            )
            tracker.clear()
        tracker.apply(batch)
        if tracker.misfit is not None:
            self._once(
                f"misfit:{source.engine_id}",
                "kv-events: %s: its blocks of %d tokens are not a multiple of --block-size "
                "%d: skipped (counted; logged once). Give the engine a block size that is "
                "(vLLM --block-size, SGLang --page-size)",
                source.engine_id,
                tracker.misfit,
                tracker.block_size,
            )
        if batch.unknown:
            self._once(
                f"unknown:{source.engine_id}",
                "kv-events: %s: events of unknown kinds skipped (counted; logged once)",
                source.engine_id,
            )

    async def receive(self, source: Source, frames: Sequence[bytes]) -> None:
        """One message from the publisher. With a replay socket, the batches before it
        that were missed (or sent before the subscriber listened) are fetched first."""
        msg = self.decode(source, frames)
        if msg is None:
            return
        seq, batch = msg
        tracker = self.trackers[source.engine_id]
        if source.engine_id in self._disconnected:
            self._disconnected.discard(source.engine_id)
            log.info("kv-events: %s: the publisher's connection dropped: view cleared",
                     source.engine_id)  # fmt: skip
            tracker.clear()
            tracker.seq = None
        last = tracker.seq
        if source.replay is not None and (last is None or last < seq - 1):
            start = 0 if last is None else last + 1
            replayed = [
                m for fr in await self.replay(source, start) if (m := self.decode(source, fr))
            ]
            replayed = [(s, b) for s, b in replayed if s < seq]
            if replayed and (last is None or replayed[0][0] == start):
                if last is None:  # what the buffer still holds: a suffix, applied fresh
                    tracker.seq = replayed[0][0] - 1
                for s, b in replayed:
                    self.handle(source, s, b)
        self.handle(source, seq, batch)

    async def replay(self, source: Source, start: int) -> list[list[bytes]]:
        """The batches from ``start`` on that the source's replay socket still holds, as
        ``[topic, seq, payload]`` messages; [] when it does not answer in time."""
        assert source.replay is not None
        zmq = self._zmq
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        out: list[list[bytes]] = []
        loop = asyncio.get_running_loop()
        try:
            sock.connect(source.replay)
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            deadline = loop.time() + self.replay_timeout_s
            while True:
                left = deadline - loop.time()
                if left <= 0 or not await sock.poll(int(left * 1000)):
                    self._once(
                        f"replay:{source.engine_id}",
                        "kv-events: %s: replay socket %s did not answer in time",
                        source.engine_id,
                        source.replay,
                    )
                    return []
                frames = await sock.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    self.malformed += 1
                    return out
                if int.from_bytes(frames[1], "big", signed=True) == END_SEQ:
                    return out
                out.append([b"", frames[1], frames[2]])
        finally:
            sock.close()

    async def _follow(self, source: Source) -> None:
        zmq = self._zmq
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.setsockopt(zmq.RCVHWM, 100_000)  # as vLLM's publisher's: a burst is no gap
        sock.connect(source.endpoint)
        log.info(
            "kv-events: following engine %s at %s%s",
            source.engine_id,
            source.endpoint,
            f" (replay {source.replay})" if source.replay else "",
        )
        # a dropped connection: the publisher restarted (its seq may have passed ours by
        # the time we hear it) or batches were lost; either way the view starts over
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        watch = asyncio.create_task(self._watch(source, monitor))
        try:
            while True:
                await self.receive(source, await sock.recv_multipart())
        finally:
            watch.cancel()  # (not awaited: nothing waits on a stopping follower)
            sock.disable_monitor()
            monitor.close()
            sock.close()

    async def _watch(self, source: Source, monitor: Any) -> None:
        from zmq.utils.monitor import parse_monitor_message

        while True:
            event = parse_monitor_message(await monitor.recv_multipart())
            if event["event"] == self._zmq.EVENT_DISCONNECTED:
                self._disconnected.add(source.engine_id)

    # -- Redis out

    async def flush(self) -> None:
        """Write every engine's pending changes (one MULTI each)."""
        now = self.now_ms()
        for engine, tracker in self.trackers.items():
            delta = tracker.full() if engine in self._dirty else tracker.take()
            if delta is None:
                continue
            try:
                written = await cache_sync.write_change(
                    self.client,
                    self.keys,
                    engine,
                    added=delta.added,
                    removed=delta.removed,
                    cleared=delta.cleared,
                    now_ms=now,
                    ttl_ms=self.ttl_ms,
                )
            except OUTAGE_ERRORS as exc:
                if engine not in self._dirty:
                    log.warning(
                        "kv-events: %s: cannot write its view (%s): will write it "
                        "in full once Redis answers",
                        engine,
                        redact(str(exc)),
                    )
                self._dirty.add(engine)
                continue
            self._dirty.discard(engine)
            self.writes += 1
            if written.lost and not delta.cleared:  # Redis lost the view: write it whole
                log.warning("kv-events: %s: its view was gone from Redis: writing it whole", engine)
                self._dirty.add(engine)

    async def _writer(self, stop: asyncio.Event) -> None:
        refresh_every = self.ttl_ms / 3000
        refreshed = 0.0
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), self.flush_s)
            if loop.time() - refreshed >= refresh_every:
                with contextlib.suppress(*OUTAGE_ERRORS):
                    await self._sync_clock()
                    lost = await cache_sync.refresh_views(
                        self.client,
                        self.keys,
                        list(self.trackers),
                        now_ms=self.now_ms(),
                        ttl_ms=self.ttl_ms,
                    )
                    self._dirty.update(lost)  # Redis lost them: written whole below
                    refreshed = loop.time()
            await self.flush()

    async def run(self, stop: asyncio.Event | None = None, summary_s: float = 60.0) -> None:
        """Follow every source until ``stop`` is set, then drop the views it wrote."""
        stop = stop or asyncio.Event()
        await self._sync_clock()
        followers = [asyncio.create_task(self._follow(s)) for s in self.sources]
        writer = asyncio.create_task(self._writer(stop))
        summary = asyncio.create_task(self._summaries(summary_s))
        try:
            done, _ = await asyncio.wait([writer, *followers], return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                t.result()
        finally:
            for t in [summary, *followers]:
                t.cancel()
            stop.set()
            # bounded: a stop must not hang on a socket or on Redis
            await asyncio.wait([summary, *followers, writer], timeout=5)
            writer.cancel()
            with contextlib.suppress(*OUTAGE_ERRORS):
                await cache_sync.drop_views(
                    self.client, self.keys, list(self.trackers), now_ms=self.now_ms()
                )
            self.close()

    def close(self) -> None:
        """Close the ZeroMQ sockets (``run`` does it when it ends)."""
        self._ctx.destroy(linger=0)

    def summary_line(self) -> str:
        parts = []
        for e, t in self.trackers.items():
            s = t.stats
            parts.append(
                f"{e}: {len(t.anchors)} anchors, {s.batches} batches, {s.stored} blocks "
                f"stored, {s.skipped} skipped, {s.removed} removed, {s.clears} clears"
            )
        return f"kv-events: {'; '.join(parts)}; {self.malformed} malformed, {self.writes} writes"

    async def _summaries(self, every_s: float) -> None:
        while True:
            await asyncio.sleep(every_s)
            log.info("%s", self.summary_line())


# -- the command -----------------------------------------------------------------------------


@click.command("kv-events")
@common_options
@click.option(
    "--source",
    "sources",
    multiple=True,
    required=True,
    metavar="ENGINE_ID=ENDPOINT",
    help="An engine and its KV-event publisher, e.g. e0=tcp://vllm-0:5557 (repeat for "
    "several engines; vLLM's or SGLang's --kv-events-config endpoint, seen from here).",
)
@click.option(
    "--replay",
    "replays",
    multiple=True,
    metavar="ENGINE_ID=ENDPOINT",
    help="That engine's replay socket (its replay_endpoint): missed batches are "
    "fetched from it instead of clearing the engine's view.",
)
@click.option(
    "--block-size",
    type=click.IntRange(1, 4096),
    default=BLOCK_TOKENS,
    show_default=True,
    help="Tokens per block of the routers' cache view (the engines' block size, "
    "SGLang's page size, must be a multiple of it).",
)
@click.option(
    "--max-anchors",
    type=click.IntRange(1, 10**7),
    default=MAX_ANCHORS,
    show_default=True,
    help="Anchors kept per engine in Redis (the oldest stored dropped first).",
)
def kv_events_command(
    sources: tuple[str, ...], replays: tuple[str, ...], block_size: int, max_anchors: int
) -> None:
    """Follow engines' KV-cache events (vLLM's or SGLang's ZeroMQ publisher) into Redis."""
    s = settings()
    url = s.require_url()
    try:
        srcs = make_sources(sources, replays)
    except (InvalidArgument, InvalidName) as exc:
        raise click.UsageError(str(exc)) from None
    try:
        load_msgpack()
        load_zmq()
    except MissingExtra as exc:
        raise click.ClickException(str(exc)) from None
    check_reachable(url)
    stop = asyncio.Event()

    async def main() -> None:
        client = make_client(url, asyncio=True)
        sub = Subscriber(client, s.deployment, srcs, block_size=block_size, max_anchors=max_anchors)
        log.info(
            "kv-events: writing the cache views of %d engine(s) to deployment %s at %s",
            len(srcs),
            s.deployment,
            s.safe_url,
        )
        try:
            await sub.run(stop)
        finally:
            log.info("%s", sub.summary_line())
            await client.aclose()

    with redis_errors(url):  # Redis gone while it runs: one line, not a traceback
        asyncio.run(run_until_signal(main(), stop.set))
