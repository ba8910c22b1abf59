"""The gateway's client to its engines (redisbal.gateway.upstream), against real servers
on real sockets: asyncio servers that answer exactly as each case needs (kept alive,
chunked, cut off, malformed, closing as a connection is reused), and TLS."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from support.topology import make_certs

from redisbal.gateway import upstream
from redisbal.gateway.upstream import UpstreamError, Upstreams, UpstreamUnreachable

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@asynccontextmanager
async def serving(handler: Handler, tls: ssl.SSLContext | None = None) -> AsyncIterator[str]:
    """A server on a free port running ``handler`` per connection; its base URL."""
    server = await asyncio.start_server(handler, "127.0.0.1", 0, ssl=tls)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"{'https' if tls else 'http'}://127.0.0.1:{port}"
    finally:
        server.close()


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, dict[bytes, bytes], bytes]:
    """One request off the connection: its request line, headers, body."""
    head = await reader.readuntil(b"\r\n\r\n")
    line, *rest = head[:-4].split(b"\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (h.split(b":", 1) for h in rest)}
    body = await reader.readexactly(int(headers.get(b"content-length", b"0")))
    return line, headers, body


def whole(body: bytes, status: str = "200 OK") -> bytes:
    return b"HTTP/1.1 %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
        status.encode(),
        len(body),
        body,
    )


async def test_requests_reuse_one_kept_alive_connection_and_carry_body_and_headers() -> None:
    connections: list[int] = []
    seen: list[tuple[bytes, dict[bytes, bytes], bytes]] = []

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        connections.append(1)
        while not r.at_eof():
            try:
                seen.append(await read_request(r))
            except asyncio.IncompleteReadError:
                break
            w.write(whole(b'{"n": %d}' % len(seen)))

    ups = Upstreams()
    async with serving(handler) as url:
        for n in (1, 2, 3):
            resp = await ups.request("POST", url + "/v1/completions", b'{"a":1}', {"X-K": "v"})
            assert (resp.status, resp.headers["content-type"]) == (200, "application/json")
            assert await resp.read() == b'{"n": %d}' % n
            resp.close()  # after the end: a no-op, the connection stays pooled
    ups.close()
    assert len(connections) == 1
    line, headers, body = seen[0]
    assert line == b"POST /v1/completions HTTP/1.1" and body == b'{"a":1}'
    assert headers[b"x-k"] == b"v" and headers[b"host"] == url.split("//")[1].encode()


async def test_a_chunked_stream_comes_chunk_by_chunk_as_the_engine_sends_it() -> None:
    go_on = asyncio.Event()

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n")
        w.write(b"Transfer-Encoding: chunked\r\n\r\n7\r\ndata: 1\r\n")
        await go_on.wait()  # the second chunk only once the first was read
        w.write(b"7\r\ndata: 2\r\n0\r\n\r\n")

    ups = Upstreams()
    async with serving(handler) as url:
        resp = await ups.request("POST", url + "/v1/completions", b"{}")
        assert await resp.chunk() == b"data: 1"
        go_on.set()
        assert await resp.chunk() == b"data: 2"
        assert await resp.chunk() is None
    ups.close()


async def test_a_body_not_all_in_within_its_time_times_out_and_one_all_in_is_read() -> None:
    stall = asyncio.Event()

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(whole(b'{"a": 1}'))  # all at once
        await read_request(r)
        w.write(b'HTTP/1.1 200 OK\r\nContent-Length: 20\r\n\r\n{"partial')  # then nothing
        await stall.wait()

    ups = Upstreams()
    async with serving(handler) as url:
        resp = await ups.request("POST", url + "/v1/completions", b"{}")
        assert await resp.read(0.2) == b'{"a": 1}'
        resp = await ups.request("POST", url + "/v1/completions", b"{}")
        with pytest.raises(asyncio.TimeoutError):
            await resp.read(0.2)
        resp.close()
        stall.set()
    ups.close()


async def test_an_answer_cut_off_mid_body_raises_and_an_unreachable_engine_is_named() -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly part")
        await w.drain()
        w.close()

    ups = Upstreams()
    async with serving(handler) as url:
        resp = await ups.request("POST", url + "/x", b"{}")
        with pytest.raises(UpstreamError, match="closed the connection mid-answer"):
            await resp.read()
    port = url.rsplit(":", 1)[1]  # the server is gone: nothing listens there now
    with pytest.raises(UpstreamUnreachable, match=f"127.0.0.1:{port}"):
        await ups.request("POST", url + "/x", b"{}")
    ups.close()


async def test_a_malformed_answer_raises_and_a_body_until_close_is_read_whole() -> None:
    answers = iter([b"NOT HTTP AT ALL\r\n\r\n", b"HTTP/1.1 200 OK\r\n\r\nto the end"])

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(next(answers))
        await w.drain()
        w.close()

    ups = Upstreams()
    async with serving(handler) as url:
        with pytest.raises(UpstreamError, match="malformed"):
            await ups.request("POST", url + "/x", b"{}")
        resp = await ups.request("POST", url + "/x", b"{}")
        assert await resp.read() == b"to the end"  # no length: the body ends with the connection
    ups.close()


async def test_closing_before_the_end_drops_the_connection_so_the_engine_sees_the_client_go() -> (
    None
):
    left = asyncio.Event()

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await w.drain()
        assert await r.read() == b""  # EOF: the client went
        left.set()

    ups = Upstreams()
    async with serving(handler) as url:
        resp = await ups.request("POST", url + "/x", b"{}")
        assert await resp.chunk() == b"hello"
        resp.close()
        await asyncio.wait_for(left.wait(), 10)
    ups.close()


async def test_a_kept_alive_connection_closed_as_it_is_reused_is_retried_on_a_new_one() -> None:
    """An engine that closes an idle connection just as a request is written on it
    (its keep-alive timeout, a restart): nothing came back, so the request goes again
    on a new connection, and the caller never sees it."""
    conns = 0

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        nonlocal conns
        conns += 1
        await read_request(r)
        w.write(whole(b"first" if conns == 1 else b"again"))
        await w.drain()
        if conns == 1:  # the next request on this connection: read, then closed unanswered
            await read_request(r)
            w.close()

    ups = Upstreams()
    async with serving(handler) as url:
        assert await (await ups.request("POST", url + "/x", b"{}")).read() == b"first"
        assert await (await ups.request("POST", url + "/x", b"{}")).read() == b"again"
    ups.close()
    assert conns == 2


async def test_a_slow_reader_pauses_the_engine_and_still_gets_every_byte() -> None:
    big = bytes(range(256)) * 8192  # 2 MiB: far over the high-water mark

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(big))
        for i in range(0, len(big), 65536):
            w.write(big[i : i + 65536])
            await w.drain()

    ups = Upstreams()
    async with serving(handler) as url:
        resp = await ups.request("POST", url + "/x", b"{}")
        got = bytearray()
        while (part := await resp.chunk()) is not None:
            assert len(part) < upstream.HIGH_WATER + 65536 * 2  # bounded by the pause
            got += part
            await asyncio.sleep(0.001)
        assert bytes(got) == big
    ups.close()


async def test_line_breaks_in_a_header_are_refused_before_anything_is_sent() -> None:
    ups = Upstreams()
    with pytest.raises(ValueError, match="line break"):
        await ups.request("POST", "http://127.0.0.1:9/x", b"{}", {"X": "a\r\nEvil: 1"})
    ups.close()


async def test_https_engines_are_verified_against_the_given_authority(tmp_path: Path) -> None:
    certs = make_certs(tmp_path)
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(certs.server_cert, certs.server_key)

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        with pytest.raises((asyncio.IncompleteReadError, ConnectionError, ssl.SSLError)):
            await read_request(r)
            w.write(whole(b"over tls"))
            await w.drain()
            await r.readuntil(b"\r\n\r\n")  # the next (there is none): the client closes

    async with serving(handler, server_tls) as url:
        trusted = Upstreams(ssl_context=ssl.create_default_context(cafile=certs.ca))
        assert await (await trusted.request("POST", url + "/x", b"{}")).read() == b"over tls"
        trusted.close()
        untrusted = Upstreams()  # the system's authorities do not know this one
        with pytest.raises(UpstreamUnreachable, match="CERTIFICATE_VERIFY_FAILED"):
            await untrusted.request("POST", url + "/x", b"{}")
        untrusted.close()
