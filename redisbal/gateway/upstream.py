"""The gateway's HTTP/1.1 client to its engines: asyncio protocols and httptools' parser.

The gateway passes each request on and relays the answer, chunk by chunk; it needs a
status, a content type and the body, and nothing else a general client carries
(cookies, redirects, tracing, multidicts). aiohttp's client cost the gateway about
0.1 ms of CPU per whole request and 0.2 ms per streamed one more than this (the
gateway-overhead benchmark), a fifth of all it spends. Kept-alive connections are
pooled per engine, reused last-in first-out, and dropped after ``IDLE_S`` unused, before
engines close theirs (uvicorn, under vLLM, closes at 5 s); a request written to one the
engine closes unanswered all the same (a restart) goes again on a new connection.

A response is returned once its status line and headers are in; its body comes with
``chunk()`` or ``read()``. Reading pauses while more than ``HIGH_WATER`` bytes wait
unread. ``close()`` before the end drops the connection, which an engine takes as the
client leaving (it aborts the request); after the end the connection is already back
in the pool.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import time
from typing import Any
from urllib.parse import urlsplit

import httptools

from redisbal.errors import (
    InvalidArgument,
    InvalidURL,
    UpstreamClosed,
    UpstreamError,
    UpstreamUnreachable,
)
from redisbal.gateway.first_byte import timeout, within

IDLE_S = 4.0  # a pooled connection unused this long is closed, not reused
HIGH_WATER = 256 * 1024  # unread body bytes at which reading pauses
POOL_PER_ENGINE = 256  # idle connections kept per engine (more are closed)

__all__ = ["Response", "UpstreamClosed", "UpstreamError", "UpstreamUnreachable", "Upstreams"]


class Response:
    """One engine answer: ``status`` and ``headers`` (lower-case names), then the body."""

    def __init__(self, conn: _Conn) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self._conn: _Conn | None = conn  # None once the answer is whole (or dropped)
        self._head: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._error: UpstreamError | None = None
        self._ended = False
        self._waiter: asyncio.Future[None] | None = None

    async def chunk(self) -> bytes | None:
        """What has come of the body since the last call (waiting for some), or None
        at its end. Raises UpstreamError if the engine dropped it."""
        while not self._chunks:
            if self._error is not None:
                raise self._error
            if self._ended:
                return None
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        out = self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)
        self._chunks.clear()
        self._buffered = 0
        conn = self._conn
        if conn is not None and conn.paused:
            conn.resume()
        return out

    async def read(self, within_s: float | None = None) -> bytes:
        """The whole body; ``asyncio.TimeoutError`` if it is not all in ``within_s``
        (no timer is set for a body already in, as most short answers are)."""
        return await within(self._read(), None if self._ended else within_s)

    async def _read(self) -> bytes:
        parts = []
        while (part := await self.chunk()) is not None:
            parts.append(part)
        return b"".join(parts)

    def close(self) -> None:
        """Drop the connection unless the answer already came whole."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.abort()

    # -- fed by the connection ---------------------------------------------------------------

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _body(self, data: bytes) -> bool:
        """Takes a part of the body; True while reading may go on."""
        self._chunks.append(data)
        self._buffered += len(data)
        self._wake()
        return self._buffered < HIGH_WATER

    def _end(self) -> None:
        self._conn = None
        self._ended = True
        self._wake()

    def _fail(self, error: UpstreamError) -> None:
        self._conn = None
        if not self._head.done():
            self._head.set_exception(error)
            self._head.exception()  # retrieved: nobody may be waiting any more
        self._error = error
        self._wake()


class _Conn(asyncio.Protocol):
    """One connection to an engine, answering one request at a time."""

    def __init__(self, pool: list[_Conn]) -> None:
        self.pool = pool  # the engine's idle connections, which this rejoins when free
        self.transport: asyncio.Transport | None = None
        self.parser: Any = None
        self.resp: Response | None = None
        self.paused = False
        self.until_eof = False  # an answer without a length: its end is the connection's
        self.idle_since = 0.0

    def send(self, request: bytes) -> Response:
        assert self.transport is not None and self.resp is None
        self.resp = Response(self)
        self.parser = httptools.HttpResponseParser(self)
        self.until_eof = False
        self.transport.write(request)
        return self.resp

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()  # connection_lost follows and tidies up

    def resume(self) -> None:
        self.paused = False
        if self.transport is not None:
            self.transport.resume_reading()

    # -- asyncio.Protocol ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # (uvloop's is no subclass)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        if self.resp is None:  # nothing asked: an engine talking out of turn
            self.abort()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            resp, self.resp = self.resp, None
            if resp is not None:
                resp._fail(UpstreamError(f"malformed answer: {exc}"))
            self.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self in self.pool:
            self.pool.remove(self)
        resp, self.resp = self.resp, None
        if resp is None:
            return
        if self.until_eof and resp._head.done():
            resp._end()
        else:
            resp._fail(UpstreamClosed("the engine closed the connection mid-answer"))

    # -- httptools callbacks -------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.resp is not None
        self.resp.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        resp = self.resp
        assert resp is not None
        resp.status = self.parser.get_status_code()
        h = resp.headers
        self.until_eof = "content-length" not in h and "transfer-encoding" not in h
        if not resp._head.done():  # (cancelled: its request was given up)
            resp._head.set_result(None)

    def on_body(self, body: bytes) -> None:
        assert self.resp is not None
        if not self.resp._body(body) and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        resp, self.resp = self.resp, None
        assert resp is not None
        keep = self.parser.should_keep_alive() and not self.until_eof
        resp._end()
        if self.paused:
            self.resume()
        if keep and self.transport is not None and len(self.pool) < POOL_PER_ENGINE:
            self.idle_since = time.monotonic()
            self.pool.append(self)
        elif self.transport is not None:
            self.transport.close()


