"""The request proxying: route each ``POST /v1/completions`` and
``/v1/chat/completions`` with the deployment's ``AsyncRouter``, send it to the chosen
engine's base URL, and relay the answer (a streamed one, server-sent events, chunk by
chunk as it arrives). The router is told ``finished()`` on every path: completion,
upstream failure, timeout, and a client that goes away (aiohttp cancels the handler;
the ``finally`` in ``_attempt`` runs either way).

Every attempt's outcome goes to the router (``answered``, ``failed`` with its
kind, ``finished``): an engine that fails is ejected for every router of the
deployment until a probe of it is answered (redisbal.routing.outcomes). Failures
before any byte reached the client (connect error, reset, an answer 429, 500,
502, 503 or 504, no first byte within the engine's first-byte bound) go to
another engine, up to ``max_attempts`` and within the retry budget (never for
a pinned request); after bytes were streamed, a stream that fails or goes
quiet for ``idle_timeout_s`` ends with an ``error`` event and no ``[DONE]``.
Engines and their URLs come from Redis (redisbal.endpoints, re-read every
``refresh_s``) and from ``--engine ID=URL``. With models configured, each request's
``model`` picks its deployment (redisbal.gateway.deployments), and all of the above
happens within that deployment: its router, its URLs, its retry budget.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import orjson
from aiohttp import web

from redisbal.errors import InvalidArgument
from redisbal.gateway.accesslog import (
    REQUEST_ID_HEADER,
    AccessLog,
    Record,
    request_id,
    usage_tokens,
)
from redisbal.gateway.deployments import Deployment, Models
from redisbal.gateway.errors import json_error as _json_error
from redisbal.gateway.first_byte import ChunkWatch, Silent, first_byte, within
from redisbal.gateway.metrics import GatewayMetrics
from redisbal.gateway.prefix import EVERY, BlockHasher
from redisbal.gateway.retry import (
    REFUSAL_STATUSES,
    RETRY_STATUSES,
    Acceptances,
    Retry,
    status_kind,
)
from redisbal.gateway.tracing import Tracing
from redisbal.gateway.upstream import Response, UpstreamError, Upstreams, UpstreamUnreachable
from redisbal.keys import InvalidName, check_name
from redisbal.routing.cache_view import BLOCK_TOKENS, CHARS_PER_TOKEN
from redisbal.routing.policies import NoEngines, UnknownEngine
from redisbal.routing.router import AsyncRouter
from redisbal.routing.state import MAX_KEY_LEN, Decision
from redisbal.routing.stream_gaps import Stream

log = logging.getLogger("redisbal.gateway")

RANK_HEADER = "X-data-parallel-rank"  # vLLM's pinning header: an engine rank
ENGINE_HEADER = "X-Redisbal-Engine"  # pin to an engine id; also set on every answer
CLIENT_HEADER = "X-Redisbal-Client-Index"  # tells the engine which API server sent it
MAX_ATTEMPTS = 3  # engines one request may try (the first and two retries)
CHAT_PATH = "/v1/chat/completions"
PROXY_PATHS = ("/v1/completions", CHAT_PATH)
KEY_HEADER = "X-Redisbal-Key"  # a session or prefix key: its requests prefer one engine
PROBE_HEADER = "X-Redisbal-Probe"  # on a probe: a copy of a request, its answer dropped
TRACE_HEADERS = ("traceparent", "tracestate")  # W3C trace context, passed on untraced
# attempts given up while the engine had them (their connection is dropped: it aborts)
ABANDONED = frozenset({"first_byte_timeout", "idle_timeout", "timeout"})
REFUSAL_KINDS = frozenset(map(str, REFUSAL_STATUSES))  # outcome kinds of refusals


def request_hints(
    body: Mapping[str, Any], key_header: str | None, user_key: bool = True
) -> tuple[str | None, bool, int]:
    """What the router is told of a request: its key (the X-Redisbal-Key header,
    else, with ``user_key``, the body's ``user``), whether that key was guessed (the
    user), and its prompt size in tokens, estimated from the prompt's characters (no
    tokenizer on the request path). ValueError on a bad key."""
    guessed = key_header is None and user_key
    key = body.get("user") if guessed else key_header
    if key is not None and (not isinstance(key, str) or not 0 < len(key) <= MAX_KEY_LEN):
        raise InvalidArgument(f"{KEY_HEADER} (or user) must be 1-{MAX_KEY_LEN} characters")
    if key is not None:
        try:
            key.encode()
        except UnicodeEncodeError:  # a header's non-UTF-8 bytes, kept by aiohttp as surrogates
            raise InvalidArgument(f"{KEY_HEADER} must be UTF-8 text") from None
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
    return key, guessed and key is not None, chars // CHARS_PER_TOKEN


def route_facts(
    dep: Deployment, d: Decision, n: int, key: str | None, guessed: bool
) -> dict[str, Any]:
    """Attempt ``n``'s routing decision as a trace event's attributes: the engine and
    the score's inputs at hand (the snapshot's age, the engine's counts and this
    router's routes to it not in a snapshot yet, the request's key: given or guessed,
    the prompt's tokens the engine holds when the route followed a cache match).
    Flags and the key only when there is one: each attribute costs the request path
    (the policy, the same for every request, is a resource attribute)."""
    core = dep.router.core
    at = core.snapshot_at
    facts: dict[str, Any] = {
        "redisbal.attempt": n,
        "redisbal.engine": d.engine_id,
        "redisbal.snapshot.age_s": round(core.clock() - at, 6) if at > -math.inf else -1.0,
    }
    if key is not None:
        facts["redisbal.key"] = "guessed" if guessed else "given"
    if d.cached:  # it followed a match in the engines' caches: the tokens it holds
        facts["redisbal.cache.tokens"] = d.cached * BLOCK_TOKENS
    view = core.by_id.get(d.engine_id)
    if view is not None:
        facts["redisbal.engine.running"] = view.running
        facts["redisbal.engine.waiting"] = view.waiting
        facts["redisbal.engine.pending"] = view.pending
    for flag in ("pinned", "probe", "degraded"):
        if getattr(d, flag):
            facts["redisbal." + flag] = True
    if dep.label:
        facts["redisbal.deployment"] = dep.name
    return facts


def _elsewhere(dep: Deployment, engine_id: str, avoid: set[str]) -> bool:
    """Whether a retry of a request on ``engine_id`` has another engine to go to (one
    with a URL that it has not tried: ``Proxy._route``)."""
    urls = dep.urls
    return any(e != engine_id and e in urls and e not in avoid for e in dep.router.core.by_id)


def _unroute(router: AsyncRouter, decision: Decision) -> None:
    """The request of ``decision`` never reached its engine: take the route back (the
    engine's admitted count will not include it)."""
    router.core.unroute(decision)


class Proxy:
    """Routes and relays the proxied requests; the count of requests in flight.
    ``redisbal.gateway.server.Gateway`` serves it. One deployment: ``router`` with
    ``redis_client`` (the engines' URLs) and ``static_urls``; several: ``models``
    (model name -> Deployment) and no router."""

    def __init__(
        self,
        router: AsyncRouter | None = None,
        *,
        models: Mapping[str, Deployment] | None = None,
        redis_client: Any = None,
        static_urls: Mapping[str, str] | None = None,
        timeout_s: float = 600.0,
        connect_timeout_s: float = 2.0,
        max_body: int = 4 * 1024 * 1024,
        refresh_s: float = 1.0,
        idle_timeout_s: float = 10.0,
        first_byte_timeout_s: float = 30.0,
        max_attempts: int = MAX_ATTEMPTS,
        retry_budget: float = 0.2,
        max_concurrent: int = 0,
        body_timeout_s: float = 30.0,
        engine_api_key: str | None = None,
        user_key: bool = True,
        access_log: AccessLog | None = None,
        tracing: Tracing | None = None,
        prefix_blocks: BlockHasher | None = None,
    ) -> None:
        if (router is None) == (not models):
            raise InvalidArgument("give a router (one deployment) or models, not both")
        default = (
            Deployment(
                router,
                redis_client=redis_client,
                static_urls=static_urls,
                refresh_s=refresh_s,
                retry_budget=retry_budget,
            )
            if router is not None
            else next(iter(models.values()))  # type: ignore[union-attr]
        )
        self.models = Models(default, models)
        self.connect_timeout_s = connect_timeout_s
        self.timeout_s = timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.first_byte_timeout_s = first_byte_timeout_s  # streamed: the first token
        self.max_attempts = max_attempts
        self._complete: set[int] = set()  # requests whose whole answer was passed on
        self.max_body = max_body
        self.max_concurrent = max_concurrent  # 0: no limit
        self.body_timeout_s = body_timeout_s
        self._engine_auth = None if engine_api_key is None else f"Bearer {engine_api_key}"
        self.user_key = user_key  # the body's user is a request's key (without the header)
        # a request's prompt blocks, matched with the engines' caches (--prefix-tokens)
        self.prefix_blocks = prefix_blocks
        self.access_log, self.tracing = access_log, tracing
        self._recording = access_log is not None or tracing is not None  # a Record each
        self.inflight = 0
        self.draining = False
        self.metrics = GatewayMetrics(
            {d.name: d.router.core for d in self.models.deployments},
            inflight=lambda: self.inflight,
            by_deployment=models is not None,
            held=lambda: sum(
                d.router.admission.held for d in self.models.deployments if d.router.admission
            ),
        )
        for dep in self.models.deployments:  # streams stopped mid-way, counted per engine
            dep.streams.on_stall = self._stall_counter(dep)
            dep.router.core.shadow_probes = True  # probes are copies of requests (_probe)
        self.probes: set[asyncio.Task[None]] = set()  # probes under way
        self.upstream: Upstreams | None = None  # from start() on
        self._idle = asyncio.Event()
        self._idle.set()

    def _stall_counter(self, dep: Deployment) -> Callable[[str, bool], None]:
        """What counts an engine named stalled mid-stream (``StreamWatch.on_stall``)."""

        def counted(eid: str, ejected: bool) -> None:
            self.metrics.outcome(dep.label + eid, "stall")
            if ejected:
                self.metrics.ejections.labels(dep.label + eid).inc()

        return counted

    # -- engines and their URLs ----------------------------------------------------------------

    # the one deployment's (the first one's, with models): what one deployment had
    @property
    def router(self) -> AsyncRouter:
        return self.models.default.router

    @property
    def urls(self) -> dict[str, str]:
        return self.models.default.urls

    @property
    def static_urls(self) -> dict[str, str]:
        return self.models.default.static_urls

    @property
    def redis(self) -> Any:
        return self.models.default.redis

    async def refresh_urls(self) -> None:
        await self.models.default.refresh_urls()

    def live_engines(self) -> list[str]:
        """Engines of the (first) deployment's router that have a URL."""
        return self.models.default.live_engines()

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
        self,
        dep: Deployment,
        pin: str | None,
        avoid: set[str],
        key: str | None = None,
        tokens: int = 0,
        guessed: bool = False,
        blocks: tuple[int, ...] = (),
    ) -> Decision:
        """Route (or pin); an engine without a URL, or in ``avoid``, is swapped for the
        least-loaded engine that has one. Raises NoEngines / UnknownEngine."""
        router, urls = dep.router, dep.urls
        d = router.route(pin, key=key, prompt_tokens=tokens, key_guessed=guessed, blocks=blocks)
        if pin is not None and pin not in urls:
            _unroute(router, d)
            raise NoEngines(f"engine {pin!r} has no known URL (not registered, no --engine)")
        if pin is not None or (d.engine_id in urls and d.engine_id not in avoid):
            return d
        shadow, d.shadow = d.shadow, None  # (the probe goes with the request's new route)
        _unroute(router, d)  # no URL, or it failed this request already: another one
        loads = router.core.loads()
        ok = [e for e in loads if e in urls and e not in avoid]
        if not ok:
            if shadow is not None:
                _unroute(router, shadow)
            raise NoEngines("no engine with a known URL")
        d = router.route(min(ok, key=loads.__getitem__), prompt_tokens=tokens)
        d.pinned, d.shadow = False, shadow
        return d

    def upstream_auth(self, request: web.Request) -> dict[str, str]:
        """The Authorization header for an engine: the engine key when one is set,
        else the client's own."""
        auth = self._engine_auth or request.headers.get("Authorization")
        return {} if auth is None else {"Authorization": auth}

    def _begin(self) -> None:
        self.inflight += 1
        self._idle.clear()

    def _end(self) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self._idle.set()

    def _record(self, request: web.Request, rid: str) -> Record:
        """A request's Record (with its spans when tracing): only with an access log or
        tracing."""
        rec = Record(rid, request.method, request.path, request.remote)
        if self.tracing is not None:
            rec.spans = self.tracing.request(request.headers, request.method, request.path, rid)
        return rec

    def _ended(self, rec: Record, resp: web.StreamResponse | None) -> None:
        """The request's one access-log line and the end of its trace."""
        if resp is not None and not rec.status:
            rec.status = resp.status
        if not rec.status:  # the gateway's own fault: aiohttp answers 500
            rec.status, rec.kind, rec.error = 500, "internal", "internal"
        if rec.spans is not None:
            rec.spans.end(rec)
        if self.access_log is not None:
            self.access_log.write(rec)

    def refused(self, request: web.Request, resp: web.Response) -> None:
        """A request on a proxied path answered before the proxy (a 401): its request
        id in the answer and its access-log line (no trace: it is nobody's)."""
        if request.path not in PROXY_PATHS:
            return
        rid = request_id(request.headers.get(REQUEST_ID_HEADER))
        resp.headers[REQUEST_ID_HEADER] = rid
        if self.access_log is not None:
            rec = Record(rid, request.method, request.path, request.remote)
            rec.status = resp.status
            self.access_log.write(rec)

    async def _proxy(self, request: web.Request) -> web.StreamResponse:
        t0 = time.perf_counter()
        rid = request_id(request.headers.get(REQUEST_ID_HEADER))
        rec = self._record(request, rid) if self._recording else None
        resp: web.StreamResponse | None = None
        try:
            resp = await self._proxy_counted(request, t0, rid, rec)
            if not resp.prepared:  # (a stream's went out with its head)
                resp.headers[REQUEST_ID_HEADER] = rid
            return resp
        except Exception:  # the gateway's own fault: its traceback follows (guard.py)
            log.error("gateway: request %s: internal error", rid)
            raise
        finally:
            if rec is not None:
                self._ended(rec, resp)

    async def _proxy_counted(
        self, request: web.Request, t0: float, rid: str, rec: Record | None
    ) -> web.StreamResponse:
        path = request.path
        m = self.metrics
        if self.draining:
            m.answered(path, 503)
            if rec is not None:
                rec.error = "draining"
            return _json_error(
                503,
                "gateway is shutting down",
                "unavailable",
                **{"Retry-After": "1", "Connection": "close"},
            )
        if self.max_concurrent and self.inflight >= self.max_concurrent:
            m.answered(path, 429)
            m.errors.labels("overloaded").inc()
            return _json_error(
                429,
                f"the gateway is at its limit of {self.max_concurrent} concurrent requests",
                "rate_limit_error",
                **{"Retry-After": "1"},
            )
        self._begin()
        try:
            resp = await self._proxy_inner(request, t0, rid, rec)
            m.answered(path, resp.status)
            return resp
        except asyncio.CancelledError:
            if id(request) not in self._complete:  # (not once the answer was all sent)
                m.errors.labels("client_disconnect").inc()
                if rec is not None:
                    rec.gone()
            raise
        finally:
            self._complete.discard(id(request))
            self._end()

    async def _read_body(
        self, request: web.Request
    ) -> tuple[bytes, bool, dict[str, Any]] | web.Response:
        m = self.metrics
        if request.content_length is not None and request.content_length > self.max_body:
            m.errors.labels("too_large").inc()
            return _json_error(413, f"the body exceeds {self.max_body} bytes")
        try:
            # a body that came with its head needs no timer
            bound = None if request.content.is_eof() else self.body_timeout_s
            raw = await within(request.read(), bound)
        except web.HTTPRequestEntityTooLarge:
            m.errors.labels("too_large").inc()
            return _json_error(413, f"the body exceeds {self.max_body} bytes")
        except asyncio.TimeoutError:
            m.errors.labels("body_timeout").inc()
            return _json_error(
                408, f"the body did not arrive within {self.body_timeout_s:g}s", Connection="close"
            )
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

    async def _proxy_inner(
        self, request: web.Request, t0: float, rid: str, rec: Record | None
    ) -> web.StreamResponse:
        m = self.metrics
        got = await self._read_body(request)
        if isinstance(got, web.Response):
            return got
        raw, stream, body = got
        if rec is not None:
            model = body.get("model")
            rec.model, rec.stream = model if isinstance(model, str) else None, stream
        try:
            key, guessed, tokens = request_hints(
                body, request.headers.get(KEY_HEADER), self.user_key
            )
        except ValueError as exc:
            m.errors.labels("bad_request").inc()
            return _json_error(400, str(exc))
        dep = self.models.pick(body)
        if isinstance(dep, web.Response):
            m.errors.labels("bad_request").inc()
            return dep
        pin = self._pin(request)
        if isinstance(pin, web.Response):
            m.errors.labels("bad_request").inc()
            return pin
        blocks: tuple[int, ...] = ()
        hasher = self.prefix_blocks
        if hasher is not None and pin is None:
            view = dep.router.core.cache_view
            # learning, the whole prompt (up to --prefix-max-tokens) is hashed to be
            # learned; else only as deep as some engine holds, and nothing while none does
            learning = view.learning(dep.router.core.by_id)
            if learning or view.holders:
                walk = EVERY if learning else view.holders
                blocks = hasher(body, request.path == CHAT_PATH, walk)
        dep.budget.request()
        if pin is None and (held := await dep.router.admit()):  # every engine was full
            m.hold.observe(held)
            t0 += held  # (not the gateway's own added time)
            if rec is not None:
                adm = dep.router.admission
                rec.held(held, adm is not None and held >= adm.max_s)
        headers = {"Content-Type": "application/json", **self.upstream_auth(request)}
        headers[REQUEST_ID_HEADER] = rid  # (vLLM's request id)
        spans = rec.spans if rec is not None else None
        if spans is None:  # untraced here: the client's trace context goes on as it came
            for name in TRACE_HEADERS:
                if (value := request.headers.get(name)) is not None:
                    headers[name] = value
        # who accepted these credentials and model: a refusal of them is then the engine's
        accept = Acceptances.key(headers.get("Authorization"), body.get("model"))
        avoid: set[str] = set()
        last: Retry | None = None
        for attempt in range(1 if pin is not None else self.max_attempts):
            try:
                try:
                    d = self._route(dep, pin, avoid, key, tokens, guessed, blocks)
                except NoEngines:
                    core = dep.router.core
                    if dep.redis is None or all(e in dep.urls for e in core.by_id):
                        raise
                    await dep.refetch_urls()  # engines without a URL: it may be new
                    d = self._route(dep, pin, avoid, key, tokens, guessed, blocks)
            except UnknownEngine:
                m.errors.labels("bad_request").inc()
                live = sorted(dep.router.core.by_id, key=lambda e: (len(e), e))
                return _json_error(
                    400, f"no live engine {pin!r} to pin to; live engines: {', '.join(live)}"
                )
            except NoEngines as exc:
                if last is not None:
                    break
                m.errors.labels("no_engine").inc()
                return _json_error(503, str(exc), "unavailable", **{"Retry-After": "1"})
            if d.shadow is not None:
                self._send_probe(dep, d.shadow, body, headers, request.path, rid, accept)
                d.shadow = None
            m.decision(dep.label + d.engine_id)
            if d.cached:
                m.cache_route(d.cached * BLOCK_TOKENS)
            if attempt:
                m.retries.inc()
            headers[CLIENT_HEADER] = str(d.client_index)
            if rec is not None:
                rec.engine, rec.tries = d.engine_id, attempt + 1
                if spans is not None:
                    spans.attempt(route_facts(dep, d, attempt + 1, key, guessed), headers)
            last_try = (
                pin is not None
                or attempt + 1 >= self.max_attempts
                or not _elsewhere(dep, d.engine_id, avoid)
            )
            try:
                return await self._attempt(
                    request, dep, d, raw, headers, stream, t0, rid, rec, accept, last_try
                )
            except Retry as exc:
                last = exc
                avoid.add(d.engine_id)
                m.errors.labels(exc.kind).inc()
                again = not last_try
                # the budget keeps retries from adding load to a failing deployment; a
                # request no engine works on (refused, a stopped engine) adds none
                refused = again and not exc.unsent and not dep.budget.allow()
                if refused:
                    m.retries_refused.inc()
                    again = False
                if spans is not None:
                    spans.retry(d.engine_id, exc.kind, again, refused)
                log.info(
                    "gateway: request %s: engine %s failed (%s); %s",
                    rid,
                    d.engine_id,
                    exc.detail,
                    "retrying" if again else "giving up",
                )
                if not again:
                    break
        assert last is not None
        return _json_error(last.status, last.public, "upstream_error")

    def _send_probe(
        self,
        dep: Deployment,
        d: Decision,
        body: dict[str, Any],
        headers: Mapping[str, str],
        path: str,
        rid: str,
        accept: bytes,
    ) -> None:
        """Send the probe ``d`` of a probing engine in the background: a copy of the
        request (``body``) streamed, with its own request id and ``PROBE_HEADER``, and no
        trace context (it is nobody's request)."""
        url = dep.urls.get(d.engine_id)
        if url is None or self.upstream is None or self.draining:
            _unroute(dep.router, d)  # (the next request probes it)
            return
        copy = orjson.dumps({**body, "stream": True})  # (a first byte, then the flow)
        sent = {k: v for k, v in headers.items() if k not in TRACE_HEADERS}
        sent[REQUEST_ID_HEADER], sent[PROBE_HEADER] = rid + "-probe", "1"
        sent[CLIENT_HEADER] = str(d.client_index)
        probe = self._probe(dep, d, url + path, copy, sent, accept)
        task = asyncio.get_running_loop().create_task(probe)
        self.probes.add(task)
        task.add_done_callback(self.probes.discard)

    async def _probe(
        self,
        dep: Deployment,
        d: Decision,
        url: str,
        raw: bytes,
        headers: dict[str, str],
        accept: bytes,
    ) -> None:
        """A probe of a probing engine (``_send_probe``), judged as a request would be,
        its stream read to the end and dropped: it answers once the stream flowed to its
        end past the point where the engine's streams stalled (a short answer passes a
        mid-stream stall and proves nothing: ``unproven``); a failure ejects the engine
        again, for longer. Cancelled (the gateway closing): no evidence either way."""
        router, eid = dep.router, d.engine_id
        kind, detail, result = "client_disconnect", "", "cancelled"
        up: Response | None = None
        t_up = time.perf_counter()
        bound = router.first_byte_bound(eid)
        router.sent(d)
        try:
            async with asyncio.timeout(self.timeout_s):
                up = await self._connect(dep, d, url, raw, headers, bound)
                self._judge(dep, d, up, accept)
                if up.status >= 300:  # refused as the request would be: proves nothing
                    router.unproven(d)
                    kind = result = "rejected"
                    return
                await self._first_chunk(dep, d, up, bound, t_up, probe=True)
                t_first = time.perf_counter()
                flow = dep.streams.opened(d)
                try:
                    while await asyncio.wait_for(up.chunk(), self.idle_timeout_s) is not None:
                        dep.streams.chunk(flow)
                finally:
                    dep.streams.closed(flow)
                kind = "ok"
                result = self._probe_ended(dep, d, flow, t_first - t_up)
        except Retry as exc:
            kind, detail = exc.kind, exc.detail
        except TimeoutError:  # (the idle-read bound, or the whole-response one)
            gone = time.perf_counter() - t_up >= self.timeout_s
            kind = "timeout" if gone else "idle_timeout"
            detail = f"engine {eid}: probe stopped mid-stream"
        except UpstreamError as exc:
            kind, detail = "reset", f"engine {eid} failed mid-stream: {exc}"
        finally:
            if up is not None:
                up.close()
            if kind not in ("ok", "rejected", "client_disconnect"):
                result = kind
            self.metrics.probe(dep.label + eid, result)
            self._outcome(dep, d, kind, detail)

    @staticmethod
    def _probe_ended(dep: Deployment, d: Decision, flow: Stream, first_byte_s: float) -> str:
        """The stream of the probe ``d`` ended whole: it answers once it flowed to its end
        past where the engine's streams stalled (a short answer passes a mid-stream stall
        and proves nothing: unproven). Returns which."""
        if dep.streams.flowed(flow):
            dep.router.answered(d, first_byte_s)
            return "answered"
        dep.router.unproven(d)
        return "unproven"

    def _outcome(
        self,
        dep: Deployment,
        d: Decision,
        kind: str,
        detail: str = "",
        rec: Record | None = None,
        status: int | None = None,
    ) -> None:
        """Tell the router how the attempt of ``d`` ended, and count it per engine."""
        router, m = dep.router, self.metrics
        if rec is not None:
            rec.attempt_end(kind, detail, status)
        m.outcome(dep.label + d.engine_id, kind)
        if kind in ABANDONED:  # its connection was dropped: the engine aborts it
            m.abandon(dep.label + d.engine_id, kind)
        if kind in ("ok", "rejected", "client_disconnect"):
            router.finished(d)
            return
        if router.failed(d, detail, kind):
            m.ejections.labels(dep.label + d.engine_id).inc()
        if kind in REFUSAL_KINDS and d.engine_id not in dep.refusing:  # a refusal: said once
            dep.refusing.add(d.engine_id)
            log.warning(
                "gateway: engine %s%s refuses with %s what other engines accept (a wrong "
                "engine key, or a model missing there); avoided until it accepts again",
                dep.label,
                d.engine_id,
                kind,
            )

    async def _attempt(
        self,
        request: web.Request,
        dep: Deployment,
        d: Decision,
        raw: bytes,
        headers: dict[str, str],
        stream: bool,
        t0: float,
        rid: str = "",
        rec: Record | None = None,
        accept: bytes = b"",
        last_try: bool = False,
    ) -> web.StreamResponse:
        """One upstream try. Raises Retry only while nothing was sent to the client.
        ``accept`` stands for the request's credentials and model (``Acceptances``);
        ``last_try``: no engine is tried after this one (``_first_chunk``)."""
        assert self.upstream is not None
        router = dep.router
        eid = d.engine_id
        url = dep.urls[eid] + request.path
        kind = "client_disconnect"  # the outcome, unless set below
        detail = ""
        up: Response | None = None
        t_up = time.perf_counter()
        # streamed: a bound from what this engine usually takes to its first token;
        # whole answers come at the end, so only the whole-response timeout applies
        # to them; either way a silent engine's wait ends early (first_byte.py)
        bound = router.first_byte_bound(eid) if stream else self.timeout_s
        if stream:
            router.sent(d)  # an engine that leaves it waiting is passed over meanwhile
        try:
            up = await self._connect(dep, d, url, raw, headers, bound)
            self._judge(dep, d, up, accept)
            ctype = up.headers.get("content-type", "application/json")
            if not ctype.startswith("text/event-stream"):
                whole, kind = await self._whole(router, d, up, ctype, t0, t_up, rec)
                return whole
            streamed, kind, detail = await self._relay(
                request, dep, d, up, t0, t_up, bound, rid, rec, last_try
            )
            return streamed
        except Retry as exc:
            kind, detail = exc.kind, exc.detail
            raise
        finally:
            if up is not None:  # an answer not passed on whole drops its connection: the
                up.close()  # engine sees the client leave and aborts
            self._outcome(dep, d, kind, detail, rec, up.status if up is not None else None)

    async def _connect(
        self,
        dep: Deployment,
        d: Decision,
        url: str,
        raw: bytes,
        headers: dict[str, str],
        bound: float,
    ) -> Response:
        """Send the attempt of ``d`` and wait up to ``bound`` for its answer's head;
        Retry when none came (the engine's failure: its kind)."""
        assert self.upstream is not None
        eid = d.engine_id
        try:
            return await first_byte(
                self.upstream.request("POST", url, raw, headers), bound, dep.silence, eid
            )
        except UpstreamUnreachable as exc:
            _unroute(dep.router, d)  # it never got there: no route to take back later
            detail, public = f"engine {eid} unreachable: {exc}", f"engine {eid} unreachable"
            raise Retry("connect", detail, unsent=True, public=public) from None
        except UpstreamError as exc:
            public = f"engine {eid} failed: {type(exc).__name__}"
            raise Retry("reset", f"engine {eid} failed: {exc}", public=public) from None
        except asyncio.TimeoutError:
            detail = f"engine {eid}: no answer in {bound:.2f}s"
            raise Retry("first_byte_timeout", detail, 504) from None
        except Silent as exc:
            detail = f"engine {eid}: {exc}"
            raise Retry("first_byte_timeout", detail, 504, unsent=True) from None

    @staticmethod
    def _judge(dep: Deployment, d: Decision, up: Response, accept: bytes) -> None:
        """Retry when the answer's status says the engine did not serve it (a 5xx, a
        429, a refusal of what another engine accepted: ``accept``); note who accepted
        what."""
        eid = d.engine_id
        if up.status in RETRY_STATUSES:
            raise Retry(status_kind(up.status), f"engine {eid} answered {up.status}", up.status)
        if up.status < 300:
            dep.accepted.accepted(accept, eid)
            dep.refusing.discard(eid)
        elif up.status in REFUSAL_STATUSES and dep.accepted.elsewhere(accept, eid):
            # another engine took these credentials and model: this one is broken
            detail = f"engine {eid} answered {up.status} to what another engine accepted"
            public = f"engine {eid} answered {up.status}"
            raise Retry(str(up.status), detail, up.status, public=public)

    async def _first_chunk(
        self,
        dep: Deployment,
        d: Decision,
        up: Response,
        bound: float,
        t_up: float,
        last_try: bool = False,
        probe: bool = False,
    ) -> bytes:
        """A stream's first chunk, within ``bound`` of the attempt's start; Retry when
        none came. An engine that queues requests (``RouterCore.queues``) is waited for
        past the bound when the request could not go elsewhere: on its last try, or
        while the retry budget has no retry left. The request is most likely among
        those queued, and giving up failed it. Else another engine is tried, as for any
        late first byte: a request still queued costs the engine nothing to drop, and
        another engine's queue may be shorter (waiting there instead doubled the TTFT
        p99 of KV-bound Poisson). A ``probe`` is given up at the bound."""
        eid = d.engine_id
        left = max(0.001, bound - (time.perf_counter() - t_up))
        longest = self.first_byte_timeout_s - (time.perf_counter() - t_up)
        router, budget = dep.router, dep.budget

        def stay() -> bool:
            return router.queues(eid) and (last_try or not budget.room())

        queues = None if probe else stay
        try:
            return await first_byte(up.chunk(), left, dep.silence, eid, queues, longest) or b""
        except asyncio.TimeoutError:
            took = time.perf_counter() - t_up
            raise Retry(
                "first_byte_timeout", f"engine {eid}: no first token in {took:.2f}s", 504
            ) from None
        except Silent as exc:
            raise Retry("first_byte_timeout", f"engine {eid}: {exc}", 504, unsent=True) from None
        except UpstreamError as exc:
            raise Retry("reset", f"engine {eid} dropped before its first token: {exc}") from None

    async def _whole(
        self,
        router: AsyncRouter,
        d: Decision,
        up: Response,
        ctype: str,
        t0: float,
        t_up: float,
        rec: Record | None = None,
    ) -> tuple[web.Response, str]:
        """A non-streamed answer (or an error), passed on whole; returns (response,
        outcome kind)."""
        eid = d.engine_id
        try:
            body = await up.read(max(0.001, self.timeout_s - (time.perf_counter() - t_up)))
        except UpstreamError as exc:
            raise Retry("reset", f"engine {eid} dropped: {exc}") from None
        except asyncio.TimeoutError:  # the whole-response timeout: not worth another try
            self.metrics.errors.labels("timeout").inc()
            return _json_error(504, f"engine {eid} timed out", "timeout"), "timeout"
        t_done = time.perf_counter()
        if rec is not None:
            rec.tokens = usage_tokens(body)
        whole = web.Response(status=up.status, body=body)
        whole.headers["Content-Type"] = ctype
        whole.headers[ENGINE_HEADER] = eid
        self.metrics.observe_added(False, (t_up - t0) + (time.perf_counter() - t_done))
        if 400 <= up.status < 500:
            return whole, "rejected"  # the engine refused it: no evidence, no load
        router.answered(d, -1.0)  # (a whole answer is no first-byte time)
        return whole, "ok"

    async def _relay(
        self,
        request: web.Request,
        dep: Deployment,
        d: Decision,
        up: Response,
        t0: float,
        t_up: float,
        bound: float,
        rid: str = "",
        rec: Record | None = None,
        last_try: bool = False,
    ) -> tuple[web.StreamResponse, str, str]:
        """Pass an SSE stream through; returns (response, outcome kind, detail). Headers
        go out with the first chunk, so an engine that gives none within ``bound`` of
        the request (or drops first) is retried; after it, ``idle_timeout_s`` without a
        chunk ends the stream with an error event."""
        m, eid, router = self.metrics, d.engine_id, dep.router
        first = await self._first_chunk(dep, d, up, bound, t_up, last_try)
        t_first = time.perf_counter()
        # a probe is answered once its stream flowed to its end: an engine whose streams
        # stop mid-way still sends first chunks
        if not d.probe:
            router.answered(d, t_first - t_up)
        resp = web.StreamResponse(status=up.status)
        resp.headers["Content-Type"] = "text/event-stream"
        resp.headers["Cache-Control"] = "no-cache"
        resp.headers[ENGINE_HEADER] = eid
        if rid:
            resp.headers[REQUEST_ID_HEADER] = rid
        if rec is not None:
            rec.status = up.status
            rec.first_byte()
            rec.chunk(first)
        kind, detail = "ok", ""
        try:
            await resp.prepare(request)
            if first:
                await resp.write(first)
            m.observe_added(True, (t_up - t0) + (time.perf_counter() - t_first))
            idle = self.idle_timeout_s
            # (the whole-response timeout counts from this attempt, as in _whole)
            left = self.timeout_s - (time.perf_counter() - t_up)
            end = asyncio.get_running_loop().time() + left
            watch = ChunkWatch(idle, end, lambda: router.queues(eid))
            flow = dep.streams.opened(d)
            try:
                while True:
                    watch.wait()
                    try:
                        chunk = await up.chunk()
                    except asyncio.CancelledError:
                        if not watch.expired():
                            raise
                        gone = time.perf_counter() - t0 >= self.timeout_s
                        kind = "timeout" if gone else "idle_timeout"
                        detail = f"engine {eid}: no token for {watch.silent_s():.1f}s mid-stream"
                        break
                    except UpstreamError as exc:
                        kind, detail = "reset", f"engine {eid} failed mid-stream: {exc}"
                        break
                    watch.got()
                    if chunk is None:
                        break
                    dep.streams.chunk(flow)
                    if rec is not None:
                        rec.chunk(chunk)
                    await resp.write(chunk)
            finally:
                watch.close()
                dep.streams.closed(flow)
            if kind == "ok" and d.probe:
                self._probe_ended(dep, d, flow, t_first - t_up)
            if kind != "ok":
                m.errors.labels(kind).inc()
                err = {"error": {"message": detail, "type": "upstream_error", "code": 502}}
                await resp.write(b"data: " + orjson.dumps(err) + b"\n\n")
            self._complete.add(id(request))  # all passed on: a client leaving now left at the end
            with contextlib.suppress(ConnectionResetError):
                await resp.write_eof()
        except ConnectionResetError:  # the client went away mid-stream
            if id(request) not in self._complete:
                m.errors.labels("client_disconnect").inc()
                return resp, "client_disconnect", ""
        return resp, kind, detail
