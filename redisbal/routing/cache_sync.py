"""The engines' cache views in Redis: the format, the writes and the routers' reader.

What each engine caches (its anchors, ``routing/cache_view.py``) is written beside the
engines by ``redisbal kv-events`` and read by every router. Three kinds of keys, all
under the deployment's hash tag (``keys.py``):

- ``kv_view(engine)``: a SET of the engine's anchors, 8 bytes each. Changed in place
  (SADD/SREM), never rewritten whole, so a write costs what changed;
- ``kv_changes``: a STREAM with one entry per change: ``e`` the engine, ``a`` the
  anchors added and ``r`` those removed (packed, 8 bytes each), ``c`` present when the
  engine's view was cleared first, ``d`` when it was dropped. Trimmed by age
  (``MINID ~``, ``RETENTION_MS``);
- ``kv_engines``: a ZSET engine -> when its view expires (ms). A subscriber refreshes it
  (and the SET's TTL) while it follows the engine; one that stops drops its engines'
  views (a ``d`` entry), one that dies lets them expire.

Invariant: a change is one MULTI (the SET, the ZSET, the stream entry), so a stream id
always names a state of every SET: whoever reads the SETs and the stream's last id in
one MULTI holds a view that the entries after that id bring up to date exactly.

A router bootstraps (one MULTI: the last id, the roster, every live engine's SET), then
in steady state reads only the entries after its cursor: deltas, never a whole view. An
entry is trimmed only ``RETENTION_MS`` after it was added, so a reader that read less
than ``RETENTION_MS / 2`` ago (server time) cannot have missed one (the half is for the
writers' clock estimate and ``~``); one that did bootstraps again. The roster is counted
every ``ROSTER_EVERY_MS``, and read when the count disagrees with the view, to forget
engines whose views expired.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

from redisbal.connection import AsyncRedisClient
from redisbal.keys import DeploymentKeys, InvalidName, check_name
from redisbal.routing.cache_view import CacheView, unpack_hashes

log = logging.getLogger("redisbal.routing.cache_sync")

RETENTION_MS = 60_000  # stream entries live this long: a reader silent for half of it bootstraps
VIEW_TTL_MS = 120_000  # a view not refreshed for this long expires (its subscriber died)
ROSTER_EVERY_MS = 5_000  # readers look for expired views this often
READ_COUNT = 512  # stream entries per read


def _hash_bytes(hashes: Iterable[int]) -> list[bytes]:
    return [h.to_bytes(8, "big") for h in hashes]


class Written(NamedTuple):
    """A change written: its stream id, and whether the engine had no live view before
    it (Redis lost its state, or the view expired): its writer then writes it whole."""

    entry_id: bytes
    lost: bool


async def write_change(
    client: AsyncRedisClient,
    keys: DeploymentKeys,
    engine_id: str,
    *,
    added: Iterable[int] = (),
    removed: Iterable[int] = (),
    cleared: bool = False,
    now_ms: int,
    ttl_ms: int = VIEW_TTL_MS,
) -> Written:
    """One change of an engine's view, in one MULTI: the SET, its expiry and the stream
    entry (which a reader applies as ``CacheView.apply``: cleared, removed, added).
    ``now_ms``: the server's time as the writer estimates it."""
    view = keys.kv_view(engine_id)
    add, rem = _hash_bytes(added), _hash_bytes(removed)
    fields: dict[str, bytes | str] = {"e": engine_id}
    pipe = client.pipeline(transaction=True)
    pipe.zscore(keys.kv_engines, engine_id)
    if cleared:
        pipe.delete(view)
        fields["c"] = b"1"
    if rem:
        pipe.srem(view, *rem)
        fields["r"] = b"".join(rem)
    if add:
        pipe.sadd(view, *add)
        fields["a"] = b"".join(add)
    _expiry(pipe, keys, [engine_id], now_ms, ttl_ms)
    pipe.xadd(keys.kv_changes, fields, minid=str(now_ms - RETENTION_MS), approximate=True)  # type: ignore[arg-type]
    out = await pipe.execute()
    return Written(out[-1], out[0] is None or out[0] <= now_ms)


def _expiry(pipe: Any, keys: DeploymentKeys, engine_ids: list[str], now_ms: int, ttl: int) -> None:
    for e in engine_ids:
        pipe.pexpire(keys.kv_view(e), ttl)
    pipe.zadd(keys.kv_engines, {e: now_ms + ttl for e in engine_ids})
    pipe.zremrangebyscore(keys.kv_engines, "-inf", now_ms)  # views that expired
    # a deployment whose subscribers all went away leaves nothing behind (the keys that
    # every writer shares last as long as the longest-lived view)
    shared = max(ttl, VIEW_TTL_MS)
    pipe.pexpire(keys.kv_engines, shared)
    pipe.pexpire(keys.kv_changes, shared)


async def refresh_views(
    client: AsyncRedisClient,
    keys: DeploymentKeys,
    engine_ids: list[str],
    *,
    now_ms: int,
    ttl_ms: int = VIEW_TTL_MS,
) -> list[str]:
    """Keep the views of the engines a subscriber follows from expiring; returns those
    that had no live view (Redis lost its state): write them whole."""
    if not engine_ids:
        return []
    pipe = client.pipeline(transaction=True)
    for e in engine_ids:
        pipe.zscore(keys.kv_engines, e)
    _expiry(pipe, keys, engine_ids, now_ms, ttl_ms)
    scores = (await pipe.execute())[: len(engine_ids)]
    return [e for e, sc in zip(engine_ids, scores, strict=True) if sc is None or sc <= now_ms]


