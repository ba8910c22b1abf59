"""The gateway's app and lifecycle: the aiohttp application (the proxied paths from
redisbal.gateway.proxy, ``/v1/models``, ``/health``, ``/metrics``), start, drain, close."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from typing import Any

import orjson
from aiohttp import web

from redisbal.errors import UpstreamError
from redisbal.gateway.access import ApiKeys, Cors, auth_middleware
from redisbal.gateway.deployments import Deployment, model_entry
from redisbal.gateway.errors import json_error as _json_error
from redisbal.gateway.errors import unserved
from redisbal.gateway.guard import ConnectionGuard, GuardedRunner, Limits
from redisbal.gateway.metrics import CONTENT_TYPE
from redisbal.gateway.proxy import PROXY_PATHS, Proxy
from redisbal.gateway.upstream import Upstreams
from redisbal.routing.router import AsyncRouter

log = logging.getLogger("redisbal.gateway")


class Gateway(Proxy):
    """The proxy served. ``start()`` binds, ``drain()`` stops accepting and waits.
    ``api_keys``: a key is required on the ``/v1`` paths; ``cors``: browser pages of
    its origins may call it; ``limits``: what one connection may take; ``ssl``: TLS.
    Several deployments: ``models`` (model name -> Deployment) instead of ``router``."""

    def __init__(
        self,
        router: AsyncRouter | None = None,
        *,
        models_timeout_s: float = 2.0,
        api_keys: ApiKeys | None = None,
        cors: Cors | None = None,
        limits: Limits | None = None,
        ssl_context: ssl.SSLContext | None = None,
        **kw: Any,
    ) -> None:
        super().__init__(router, **kw)
        self.models_timeout_s = models_timeout_s
        self.api_keys, self.cors, self.ssl_context = api_keys, cors, ssl_context
        self.guard = ConnectionGuard(limits or Limits())
        self._models_body: dict[str, bytes] = {}  # each deployment's last engine answer
        self.runner: web.AppRunner | None = None
        self.sites: list[web.TCPSite] = []

    # -- lifecycle -----------------------------------------------------------------------------

    def app(self) -> web.Application:
        middlewares: list[Any] = []
        if self.cors is not None:  # before the key check: a preflight carries no key
            middlewares.append(self.cors.middleware())
        if self.api_keys is not None:
            middlewares.append(auth_middleware(self.api_keys, self.refused))
        app = web.Application(client_max_size=self.max_body, middlewares=middlewares)
        if self.cors is not None:
            app.on_response_prepare.append(self.cors.on_prepare)
        for path in PROXY_PATHS:
            app.router.add_post(path, self._proxy)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_route("*", "/{path:.*}", unserved)  # (last: what no route serves)
        return app

    async def start(self, host: str, port: int) -> None:
        self.upstream = Upstreams(self.connect_timeout_s)
        await asyncio.gather(*(d.start() for d in self.models.deployments))
        lim = self.guard.limits
        self.runner = GuardedRunner(
            self.app(),
            self.guard,
            handler_cancellation=True,
            access_log=None,
            keepalive_timeout=lim.keepalive_timeout_s,
            max_line_size=lim.max_line_size,
            max_field_size=lim.max_field_size,
            lingering_time=1.0,  # after an early answer, unread body is drained this long
            shutdown_timeout=0.2,  # after the drain: what is still running is cancelled
        )
        await self.runner.setup()
        site = web.TCPSite(self.runner, host, port, backlog=1024, ssl_context=self.ssl_context)
        await site.start()
        self.sites.append(site)

    @property
    def ports(self) -> list[int]:
        """The ports it listens on (none once draining: the sites are stopped)."""
        if self.runner is None:
            return []
        return [addr[1] for addr in self.runner.addresses]

    async def drain(self, timeout_s: float = 30.0) -> bool:
        """Stop accepting, wait up to ``timeout_s`` for in-flight requests; True if all
        ended. Requests arriving on kept-alive connections meanwhile get a 503."""
        self.draining = True
        sites, self.sites = self.sites, []
        for site in sites:  # closes the listening socket: new connections are refused;
            await site.stop()  # the connections open keep going until cleanup
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        return self.inflight == 0

    async def close(self) -> None:
        for task in list(self.probes):  # (their outcomes say nothing of the engines)
            task.cancel()
        await asyncio.gather(*self.probes, return_exceptions=True)
        for d in self.models.deployments:
            await d.close()
        if self.runner is not None:
            await self.runner.cleanup()
        if self.upstream is not None:
            self.upstream.close()
        if self.tracing is not None:  # what is left goes to the collector (a thread waits)
            await asyncio.to_thread(self.tracing.shutdown)

    # -- small endpoints -----------------------------------------------------------------------

    async def _health(self, request: web.Request) -> web.Response:
        """One deployment: ready when it can route. Several: ready when any can (a
        deployment without engines must not take the others' models out of service);
        each deployment's state under ``deployments``."""
        models = self.models
        if models.by_model is None:
            body = models.default.health()
            ready = body["ready"] = not self.draining and body["ready"]
            body = {"ready": ready, "draining": self.draining, **body}
        else:
            deps = {d.name: d.health() for d in models.deployments}
            ready = not self.draining and any(h["ready"] for h in deps.values())
            body = {
                "ready": ready,
                "draining": self.draining,
                "models": {m: d.name for m, d in models.by_model.items()},
                "deployments": deps,
            }
        return web.Response(
            status=200 if ready else 503, body=orjson.dumps(body), content_type="application/json"
        )

    async def _metrics(self, request: web.Request) -> web.Response:
        resp = web.Response(body=self.metrics.render())
        resp.headers["Content-Type"] = CONTENT_TYPE
        return resp

    async def _models(self, request: web.Request) -> web.Response:
        """One deployment: what its engines answer (the last answer seen when none
        does now, else a 503). Several: every configured model, each as its engines
        list it when they answer, else a plain entry."""
        headers = self.upstream_auth(request)
        by_model = self.models.by_model
        if by_model is None:
            body = await self._engine_models(self.models.default, headers)
            if body is None:
                return _json_error(
                    503, "no engine answered /v1/models", "unavailable", **{"Retry-After": "1"}
                )
            return web.Response(body=body, content_type="application/json")
        deps = self.models.deployments
        answers = await asyncio.gather(*(self._engine_models(d, headers) for d in deps))
        listed: dict[str, dict[str, Any]] = {}
        for raw in answers:
            with contextlib.suppress(Exception):
                for entry in orjson.loads(raw or b"{}").get("data") or ():
                    if isinstance(entry, dict) and isinstance(entry.get("id"), str):
                        listed.setdefault(entry["id"], entry)
        data = [listed.get(m) or model_entry(m) for m in by_model]
        return web.Response(
            body=orjson.dumps({"object": "list", "data": data}), content_type="application/json"
        )

    async def _engine_models(self, dep: Deployment, headers: dict[str, str]) -> bytes | None:
        """Ask the engines of ``dep`` the router would choose (the others after them)
        at once; the first that answers 200 within ``models_timeout_s`` wins, so a hung
        engine never holds it up. None: the last answer seen, else None."""
        assert self.upstream is not None
        excluded = dep.router.core.excluded()
        live = dep.live_engines()
        order = [e for e in live if e not in excluded] + [e for e in live if e in excluded]
        upstream, urls = self.upstream, dep.urls

        async def ask(eid: str) -> bytes:
            up = await upstream.request("GET", urls[eid] + "/v1/models", headers=headers)
            try:
                body = await up.read()
            finally:
                up.close()
            if up.status != 200:
                raise UpstreamError(f"GET /v1/models answered {up.status}")
            return body

        tasks = [asyncio.ensure_future(ask(e)) for e in order[:8]]
        try:
            for next_done in asyncio.as_completed(tasks, timeout=self.models_timeout_s):
                with contextlib.suppress(Exception):
                    body = await next_done
                    self._models_body[dep.name] = body
                    return body
        except asyncio.TimeoutError:
            pass
        finally:
            for t in tasks:
                t.cancel()
        return self._models_body.get(dep.name)
