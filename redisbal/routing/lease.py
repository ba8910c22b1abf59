"""Automatic API-server indexes: ``client_index="auto"``.

Each API server (gateway replica) leases the lowest free index in the
deployment's ``clients`` ZSET (member ``"<index>:<token>"``, score = expiry in
Redis server ms) and renews it in the background; ``client_count`` follows the
live leases, so replicas scale up and down without reconfiguration.

An index is never moved while its lease lives: engines count the requests they
received per index (``admitted``) and routers reconcile their pending routes
against that count, so a router that changed index would read another's history.
Hence ``client_count`` is max(live leases, highest live index + 1): it returns
to the live count as soon as the highest indexes are the ones that left. A
lease lost to an outage longer than the TTL, or with Redis's state, is taken
back (the same index if still free, whoever renews first) when Redis is back.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable

from redisbal.background import cancel_and_wait
from redisbal.connection import AsyncRedisClient
from redisbal.errors import InvalidArgument
from redisbal.errors import LeaseUnavailable as LeaseUnavailable
from redisbal.keys import DeploymentKeys
from redisbal.routing.router_core import RouterCore

log = logging.getLogger("redisbal.routing.lease")

MAX_CLIENTS = 4096

# KEYS[1] clients ZSET; ARGV token, ttl_ms, max, held (the index we had, -1: none).
# Drops expired leases, renews ours (or takes back the one we held if free, else the
# lowest free index), returns {index, count}; index -1: all taken.
LEASE_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local token, ttl, max = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local held = tonumber(ARGV[4] or '') or -1
local members = redis.call('ZRANGE', KEYS[1], 0, -1)
local used, mine, top = {}, -1, -1
for _, m in ipairs(members) do
  local i, tok = string.match(m, '^(%d+):(.*)$')
  if i then
    i = tonumber(i)
    used[i] = true
    if i > top then top = i end
    if tok == token then mine = i end
  end
end
if mine < 0 and held >= 0 and held < max and not used[held] then mine = held end
if mine < 0 then
  for i = 0, max - 1 do
    if not used[i] then mine = i break end
  end
  if mine < 0 then return {-1, #members} end
end
if mine > top then top = mine end
redis.call('ZADD', KEYS[1], now + ttl, mine .. ':' .. token)
redis.call('PEXPIRE', KEYS[1], ttl * 2)
local count = redis.call('ZCARD', KEYS[1])
if top + 1 > count then count = top + 1 end
return {mine, count}
"""


def apply_lease(core: RouterCore, index: int, count: int) -> None:
    """Move a RouterCore to (index, count) under its lock.

    The traffic-share estimate starts over at 1/count when the index changes (the
    admitted counts it reads are per index) or the count does (an estimate made while
    this router was alone says 1.0, and would take thousands of admissions to fall to
    1/2 once another joins: meanwhile its own routes would stand for nobody else's),
    and so does exact reconciliation when the index changes: the
    new index's admitted counts hold none of this router's routes so far, so those
    are written off as admitted (as after an engine restart) and only the routes
    made from now on are compared with what the engines admit under the new index.
    """
    with core.lock:
        count = max(count, index + 1)
        changed = index != core.client_index
        recount = count != core.client_count
        core.client_index, core.client_count = index, count
        if changed:
            snap = core.snapshot
            for e in core.known:
                c = snap.engines.get(e.engine_id) if snap is not None else None
                adm = c.admitted if c is not None else None
                e.routed_before = e.routed - (adm[index] if adm and index < len(adm) else 0)
        if changed or recount or core.share_estimate.totals is None:
            core.restart_share(count)


class ClientLease:
    """Holds one auto index for an API server (asyncio).

    ``on_change(index, count)`` is called whenever either changes (and once at
    acquisition); ``attach(core)`` wires it to a RouterCore.
    """

    def __init__(
        self,
        client: AsyncRedisClient,
        keys: DeploymentKeys,
        *,
        ttl_s: float = 10.0,
        on_change: Callable[[int, int], None] | None = None,
    ) -> None:
        if not 0.3 <= ttl_s <= 3600:
            raise InvalidArgument(f"lease ttl_s must be in 0.3..3600, got {ttl_s!r}")
        self.client = client
        self.keys = keys
        self.ttl_s = ttl_s
        self.token = secrets.token_hex(8)
        self.index = -1
        self.count = 0
        self.on_change = on_change
        self._script = client.register_script(LEASE_LUA)
        self._task: asyncio.Task[None] | None = None

    def attach(self, core: RouterCore) -> None:
        self.on_change = lambda i, c: apply_lease(core, i, c)

    async def renew(self) -> tuple[int, int]:
        """Acquire or renew now (one round trip); returns (index, count)."""
        ttl_ms = int(self.ttl_s * 1000)
        raw = await self._script(
            keys=[self.keys.clients], args=[self.token, ttl_ms, MAX_CLIENTS, self.index]
        )
        index, count = int(raw[0]), int(raw[1])
        if index < 0:
            raise LeaseUnavailable(f"all {MAX_CLIENTS} client indexes are leased")
        if (index, count) != (self.index, self.count):
            if self.index >= 0 and index != self.index:
                log.warning("client lease: index %d was lost, now %d", self.index, index)
            self.index, self.count = index, count
            if self.on_change is not None:
                self.on_change(index, count)
        return index, count

    async def start(self) -> None:
        """Try to acquire an index now and keep renewing it in the background.

        With Redis unreachable the router keeps its provisional index (0 of 1) and
        the renewer retries, as the snapshot feed does.
        """
        try:
            await self.renew()
        except LeaseUnavailable:
            raise
        except Exception as exc:
            log.warning("client lease: no index yet (%s: %s); retrying", type(exc).__name__, exc)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._renewer())

    async def _renewer(self) -> None:
        while True:
            await asyncio.sleep(self.ttl_s / 3 if self.index >= 0 else 0.5)
            try:
                await self.renew()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # keep the index we have; retry next period
                log.warning("client lease renewal failed: %s: %s", type(exc).__name__, exc)

    async def aclose(self) -> None:
        """Stop renewing and release the index (best effort)."""
        task, self._task = self._task, None
        await cancel_and_wait(task)
        if self.index >= 0:
            try:
                await self.client.zrem(self.keys.clients, f"{self.index}:{self.token}")
            except Exception as exc:  # the index stays taken until its lease runs out
                log.warning(
                    "client index %d not released (%s: %s); it frees itself in %.0f s",
                    self.index, type(exc).__name__, exc, self.ttl_s,
                )  # fmt: skip