async def drop_views(
    client: AsyncRedisClient, keys: DeploymentKeys, engine_ids: list[str], *, now_ms: int
) -> None:
    """Remove engines' views (their subscriber stops following them): readers drop them."""
    if not engine_ids:
        return
    pipe = client.pipeline(transaction=True)
    for e in engine_ids:
        pipe.delete(keys.kv_view(e))
        pipe.zrem(keys.kv_engines, e)
        pipe.xadd(
            keys.kv_changes,
            {"e": e, "d": b"1"},
            minid=str(now_ms - RETENTION_MS),
            approximate=True,
        )
    await pipe.execute()


async def server_ms(client: AsyncRedisClient) -> int:
    """The Redis server's clock, in ms."""
    sec, usec = await client.time()
    return int(sec) * 1000 + int(usec) // 1000


# -- the reader ------------------------------------------------------------------------------


@dataclass(frozen=True)
class SyncCursor:
    """Where a router's view stands: the last stream id applied, the server time of the
    read that got it, and of the last roster read; ``bootstraps`` counts full reads."""

    last_id: bytes
    read_ms: int
    roster_ms: int
    bootstraps: int = 1


def _text(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v


def _engine(raw: bytes | str) -> str | None:
    try:
        return check_name(_text(raw), "engine_id")
    except (InvalidName, UnicodeDecodeError):
        return None


async def sync_view(
    client: AsyncRedisClient,
    keys: DeploymentKeys,
    view: CacheView,
    cursor: SyncCursor | None = None,
) -> SyncCursor:
    """Bring ``view`` up to date and return the cursor to pass next time: the first call
    (``cursor`` None) and one after a silence of ``RETENTION_MS / 2`` read every engine's
    view; every other call reads only the stream entries after the cursor."""
    if cursor is None:
        return await _bootstrap(client, keys, view, 0)
    pipe = client.pipeline(transaction=False)
    pipe.time()
    pipe.xrange(keys.kv_changes, b"(" + cursor.last_id, "+", count=READ_COUNT)
    (sec, usec), entries = await pipe.execute()
    now = int(sec) * 1000 + int(usec) // 1000
    if now - cursor.read_ms > RETENTION_MS // 2:  # entries it needs may be trimmed
        return await _bootstrap(client, keys, view, cursor.bootstraps)
    last = cursor.last_id
    while True:
        for entry_id, fields in entries:
            _apply(view, fields)
            last = entry_id
        if len(entries) < READ_COUNT:
            break
        entries = await client.xrange(keys.kv_changes, b"(" + last, "+", count=READ_COUNT)
    roster_ms = cursor.roster_ms
    if now - roster_ms >= ROSTER_EVERY_MS:
        # every live engine is in the view (each came in by the bootstrap or an entry),
        # so as many live as held means none expired: the roster itself is read only
        # when one did
        if await client.zcount(keys.kv_engines, f"({now}", "+inf") != len(view.told):
            live = await _live(client, keys, now)
            for e in [e for e in view.told if e not in live]:
                view.drop(e)
        roster_ms = now
    return SyncCursor(last, now, roster_ms, cursor.bootstraps)


def _apply(view: CacheView, fields: dict[bytes, bytes]) -> None:
    raw = fields.get(b"e")
    engine = None if raw is None else _engine(raw)
    if engine is None:
        log.warning("cache view: a change without a valid engine id skipped: %r", raw)
        return
    if b"d" in fields:
        view.drop(engine)
        return
    view.apply(
        engine,
        unpack_hashes(fields.get(b"a", b"")),
        unpack_hashes(fields.get(b"r", b"")),
        cleared=b"c" in fields,
    )


async def _live(client: AsyncRedisClient, keys: DeploymentKeys, now_ms: int) -> set[str]:
    rows: Any = await client.zrange(keys.kv_engines, 0, -1, withscores=True)
    return _alive(rows, now_ms)


def _alive(rows: list[tuple[bytes, float]], now_ms: int) -> set[str]:
    out = set()
    for raw, score in rows:
        engine = _engine(raw)
        if engine is not None and score > now_ms:
            out.add(engine)
    return out


async def _bootstrap(
    client: AsyncRedisClient, keys: DeploymentKeys, view: CacheView, bootstraps: int
) -> SyncCursor:
    """Every live engine's SET and the stream's last id, read in one MULTI (so the entries
    after that id bring them up to date). An engine that appears between the roster read
    and the MULTI is read on the next try."""
    settled = False
    for _ in range(5):
        now = await server_ms(client)
        engines = sorted(await _live(client, keys, now))
        pipe = client.pipeline(transaction=True)
        pipe.xrevrange(keys.kv_changes, "+", "-", count=1)
        pipe.zrange(keys.kv_engines, 0, -1, withscores=True)
        for e in engines:
            pipe.smembers(keys.kv_view(e))
        last, rows, *sets = await pipe.execute()
        live = _alive(rows, now)
        if live <= set(engines):
            settled = True
            break
    view.drop_told()
    for e, members in zip(engines, sets, strict=True):
        if e in live:
            view.replace(e, unpack_hashes(b"".join(m for m in members if len(m) == 8)))
    last_id = last[0][0] if last else b"0-0"
    if not settled:  # engines kept joining: read them all again on the next call
        log.warning("cache view: the roster kept changing while it was read; reading it again")
        return SyncCursor(last_id, 0, now, bootstraps + 1)
    return SyncCursor(last_id, now, now, bootstraps + 1)


__all__ = [
    "READ_COUNT",
    "RETENTION_MS",
    "ROSTER_EVERY_MS",
    "VIEW_TTL_MS",
    "SyncCursor",
    "Written",
    "drop_views",
    "refresh_views",
    "server_ms",
    "sync_view",
    "write_change",
]
