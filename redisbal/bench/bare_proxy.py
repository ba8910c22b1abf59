"""The floor under the gateway's overhead: its HTTP parts (aiohttp's server, the
gateway's own client to engines) passing requests to one engine and nothing else (no
routing, Redis, metrics, retries, timeouts or checks).

scripts/gateway_overhead.py ``--bare`` runs it beside the gateway, on the same event
loop kind, so that what the gateway costs splits into what carrying a request costs
and what redisbal adds on top. Not a product: it trusts its one upstream.

    python -m redisbal.bench.bare_proxy --port 8400 --upstream http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib

from aiohttp import web

from redisbal.gateway.upstream import Upstreams

UPSTREAMS = web.AppKey("upstreams", Upstreams)


def make_app(upstream: str) -> web.Application:
    """A web app that sends every POST to ``upstream`` (same path) and passes the
    answer on: whole, or chunk by chunk when it is a stream."""
    app = web.Application()

    async def start(app: web.Application) -> None:
        app[UPSTREAMS] = Upstreams()

    async def stop(app: web.Application) -> None:
        app[UPSTREAMS].close()

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def forward(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        ctype = request.headers.get("Content-Type", "application/json")
        up = await app[UPSTREAMS].request(
            "POST", upstream + request.path, body, {"Content-Type": ctype}
        )
        answer_type = up.headers.get("content-type", "application/json")
        if not answer_type.startswith("text/event-stream"):
            whole = web.Response(status=up.status, body=await up.read())
            whole.headers["Content-Type"] = answer_type
            return whole
        resp = web.StreamResponse(status=up.status)
        resp.headers["Content-Type"] = answer_type
        await resp.prepare(request)
        while (chunk := await up.chunk()) is not None:
            await resp.write(chunk)
        with contextlib.suppress(ConnectionResetError):  # (a client gone at the end, as the
            await resp.write_eof()  # gateway takes it: no traceback logged for each)
        return resp

    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    app.router.add_get("/health", health)
    app.router.add_post("/{tail:.*}", forward)
    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--upstream", required=True, help="the engine's base URL")
    ap.add_argument("--event-loop", choices=["uvloop", "asyncio"], default="asyncio")
    a = ap.parse_args()
    if a.event_loop == "uvloop":
        import uvloop  # type: ignore[import-not-found, unused-ignore]  # the gateway extra's

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    web.run_app(make_app(a.upstream.rstrip("/")), host="127.0.0.1", port=a.port, print=None)


if __name__ == "__main__":
    main()
