"""The fault benchmark's counting relay: every request through it counted once, bytes
passed on untouched, a closed side closes the other (real sockets, a real server)."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import aiohttp
from aiohttp import web

from redisbal.bench.tap import RequestCounter, Tap, read_count


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_the_tap_counts_each_request_and_relays_answers(tmp_path: Path) -> None:
    async def completions(request: web.Request) -> web.Response:
        return web.json_response({"echo": await request.json()})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    count_file = str(tmp_path / "count")
    tap, tap_port = Tap("127.0.0.1", port, count_file), free_port()
    serving = asyncio.ensure_future(tap.serve(tap_port))
    try:
        await asyncio.sleep(0.1)
        url = f"http://127.0.0.1:{tap_port}/v1/completions"
        async with aiohttp.ClientSession() as s:  # one keep-alive connection, 5 requests
            for i in range(5):
                async with s.post(url, json={"prompt": f"POST /v1/ {i}"}) as r:
                    assert (await r.json())["echo"]["prompt"] == f"POST /v1/ {i}"
        # a request line split over two writes is still one request
        reader, writer = await asyncio.open_connection("127.0.0.1", tap_port)
        body = b'{"prompt": "a"}'
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        writer.write(head[:6])
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(head[6:] + b"Content-Length: %d\r\n\r\n" % len(body) + body)
        await writer.drain()
        assert b"200 OK" in await reader.readline()
        writer.close()
        for _ in range(50):
            if read_count(count_file) == 6:
                break
            await asyncio.sleep(0.05)
        # (the prompts' own "POST /v1/" are bodies, not requests)
        assert tap.requests == 6 and read_count(count_file) == 6
    finally:
        serving.cancel()
        await runner.cleanup()


def test_read_count_is_zero_before_the_first_write(tmp_path: Path) -> None:
    assert read_count(str(tmp_path / "none")) == 0


def test_the_counter_skips_bodies_by_length_and_chunked_fed_byte_by_byte() -> None:
    body = b"POST /v1/completions HTTP/1.1\r\n\r\n"  # a body that looks like a request
    stream = (
        b"POST /v1/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % len(body) + body
        + b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
        + b"POST /v1/chat/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n"
        + b"POST /v1/completions HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}"
    )  # fmt: skip
    whole, piecewise = RequestCounter(), RequestCounter()
    whole.feed(stream)
    for i in range(len(stream)):
        piecewise.feed(stream[i : i + 1])
    assert whole.requests == piecewise.requests == 3
