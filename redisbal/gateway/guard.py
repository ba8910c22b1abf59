"""The gateway's HTTP connections, below the app: a bound on the time to a request's
head (slowloris), a cap on open connections below the file-descriptor limit, and
aiohttp's own HTTP parsing errors answered as error JSON without a traceback.

aiohttp's ``AppRunner`` builds a ``Server`` whose protocol (``RequestHandler``) is one
per connection; ``GuardedRunner`` builds the same server with ``GuardedHandler``
instead. A connection is *idle* from its start, and again after each answer, until a
whole request head arrived. An idle connection that sent nothing closes
``keepalive_timeout_s`` after it became idle; once the first bytes of a head arrived,
the whole head must follow within ``header_timeout_s`` (slowloris). The keep-alive
bound is long (75 s, as nginx's) because clients keep idle connections in pools and
reuse them at will: one that a server closes while the client picks it fails that
request (httpx, which the openai client uses, keeps them 5 s: a 5 s server timeout
failed requests under load). Past ``max_connections``, a new connection closes the oldest idle one
(one that holds no request), so that silent connections cannot starve the clients
that send requests; only when every connection holds a request is the new one closed.

These classes lean on aiohttp's private names (``RequestHandler._handle_request``,
``_messages``, ``_force_close``, ``_manager``, ``_loop``; ``Server._kwargs``;
``AppRunner._make_server``): tests/test_aiohttp_hooks.py checks each on the installed
aiohttp, and the pin in pyproject.toml stops below the next minor release not yet checked.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest
from aiohttp.web_server import Server

from redisbal.gateway.errors import json_error

log = logging.getLogger("redisbal.gateway")

FD_RESERVE = 64  # descriptors kept for Redis, logs, the listening sockets and the like


@dataclass(frozen=True)
class Limits:
    """What one connection may take. ``max_connections`` 0: no cap."""

    header_timeout_s: float = 10.0
    keepalive_timeout_s: float = 75.0
    max_connections: int = 0
    max_line_size: int = 8190  # the request line and each header line, in bytes
    max_field_size: int = 8190


def raise_nofile() -> int:
    """Raise the soft limit of open files to the hard limit; returns the soft limit
    now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft == resource.RLIM_INFINITY or soft >= want:
        return soft if soft != resource.RLIM_INFINITY else want
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ValueError, OSError) as exc:  # e.g. above fs.nr_open
        log.warning("gateway: cannot raise the open-file limit to %d: %s", want, exc)
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def default_max_connections(nofile: int) -> int:
    """Client connections that fit below ``nofile``: each one may hold a request with
    its own connection to an engine, so two descriptors per client connection."""
    return max(16, (nofile - FD_RESERVE) // 2)


class ConnectionGuard:
    """The connections of one server: how many, which are idle (oldest first)."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.open = 0
        self.idle: OrderedDict[GuardedHandler, None] = OrderedDict()
        self.closed = {"header_timeout": 0, "evicted": 0, "refused": 0}


class GuardedHandler(RequestHandler):
    """aiohttp's protocol for one connection, with the guard's bounds."""

    def __init__(self, manager: Server, guard: ConnectionGuard, **kw: Any) -> None:
        super().__init__(manager, **kw)
        self._guard = guard
        self._timer: asyncio.TimerHandle | None = None
        self._deadline = 0.0  # while idle: it closes then unless a whole head arrived
        self._heading = False  # idle, and a head has begun to arrive

    def _set_idle(self) -> None:
        self._guard.idle[self] = None
        self._heading = False
        self._close_after(self._guard.limits.keepalive_timeout_s)

    def _close_after(self, after_s: float) -> None:
        """Close the connection ``after_s`` from now unless it is busy by then. Its one
        timer is set again only when it would fire too late: a connection serving
        request after request sets one per keep-alive bound, not one per request."""
        self._deadline = deadline = self._loop.time() + after_s
        if self._timer is None or self._timer.when() > deadline:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = self._loop.call_at(deadline, self._head_late)

    def _set_busy(self) -> None:
        self._guard.idle.pop(self, None)

    def _head_late(self) -> None:
        self._timer = None
        if self not in self._guard.idle:
            return  # busy: becoming idle again sets the timer
        if self._loop.time() < self._deadline:  # idle again since: wait for that bound
            self._timer = self._loop.call_at(self._deadline, self._head_late)
            return
        self._guard.closed["header_timeout"] += 1  # no whole request head in time
        self.force_close()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        g = self._guard
        g.open += 1
        cap = g.limits.max_connections
        if cap and g.open > cap:
            victim = next(iter(g.idle), None)
            if victim is None:  # every connection holds a request: this one goes
                g.closed["refused"] += 1
                self.force_close()
                return
            g.closed["evicted"] += 1
            victim._set_busy()
            victim.force_close()
        self._set_idle()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._manager is not None:  # (aiohttp ignores a second call)
            self._guard.open -= 1
            self._set_busy()
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self in self._guard.idle:
            if self._messages:  # a whole head arrived
                self._set_busy()
            elif data and not self._heading:  # a head began: it has header_timeout_s
                self._heading = True
                self._close_after(self._guard.limits.header_timeout_s)

    async def _handle_request(
        self,
        request: BaseRequest,
        start_time: float | None,
        request_handler: Callable[[BaseRequest], Awaitable[web.StreamResponse]],
    ) -> tuple[web.StreamResponse, bool]:
        try:
            return await super()._handle_request(request, start_time, request_handler)
        finally:
            if not self._force_close and not self._messages and self.transport is not None:
                self._set_idle()

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """aiohttp's answer to a request it could not parse (400), a handler that raised
        (500) or timed out (504): error JSON; a traceback only for the gateway's own
        faults, a client's malformed request is one line at info."""
        if status >= 500:
            if exc is not None:
                log.error("gateway: internal error on a request", exc_info=exc)
            text = "internal error of the gateway" if status == 500 else HTTPStatus(status).phrase
        else:
            text = f"malformed HTTP request: {(message or HTTPStatus(status).phrase)[:200]}"
            log.info("gateway: %s from %s", text, request.remote)
        if request.writer.output_size > 0:
            raise ConnectionError("the answer had begun: no error answer can follow")
        kind = "server_error" if status >= 500 else "invalid_request_error"
        resp = json_error(status, text, kind)
        resp.force_close()
        return resp


class GuardedServer(Server):
    def __init__(self, guard: ConnectionGuard, handler: Any, **kw: Any) -> None:
        super().__init__(handler, **kw)
        self.guard = guard

    def __call__(self) -> RequestHandler:
        return GuardedHandler(self, self.guard, loop=self._loop, **self._kwargs)


class GuardedRunner(web.AppRunner):
    """``web.AppRunner`` whose server's connections are guarded."""

    def __init__(self, app: web.Application, guard: ConnectionGuard, **kw: Any) -> None:
        super().__init__(app, **kw)
        self.guard = guard

    async def _make_server(self) -> Server:
        plain = await super()._make_server()
        return GuardedServer(
            self.guard,
            plain.request_handler,
            request_factory=plain.request_factory,
            handler_cancellation=plain.handler_cancellation,
            loop=plain._loop,
            **plain._kwargs,
        )