async def _answer(conn: _Conn, request: bytes) -> Response:
    """Send ``request`` on ``conn``; its answer once the head is in."""
    resp = conn.send(request)
    try:
        await resp._head
    except BaseException:  # cancelled (a timeout) or failed: the connection goes
        resp.close()
        raise
    return resp


class _Target:
    """What a URL comes to: where to connect, the Host header and the request target."""

    __slots__ = ("host", "host_header", "key", "port", "target", "tls")

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise InvalidURL(f"not an http(s) URL: {url[:80]!r}")
        self.tls = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if self.tls else 80)
        self.key = (parts.scheme, self.host, self.port)
        self.host_header = parts.netloc.rpartition("@")[2].encode("ascii")
        target = parts.path or "/"
        if parts.query:
            target += "?" + parts.query
        if any(c in target for c in " \r\n\t"):
            raise InvalidArgument(f"bad request target {target[:80]!r}")
        self.target = target.encode("ascii")


class Upstreams:
    """Pooled HTTP/1.1 connections to the engines. ``request`` returns once the
    answer's head is in; the caller reads the body and ``close()``s on failure."""

    def __init__(self, connect_timeout_s: float = 5.0, ssl_context: ssl.SSLContext | None = None):
        self.connect_timeout_s = connect_timeout_s
        self._ssl = ssl_context
        self._pools: dict[tuple[str, str, int], list[_Conn]] = {}
        self._targets: dict[str, _Target] = {}

    def _target(self, url: str) -> _Target:
        t = self._targets.get(url)
        if t is None:
            if len(self._targets) > 4096:  # engines come and go: do not grow forever
                self._targets.clear()
            t = self._targets[url] = _Target(url)
        return t

    async def request(
        self, method: str, url: str, body: bytes = b"", headers: dict[str, str] | None = None
    ) -> Response:
        """Send one request; the answer once its head is in. Raises UpstreamUnreachable,
        UpstreamError, or ValueError for a header or URL that cannot be sent."""
        t = self._target(url)
        line = b"%s %s HTTP/1.1\r\nHost: %s\r\n" % (method.encode("ascii"), t.target, t.host_header)
        head = [line]
        if body or method != "GET":
            head.append(b"Content-Length: %d\r\n" % len(body))
        for name, value in (headers or {}).items():
            if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
                raise InvalidArgument(f"header {name!r} holds a line break")
            head.append(f"{name}: {value}\r\n".encode("latin-1"))
        head.append(b"\r\n")
        request = b"".join(head) + body
        conn = self._idle(t)
        if conn is not None:
            try:
                return await _answer(conn, request)
            except UpstreamClosed:  # an engine closing (or restarted) as it was reused: no
                pass  # answer came on it; once more, on a new connection
        return await _answer(await self._connect(t), request)

    def _idle(self, t: _Target) -> _Conn | None:
        pool = self._pools.get(t.key)
        if not pool:
            return None
        old = time.monotonic() - IDLE_S
        while pool:
            conn = pool.pop()
            if conn.transport is not None and conn.idle_since > old:
                return conn
            conn.abort()
        return None

    async def _connect(self, t: _Target) -> _Conn:
        pool = self._pools.setdefault(t.key, [])
        loop = asyncio.get_running_loop()
        tls: ssl.SSLContext | None = None
        if t.tls:
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            tls = self._ssl
        try:
            async with timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(
                    lambda: _Conn(pool),
                    t.host,
                    t.port,
                    ssl=tls,
                    server_hostname=t.host if tls else None,
                )
        except asyncio.TimeoutError:
            why = f"no connection in {self.connect_timeout_s:g}s"
            raise UpstreamUnreachable(f"{t.host_header.decode()}: {why}") from None
        except OSError as exc:  # refused, unresolvable, TLS handshake (ssl.SSLError)
            why = str(exc) or type(exc).__name__
            raise UpstreamUnreachable(f"{t.host_header.decode()}: {why}") from None
        return conn

    def close(self) -> None:
        """Close every pooled connection."""
        for pool in self._pools.values():
            for conn in list(pool):
                conn.abort()
            pool.clear()
