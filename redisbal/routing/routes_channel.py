"""A router's side of the deployment's routes channel: telling the other routers its
routes and hearing theirs (what they mean, and how they are counted: routing.told_routes).

It tells within ``COALESCE_S`` of a route made or taken back (one message for all
made meanwhile) and every ``TELL_EVERY_S`` besides, so that the others know it is
there; it hears on the snapshot feed's own subscription (SSUBSCRIBE on a cluster,
whose publishes are then SPUBLISH). A router whose ACL lacks the channel warns once
and goes on without it: the others count its routes from its share.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any

import redis.exceptions

from redisbal.background import cancel_and_wait
from redisbal.connection import AsyncRedisClient, redact
from redisbal.routing.router_core import RouterCore
from redisbal.routing.told_routes import COALESCE_S, TELL_EVERY_S, telling

log = logging.getLogger("redisbal.routing.router")  # (its warnings are the router's)


class RoutesChannel:
    """Tells and hears routes for one router (``enabled=False``: neither)."""

    def __init__(self, core: RouterCore, channel: str, enabled: bool) -> None:
        self.core = core
        self.channel = channel
        self.names = (channel, channel.encode())  # as a message names it
        self.telling = enabled  # both off, too, once Redis refuses the channel
        self.hearing = enabled
        self.sharded = False  # the feed's subscription: SPUBLISH then
        self._loop: asyncio.AbstractEventLoop | None = None
        self._client: AsyncRedisClient | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._told_at = -math.inf
        self._closed = False
        core.told_routes.on_change = self.soon

    def attach(self, loop: asyncio.AbstractEventLoop, client: AsyncRedisClient) -> None:
        """The loop and client to tell with (the router's, once started)."""
        self._loop, self._client = loop, client

    async def aclose(self) -> None:
        self._closed = True
        for task in list(self._tasks):
            await cancel_and_wait(task)  # (a publish sits in a redis-py call)

    # -- telling -------------------------------------------------------------------------------

    def soon(self) -> None:
        """A route was made or taken back: tell within COALESCE_S (any thread; called
        under the core's lock, once per message)."""
        loop = self._loop
        if loop is None or self._closed or not self.telling:
            return
        if not telling(self.core.client_count):
            return  # (the heartbeat tells what changed once there is someone to tell)
        try:
            here = asyncio.get_running_loop() is loop
        except RuntimeError:
            here = False
        if here:
            loop.call_later(COALESCE_S, self._now)
        else:
            with contextlib.suppress(RuntimeError):  # the loop closed under us
                loop.call_soon_threadsafe(loop.call_later, COALESCE_S, self._now)

    def tick(self) -> None:
        """The feed's turn, between messages: every TELL_EVERY_S, see which routers
        are still heard from and tell again (a heartbeat when nothing changed)."""
        loop = asyncio.get_running_loop()
        if loop.time() - self._told_at < TELL_EVERY_S:
            return
        self.core.check_told()
        if self.telling and telling(self.core.client_count):
            self._now()
        else:
            self._told_at = loop.time()

    def _now(self) -> None:
        if self._closed or self._client is None or not self.telling:
            return
        loop = asyncio.get_running_loop()
        self._told_at = loop.time()
        task = loop.create_task(self._publish(self.core.told()))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _publish(self, data: bytes) -> None:
        assert self._client is not None
        try:
            if self.sharded:
                await self._client.execute_command("SPUBLISH", self.channel, data)
            else:
                await self._client.publish(self.channel, data)
        except redis.exceptions.NoPermissionError as exc:
            self.telling = False
            self._refused("publish on", exc)
        except (redis.exceptions.RedisError, OSError):
            pass  # the others count this router's routes by share until it tells again

    # -- hearing -------------------------------------------------------------------------------

    async def subscribe(
        self, pubsub: Any, sharded: bool, confirmed: Callable[[], Awaitable[None]]
    ) -> None:
        """Subscribe the feed's ``pubsub`` to the channel too, and wait until
        ``confirmed()``; without the permission (an ACL made before the channel
        existed) the router goes on without it, with one warning."""
        self.sharded = sharded
        if not self.hearing:
            return
        try:
            if sharded:
                await pubsub.ssubscribe(self.channel)
            else:
                await pubsub.subscribe(self.channel)
            await confirmed()
        except redis.exceptions.NoPermissionError as exc:
            if self.telling:  # (once)
                self._refused("subscribe to", exc)
            self.telling = self.hearing = False

    def _refused(self, what: str, exc: Exception) -> None:
        log.warning(
            "router %d: may not %s %s (%s): other routers' routes are estimated from this "
            "router's share; grant the channel and PUBLISH (docs/DEPLOY.md, ACL users)",
            self.core.client_index,
            what,
            self.channel,
            redact(str(exc)),
        )
