"""The OpenAI-compatible gateway: one aiohttp server, one aiohttp client session.

Every ``POST /v1/completions`` and ``/v1/chat/completions`` is routed with the
deployment's ``AsyncRouter`` and proxied to the chosen engine's base URL; a
streamed answer (server-sent events) is passed through chunk by chunk as it
arrives. The router is told ``finished()`` on every path: completion, upstream
failure, timeout, and a client that goes away (aiohttp cancels the handler;
the ``finally`` below runs either way).

Failures before any byte reached the client (connect error, upstream 502/503,
the connection dropped before the first chunk) are retried once on another
engine (never for a pinned request); after bytes were streamed the client's
stream ends with an ``error`` event. Engines and their URLs come from Redis
(redisbal.endpoints, re-read every ``refresh_s``) and from ``--engine ID=URL``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from redisbal import endpoints
from redisbal.background import cancel_and_wait
from redisbal.gateway.metrics import CONTENT_TYPE, GatewayMetrics, monotonic_age
from redisbal.keys import InvalidName, check_name
from redisbal.policies import MAX_KEY_LEN, Decision, NoEngines, UnknownEngine
from redisbal.router import AsyncRouter

log = logging.getLogger("redisbal.gateway")

RANK_HEADER = "X-data-parallel-rank"  # vLLM's pinning header: an engine rank
ENGINE_HEADER = "X-Redisbal-Engine"  # pin to an engine id; also set on every answer
CLIENT_HEADER = "X-Redisbal-Client-Index"  # tells the engine which API server sent it
RETRY_STATUSES = (502, 503)
# a request is retried once after a failure that may have reached its engine; one the
# engine certainly never got (connect refused) may also try a third engine
MAX_ATTEMPTS = 3
PROXY_PATHS = ("/v1/completions", "/v1/chat/completions")
KEY_HEADER = "X-Redisbal-Key"  # a session or prefix key: its requests prefer one engine
CHARS_PER_TOKEN = 4  # prompt size estimate without a tokenizer (English text, roughly)


def request_hints(body: Mapping[str, Any], key_header: str | None) -> tuple[str | None, int]:
    """What the router is told of a request: its key (the X-Redisbal-Key header,
    else the body's ``user``) and its prompt size in tokens, estimated from the
    prompt's characters (no tokenizer on the request path). ValueError on a bad key."""
    key = key_header if key_header is not None else body.get("user")
    if key is not None and (not isinstance(key, str) or not 0 < len(key) <= MAX_KEY_LEN):
        raise ValueError(f"{KEY_HEADER} (or user) must be 1-{MAX_KEY_LEN} characters")
    chars = 0
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        chars = len(prompt)
    elif isinstance(prompt, list):
        chars = sum(len(p) if isinstance(p, str) else 4 * CHARS_PER_TOKEN for p in prompt)
    messages = body.get("messages")
    if isinstance(messages, list):
        for msg in messages:
            content = msg.get("content") if isinstance(msg, dict) else None
            if isinstance(content, str):
                chars += len(content)
            elif isinstance(content, list):
                chars += sum(
                    len(part["text"])
                    for part in content
                    if isinstance(part, dict) and isinstance(part.get("text"), str)
                )
    return key, chars // CHARS_PER_TOKEN


class _Retry(Exception):
    """An attempt failed before any byte reached the client: try another engine."""

    def __init__(self, reason: str, detail: str, status: int = 502, unsent: bool = False) -> None:
        super().__init__(detail)
        self.reason, self.detail, self.status = reason, detail, status
        self.unsent = unsent  # the engine certainly never got the request (connect refused)


def _json_error(
    status: int, message: str, kind: str = "invalid_request_error", **headers: str
) -> web.Response:
    body = {"error": {"message": message, "type": kind, "code": status}}
    return web.Response(
        status=status, body=orjson.dumps(body), content_type="application/json", headers=headers
    )


@web.middleware
async def _unserved_as_json(request: web.Request, handler: Any) -> web.StreamResponse:
    """aiohttp's own 404 and 405 (a path or method the gateway does not serve) as error
    JSON like the gateway's other errors, which OpenAI clients parse."""
    try:
        return await handler(request)
    except web.HTTPMethodNotAllowed as exc:
        allowed = ", ".join(sorted(exc.allowed_methods))
        return _json_error(
            405, f"{request.method} is not served on {request.path[:200]}: use {allowed}",
            Allow=allowed,
        )  # fmt: skip
    except web.HTTPNotFound:
        served = ", ".join([*PROXY_PATHS, "/v1/models", "/health", "/metrics"])
        return _json_error(404, f"no such path: {request.path[:200]} (served: {served})")


def _unroute(router: AsyncRouter, decision: Decision, reason: str | None = None) -> None:
    """The request of ``decision`` never reached its engine: take the route back (the
    engine's admitted count will not include it), and with a ``reason`` tell the router
    the engine failed (``failed()``: it avoids the engine and tells the deployment)."""
    router.core.unroute(decision)
    if reason is not None:
        router.failed(decision, reason)


class Gateway:
    """The proxy. ``start()`` binds, ``drain()`` stops accepting and waits."""

    def __init__(
        self,
        router: AsyncRouter,
        *,
        redis_client: Any = None,
        static_urls: Mapping[str, str] | None = None,
        timeout_s: float = 600.0,
        connect_timeout_s: float = 2.0,
        max_body: int = 4 * 1024 * 1024,
        refresh_s: float = 1.0,
    ) -> None:
        self.router = router
        self.redis = redis_client
        self.static_urls = dict(static_urls or {})
        self.urls: dict[str, str] = dict(self.static_urls)
        self.timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=connect_timeout_s)
        self.max_body = max_body
        self.refresh_s = refresh_s
        self.inflight = 0
        self.draining = False
        self.metrics = GatewayMetrics(
            snapshot_age=lambda: monotonic_age(router.core.snapshot_at),
            client_index=lambda: router.core.client_index,
            client_count=lambda: router.core.client_count,
            inflight=lambda: self.inflight,
        )
        self.session: aiohttp.ClientSession | None = None
        self.runner: web.AppRunner | None = None
        self.sites: list[web.TCPSite] = []
        self._refresher: asyncio.Task[None] | None = None
        self._refetch: asyncio.Task[None] | None = None  # one re-read for many requests
        self._idle = asyncio.Event()
        self._idle.set()

    # -- engines and their URLs ----------------------------------------------------------------

    async def refresh_urls(self) -> None:
        if self.redis is None:
            return
        found = await endpoints.fetch(self.redis, self.router.keys)
        # an engine the router still routes to keeps its last URL if the hash lost it
        # (Redis restarted empty: engines register theirs again within seconds)
        known = self.router.core.by_id
        kept = {e: u for e, u in self.urls.items() if e in known}
        self.urls = {**kept, **found, **self.static_urls}  # --engine wins over Redis

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            try:
                await self.refresh_urls()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis away: keep the URLs we know
                log.debug("gateway: url refresh failed: %s", exc)

    async def _refetch_urls(self) -> None:
        """Re-read the URLs now for the requests that found none: engines that left
        (their URLs dropped) and came back are routed at their first report, before
        the next periodic refresh. Concurrent callers share one read."""
        if self._refetch is None or self._refetch.done():
            self._refetch = asyncio.get_running_loop().create_task(self.refresh_urls())
        with contextlib.suppress(Exception):
            await asyncio.shield(self._refetch)

    def live_engines(self) -> list[str]:
        """Engines the router knows that have a URL."""
        return [e for e in self.router.core.by_id if e in self.urls]

    # -- lifecycle -----------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body, middlewares=[_unserved_as_json])
        for path in PROXY_PATHS:
            app.router.add_post(path, self._proxy)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        return app

    async def start(self, host: str, port: int) -> None:
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=30)
        self.session = aiohttp.ClientSession(
            connector=connector, timeout=self.timeout, auto_decompress=False
        )
        with contextlib.suppress(Exception):
            await self.refresh_urls()
        self._refresher = asyncio.get_running_loop().create_task(self._refresh_loop())
        self.runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, host, port, backlog=1024)
        await site.start()
        self.sites.append(site)

    @property
    def ports(self) -> list[int]:
        out = []
        for site in self.sites:
            server = site._server
            for sock in getattr(server, "sockets", None) or []:
                out.append(sock.getsockname()[1])
        return out

    async def drain(self, timeout_s: float = 30.0) -> bool:
        """Stop accepting, wait up to ``timeout_s`` for in-flight requests; True if all
        ended. Requests arriving on kept-alive connections meanwhile get a 503."""
        self.draining = True
        for site in self.sites:
            server = site._server
            if server is not None:
                server.close()  # the listening socket: new connections are refused
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        return self.inflight == 0

    async def close(self) -> None:
        await cancel_and_wait(self._refresher)
        await cancel_and_wait(self._refetch)
        if self.runner is not None:
            await self.runner.cleanup()
        if self.session is not None:
            await self.session.close()

    # -- small endpoints -----------------------------------------------------------------------

    async def _health(self, request: web.Request) -> web.Response:
        core = self.router.core
        live = self.live_engines()
        known = core.snapshot is not None or bool(core.engines)
        ready = not self.draining and bool(live) and known
        body = {
            "ready": ready,
            "draining": self.draining,
            "snapshot_version": core.snapshot.version if core.snapshot else None,
            "degraded": core.degraded,
            "engines": live,
            "client_index": core.client_index,
            "client_count": core.client_count,
        }
        return web.Response(
            status=200 if ready else 503, body=orjson.dumps(body), content_type="application/json"
        )

    async def _metrics(self, request: web.Request) -> web.Response:
        resp = web.Response(body=self.metrics.render())
        resp.headers["Content-Type"] = CONTENT_TYPE
        return resp

    async def _models(self, request: web.Request) -> web.Response:
        assert self.session is not None
        for eid in self.live_engines():
            try:
                async with self.session.get(self.urls[eid] + "/v1/models") as up:
                    body = await up.read()
                    if up.status == 200:
                        return web.Response(body=body, content_type="application/json")
            except (aiohttp.ClientError, asyncio.TimeoutError):
                continue
        return _json_error(
            503, "no engine answered /v1/models", "unavailable", **{"Retry-After": "1"}
        )

    # -- the proxy -----------------------------------------------------------------------------

    def _pin(self, request: web.Request) -> str | web.Response | None:
        rank = request.headers.get(RANK_HEADER)
        eid = request.headers.get(ENGINE_HEADER)
        if rank is not None:
            r = rank.strip()
            if not (r.isascii() and r.isdigit()) or len(r) > 6:  # "³" is a digit to isdigit()
                return _json_error(400, f"{RANK_HEADER} must be a whole number, got {rank[:32]!r}")
            return str(int(r))
        if eid is not None:
            try:
                return check_name(eid.strip(), "engine id")
            except InvalidName as exc:
                return _json_error(400, f"{ENGINE_HEADER}: {exc}")
        return None

    def _route(
        self, pin: str | None, avoid: set[str], key: str | None = None, tokens: int = 0
    ) -> Decision:
        """Route (or pin); an engine without a URL, or in ``avoid``, is swapped for the
        least-loaded engine that has one. Raises NoEngines / UnknownEngine."""
        router = self.router
        d = router.route(pin, key=key, prompt_tokens=tokens)
        if pin is not None and pin not in self.urls:
            _unroute(router, d)
            raise NoEngines(f"engine {pin!r} has no known URL (not registered, no --engine)")
        if pin is not None or (d.engine_id in self.urls and d.engine_id not in avoid):
            return d
        _unroute(router, d)  # no URL, or it failed this request already: another one
        loads = router.core.loads()
        ok = [e for e in loads if e in self.urls and e not in avoid]
        if not ok:
            raise NoEngines("no engine with a known URL")
        d = router.route(min(ok, key=loads.__getitem__), prompt_tokens=tokens)
        d.pinned = False
        return d

    def _begin(self) -> None:
        self.inflight += 1
        self._idle.clear()

    def _end(self) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self._idle.set()

    async def _proxy(self, request: web.Request) -> web.StreamResponse:
        t0 = time.perf_counter()
        path = request.path
        m = self.metrics
        if self.draining:
            m.requests.labels(path, "503").inc()
            return _json_error(
                503,
                "gateway is shutting down",
                "unavailable",
                **{"Retry-After": "1", "Connection": "close"},
            )
        self._begin()
        try:
            resp = await self._proxy_inner(request, t0)
            m.requests.labels(path, str(resp.status)).inc()
            return resp
        except asyncio.CancelledError:
            m.errors.labels("client_disconnect").inc()
            raise
        finally:
            self._end()

    async def _read_body(
        self, request: web.Request
    ) -> tuple[bytes, bool, dict[str, Any]] | web.Response:
        m = self.metrics
        if request.content_length is not None and request.content_length > self.max_body:
            m.errors.labels("too_large").inc()
            return _json_error(413, f"the body exceeds {self.max_body} bytes")
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            m.errors.labels("too_large").inc()
            return _json_error(413, f"the body exceeds {self.max_body} bytes")
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            m.errors.labels("bad_request").inc()
            return _json_error(400, f"malformed JSON body: {exc}")
        if not isinstance(body, dict):
            m.errors.labels("bad_request").inc()
            return _json_error(400, "the body must be a JSON object")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            m.errors.labels("bad_request").inc()
            return _json_error(400, "stream must be true or false")
        return raw, stream, body

    async def _proxy_inner(self, request: web.Request, t0: float) -> web.StreamResponse:
        m = self.metrics
        got = await self._read_body(request)
        if isinstance(got, web.Response):
            return got
        raw, stream, body = got
        try:
            key, tokens = request_hints(body, request.headers.get(KEY_HEADER))
        except ValueError as exc:
            m.errors.labels("bad_request").inc()
            return _json_error(400, str(exc))
        pin = self._pin(request)
        if isinstance(pin, web.Response):
            m.errors.labels("bad_request").inc()
            return pin
        headers = {"Content-Type": "application/json"}
        if (auth := request.headers.get("Authorization")) is not None:
            headers["Authorization"] = auth
        avoid: set[str] = set()
        last: _Retry | None = None
        reached = 0  # failures after which the engine may have had the request
        for attempt in range(1 if pin is not None else MAX_ATTEMPTS):
            try:
                try:
                    d = self._route(pin, avoid, key, tokens)
                except NoEngines:
                    core = self.router.core
                    if self.redis is None or all(e in self.urls for e in core.by_id):
                        raise
                    await self._refetch_urls()  # engines without a URL: it may be new
                    d = self._route(pin, avoid, key, tokens)
            except UnknownEngine:
                m.errors.labels("bad_request").inc()
                live = sorted(self.router.core.by_id, key=lambda e: (len(e), e))
                return _json_error(
                    400, f"no live engine {pin!r} to pin to; live engines: {', '.join(live)}"
                )
            except NoEngines as exc:
                if last is not None:
                    break
                m.errors.labels("no_engine").inc()
                return _json_error(503, str(exc), "unavailable", **{"Retry-After": "1"})
            m.decision(d.engine_id)
            if attempt:
                m.retries.inc()
            headers[CLIENT_HEADER] = str(d.client_index)
            try:
                return await self._attempt(request, d, raw, headers, stream, t0)
            except _Retry as exc:
                last = exc
                avoid.add(d.engine_id)
                reached += not exc.unsent
                m.errors.labels(exc.reason).inc()
                again = pin is None and attempt + 1 < MAX_ATTEMPTS and reached <= 1
                log.info(
                    "gateway: engine %s failed (%s); %s",
                    d.engine_id,
                    exc.detail,
                    "retrying" if again else "giving up",
                )
                if not again:
                    break
        assert last is not None
        return _json_error(last.status, last.detail, "upstream_error")

    async def _attempt(
        self,
        request: web.Request,
        d: Decision,
        raw: bytes,
        headers: dict[str, str],
        stream: bool,
        t0: float,
    ) -> web.StreamResponse:
        """One upstream try. Raises _Retry only while nothing was sent to the client."""
        assert self.session is not None
        router, m = self.router, self.metrics
        url = self.urls[d.engine_id] + request.path
        outcome = "failed"
        failure: str | None = None  # what the router's failed() is told
        up: aiohttp.ClientResponse | None = None
        t_up = time.perf_counter()
        try:
            try:
                up = await self.session.post(url, data=raw, headers=headers)
            except aiohttp.ClientConnectorError as exc:
                outcome = "unrouted"
                raise _Retry(
                    "connect", f"engine {d.engine_id} unreachable: {exc}", unsent=True
                ) from None
            except aiohttp.ClientError as exc:
                raise _Retry("connect", f"engine {d.engine_id} failed: {exc}") from None
            except asyncio.TimeoutError:
                m.errors.labels("timeout").inc()
                return _json_error(504, f"engine {d.engine_id} timed out", "timeout")
            if up.status in RETRY_STATUSES:
                outcome = "unrouted"
                raise _Retry(
                    "upstream_status", f"engine {d.engine_id} answered {up.status}", up.status
                )
            ctype = up.headers.get("Content-Type", "application/json")
            if not ctype.startswith("text/event-stream"):
                try:
                    body = await up.read()
                except aiohttp.ClientError as exc:
                    raise _Retry("connect", f"engine {d.engine_id} dropped: {exc}") from None
                except asyncio.TimeoutError:
                    m.errors.labels("timeout").inc()
                    return _json_error(504, f"engine {d.engine_id} timed out", "timeout")
                t_done = time.perf_counter()
                whole = web.Response(status=up.status, body=body)
                whole.headers["Content-Type"] = ctype
                whole.headers[ENGINE_HEADER] = d.engine_id
                outcome = "ok"
                m.observe_added(False, (t_up - t0) + (time.perf_counter() - t_done))
                return whole
            resp, outcome = await self._relay(request, d, up, t0, t_up)
            return resp
        except _Retry as exc:
            failure = exc.detail
            raise
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            if up is not None:
                if outcome == "ok":
                    up.release()
                else:  # drop the connection: the engine sees the client leave and aborts
                    up.close()
            if outcome in ("ok", "cancelled"):
                router.finished(d)
            elif outcome == "unrouted":
                _unroute(router, d, failure or "unreachable")
            else:
                router.failed(d, failure or outcome)

    async def _relay(
        self,
        request: web.Request,
        d: Decision,
        up: aiohttp.ClientResponse,
        t0: float,
        t_up: float,
    ) -> tuple[web.StreamResponse, str]:
        """Pass an SSE stream through; returns (response, outcome). Headers go out with
        the first chunk, so an engine that dies before its first token is retried."""
        m = self.metrics
        chunks = up.content.iter_any()
        try:
            first = await chunks.__anext__()
        except StopAsyncIteration:
            first = b""
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise _Retry(
                "stream",
                f"engine {d.engine_id} dropped before its first token: {type(exc).__name__}",
            ) from None
        t_first = time.perf_counter()
        resp = web.StreamResponse(status=up.status)
        resp.headers["Content-Type"] = "text/event-stream"
        resp.headers["Cache-Control"] = "no-cache"
        resp.headers[ENGINE_HEADER] = d.engine_id
        try:
            await resp.prepare(request)
            if first:
                await resp.write(first)
            m.observe_added(True, (t_up - t0) + (time.perf_counter() - t_first))
            try:
                async for chunk in chunks:
                    await resp.write(chunk)
            except (
                aiohttp.ClientPayloadError,
                aiohttp.ServerDisconnectedError,
                aiohttp.ClientOSError,
                asyncio.TimeoutError,
            ) as exc:
                m.errors.labels("stream").inc()
                msg = f"engine {d.engine_id} failed mid-stream: {type(exc).__name__}"
                err = {"error": {"message": msg, "type": "upstream_error", "code": 502}}
                await resp.write(b"data: " + orjson.dumps(err) + b"\n\n")
                await resp.write_eof()
                return resp, "stream"
            await resp.write_eof()
        except ConnectionResetError:  # the client went away mid-stream
            m.errors.labels("client_disconnect").inc()
            return resp, "cancelled"
        return resp, "ok"
