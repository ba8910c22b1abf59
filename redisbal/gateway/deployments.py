"""The deployments behind one gateway, and which one a request goes to.

A ``Deployment`` is one deployment's routing state in the gateway: its own
``AsyncRouter`` (snapshot feed, client-index lease), its own Redis client for the
engines' URLs and its own URL table, refreshed by its own task, and its own retry
budget. Nothing is shared between two of them but the HTTP session, so one
deployment's Redis being slow or away never holds up another's routing.

``Models`` picks the deployment of a request by its body's ``model`` when models
are configured (``redisbal gateway --model NAME=DEPLOYMENT``); without them, the
one deployment takes every request, whatever its model."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from redisbal import endpoints
from redisbal.background import cancel_and_wait
from redisbal.gateway.errors import json_error
from redisbal.gateway.first_byte import SilenceWatch
from redisbal.gateway.options import MAX_MODEL_LEN
from redisbal.gateway.retry import Acceptances, RetryBudget
from redisbal.gateway.stream_watch import StreamWatch
from redisbal.routing.router import AsyncRouter

log = logging.getLogger("redisbal.gateway")


class Deployment:
    """One deployment's router, engine URLs (from Redis every ``refresh_s``, and the
    static ``--engine`` ones) and retry budget."""

    def __init__(
        self,
        router: AsyncRouter,
        *,
        redis_client: Any = None,
        static_urls: Mapping[str, str] | None = None,
        refresh_s: float = 1.0,
        retry_budget: float = 0.2,
    ) -> None:
        self.router = router
        self.name = router.keys.deployment
        self.redis = redis_client
        self.static_urls = dict(static_urls or {})
        self.urls: dict[str, str] = dict(self.static_urls)
        self.refresh_s = refresh_s
        self.budget = RetryBudget(retry_budget)
        self.accepted = Acceptances()  # who accepted which credentials and model (refusals)
        self.refusing: set[str] = set()  # engines logged as refusing, until they accept
        self.streams = StreamWatch(router)  # its open streams: those stopping mid-way
        # its engines gone silent (for longer than each one's reports pause, and than
        # its steps take), for waits
        self.silence = SilenceWatch(router.silent_s, self.streams.silent_after_s)
        self.label = ""  # before its engine ids in metrics: "<name>/" with several
        self._refresher: asyncio.Task[None] | None = None
        self._refetch: asyncio.Task[None] | None = None  # one re-read for many requests

    async def start(self) -> None:
        with contextlib.suppress(Exception):
            await self.refresh_urls()
        self._refresher = asyncio.get_running_loop().create_task(self._refresh_loop())

    async def close(self) -> None:
        await cancel_and_wait(self._refresher)
        await cancel_and_wait(self._refetch)
        self.streams.close()

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
                log.debug("gateway: url refresh of %s failed: %s", self.name, exc)

    async def refetch_urls(self) -> None:
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

    def health(self) -> dict[str, Any]:
        """Whether it can route (a live engine with a URL, engines known), and why."""
        core = self.router.core
        live = self.live_engines()
        known = core.snapshot is not None or bool(core.engines)
        return {
            "ready": bool(live) and known,
            "snapshot_version": core.snapshot.version if core.snapshot else None,
            "degraded": core.degraded,
            "engines": live,
            "client_index": core.client_index,
            "client_count": core.client_count,
        }


def model_entry(name: str) -> dict[str, Any]:
    """A model as OpenAI's ``/v1/models`` lists it."""
    return {"id": name, "object": "model", "created": 0, "owned_by": "redisbal"}


class Models:
    """Which deployment a request goes to. ``by_model`` (model name -> deployment;
    several names may share one) routes by the body's ``model`` and answers an unknown
    one with OpenAI's 404; ``None``: ``default`` takes every request."""

    def __init__(self, default: Deployment, by_model: Mapping[str, Deployment] | None = None):
        self.default = default
        self.by_model = dict(by_model) if by_model else None
        deps: dict[str, Deployment] = {default.name: default}
        for d in (by_model or {}).values():
            deps.setdefault(d.name, d)
        self.deployments = list(deps.values())  # each once, the default first
        if by_model is not None:  # engine ids may repeat across deployments
            for d in self.deployments:
                d.label = d.streams.label = f"{d.name}/"

    def pick(self, body: Mapping[str, Any]) -> Deployment | web.Response:
        """The request's deployment, or the error answer (nothing is routed)."""
        if self.by_model is None:
            return self.default
        model = body.get("model")
        if not isinstance(model, str):
            return json_error(
                400,
                f"you must provide a model parameter (one of: {', '.join(sorted(self.by_model))})",
                param="model",
            )
        dep = self.by_model.get(model)
        if dep is None:
            return json_error(
                404,
                f"The model `{model[:MAX_MODEL_LEN]}` does not exist.",
                code="model_not_found",
                param="model",
            )
        return dep
