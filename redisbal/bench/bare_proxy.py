"""The floor under the gateway's overhead: aiohttp passing requests to one engine and
nothing else (no routing, Redis, metrics, retries, timeouts or checks).

scripts/gateway_overhead.py ``--bare`` runs it beside the gateway, on the same event
loop kind, so that what the gateway costs splits into what aiohttp costs to carry a
request and what redisbal adds on top. Not a product: it trusts its one upstream.

    python -m redisbal.bench.bare_proxy --port 8400 --upstream http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import asyncio

import aiohttp
from aiohttp import web

# hop-by-hop and framing headers the proxy does not pass on (aiohttp sets its own)
_DROP = {"content-length", "transfer-encoding", "connection", "host"}
SESSION = web.AppKey("session", aiohttp.ClientSession)


def make_app(upstream: str) -> web.Application:
    """A web app that sends every POST to ``upstream`` (same path) and streams the answer."""
    app = web.Application()

    async def start(app: web.Application) -> None:
        conn = aiohttp.TCPConnector(limit=0)
        app[SESSION] = aiohttp.ClientSession(connector=conn, auto_decompress=False)

    async def stop(app: web.Application) -> None:
        await app[SESSION].close()

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def forward(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
        async with app[SESSION].post(upstream + request.path, data=body, headers=headers) as up:
            resp = web.StreamResponse(status=up.status)
            resp.headers.update({k: v for k, v in up.headers.items() if k.lower() not in _DROP})
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
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
