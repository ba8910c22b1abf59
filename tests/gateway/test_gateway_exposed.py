"""The gateway exposed beyond this machine, in the test's loop: API keys (the openai
client), the engines' key, error JSON for every error the gateway makes (its own HTTP
parsing errors too, through raw sockets), CORS, TLS, and the limits of connections
and requests (slow and silent clients as raw sockets)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import subprocess
from collections.abc import AsyncIterator
from typing import Any

import openai
import orjson
import pytest
from support.gateway_stack import MODEL, openai_client, settled, stack, start_gateway, stop_gateway
from support.helpers import await_until
from support.procs import free_port_block

from redisbal.gateway.access import ApiKeys, Cors, server_ssl
from redisbal.gateway.guard import Limits
from redisbal.sim.http_engine import HttpEngine

pytestmark = pytest.mark.gateway  # .ci/run runs these on the lowest aiohttp too

KEY = "sk-test-0123456789"


async def _raw(port: int, data: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send ``data`` (with ``Connection: close`` unless it names a connection header:
    the answer is read to the end); the answer's status, headers and body."""
    line, sep, rest = data.partition(b"\r\n")
    if sep and b"\r\nconnection:" not in (b"\r\n" + rest.split(b"\r\n\r\n")[0]).lower():
        data = line + b"\r\nConnection: close" + sep + rest
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), 30)
    finally:
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for ln in lines[1:]:
        k, _, v = ln.partition(":")
        headers[k.strip().lower()] = v.strip()
    return int(lines[0].split()[1]), headers, body


def _post_head(path: str, body_len: int, extra: str = "") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {body_len}\r\nConnection: close\r\n{extra}\r\n"
    ).encode()


def _error_of(body: bytes) -> dict[str, Any]:
    err = orjson.loads(body)["error"]
    assert set(err) >= {"message", "type", "code"}, err
    return err  # type: ignore[no-any-return]


# -- API keys --------------------------------------------------------------------------------


async def test_api_keys_on_v1_only_and_401_as_openai_json(redis_url: str, deployment: str) -> None:
    keys = ApiKeys([KEY, "second-key"])
    async with stack(redis_url, deployment, api_keys=keys) as st:
        port = st.gateways[0].ports[0]
        for key in ("none", KEY + "x", KEY[:-1]):
            c = openai_client(st.url, key)
            try:
                with pytest.raises(openai.AuthenticationError) as e:
                    await c.completions.create(model=MODEL, prompt="a", max_tokens=2)
                assert e.value.code == "invalid_api_key"
                with pytest.raises(openai.AuthenticationError):
                    await c.models.list()
            finally:
                await c.close()
        status, headers, body = await _raw(port, _post_head("/v1/completions", 2) + b"{}")
        assert status == 401 and headers["www-authenticate"] == "Bearer"
        assert _error_of(body)["code"] == "invalid_api_key"
        for key in (KEY, "second-key"):
            c = openai_client(st.url, key)
            try:
                got = await c.completions.create(model=MODEL, prompt="a", max_tokens=2)
                assert got.choices[0].text
                assert [m.id async for m in c.models.list()] == [MODEL]
            finally:
                await c.close()
        for path in ("/health", "/metrics"):
            status, _, _ = await _raw(port, f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            assert status == 200
        await settled(st)


async def test_engine_key_replaces_the_clients_and_the_clients_is_forwarded(
    redis_url: str, deployment: str
) -> None:
    eng = HttpEngine("0", redis_url=redis_url, deployment=deployment, port=0, api_key="eng-key")
    await eng.start()
    gws = []
    try:
        gws.append(await start_gateway(redis_url, deployment, api_keys=ApiKeys([KEY]),
                                       engine_api_key="eng-key"))  # fmt: skip
        gws.append(await start_gateway(redis_url, deployment, client_index=1))  # no keys
        await await_until(lambda: all(g.live_engines() for g in gws))
        # the gateway's key from the client, the engine's key to the engine
        c = openai_client(f"http://127.0.0.1:{gws[0].ports[0]}", KEY)
        try:
            assert [m.id async for m in c.models.list()] == [MODEL]
            got = await c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
            assert got.choices[0].message.content
        finally:
            await c.close()
        # no engine key set: the client's goes through, a wrong one gets the engine's 401
        base = f"http://127.0.0.1:{gws[1].ports[0]}"
        c = openai_client(base, "eng-key")
        try:
            assert [m.id async for m in c.models.list()] == [MODEL]
            assert (await c.completions.create(model=MODEL, prompt="a", max_tokens=2)).choices
        finally:
            await c.close()
        c = openai_client(base, "wrong")
        try:
            with pytest.raises(openai.AuthenticationError):
                await c.completions.create(model=MODEL, prompt="a", max_tokens=2)
        finally:
            await c.close()
    finally:
        for g in gws:
            await stop_gateway(g)
        await eng.stop()


def test_keys_compare_by_value_only() -> None:
    keys = ApiKeys(["abc", "dé"])
    assert keys.allows("Bearer abc") and keys.allows("bearer  dé ") and keys.allows("Bearer dé")
    for bad in (None, "", "abc", "Basic abc", "Bearer ab", "Bearer abcd", "Bearer \udcff"):
        assert not keys.allows(bad)
    with pytest.raises(ValueError):
        ApiKeys([])


# -- errors as JSON --------------------------------------------------------------------------


async def test_malformed_requests_get_json_400_and_no_traceback(
    redis_url: str, deployment: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    async with stack(redis_url, deployment, n=1) as st:
        port = st.gateways[0].ports[0]
        body = b'{"prompt": "a", "max_tokens": 2}'
        bad = [
            # a byte that is not UTF-8 in the session key
            _post_head("/v1/completions", len(body)).replace(
                b"Host", b"X-Redisbal-Key: a\xff\r\nHost"
            )
            + body,
            b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n",
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: zz\r\n\r\n",
            b"GET /he\x00alth HTTP/1.1\r\nHost: x\r\n\r\n",
            b"NOT HTTP AT ALL\r\n\r\n",
        ]
        for data in bad:
            caplog.clear()
            status, headers, out = await _raw(port, data)
            assert status == 400, (data[:60], status, out)
            assert headers["content-type"].startswith("application/json"), out
            assert _error_of(out)["type"] == "invalid_request_error"
            assert not [r for r in caplog.records if r.exc_info], caplog.text
        await settled(st)


async def test_a_dead_pinned_engine_502_names_no_address(
    redis_url: str, deployment: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    async with stack(redis_url, deployment, n=2, refresh_s=3600) as st:
        gw = st.gateways[0]
        address = f"127.0.0.1:{free_port_block(1)}"  # nothing listens there
        gw.urls["1"] = gw.static_urls["1"] = f"http://{address}"
        port = gw.ports[0]
        body = b'{"prompt": "a", "max_tokens": 2}'
        status, _, out = await _raw(
            port, _post_head("/v1/completions", len(body), "X-Redisbal-Engine: 1\r\n") + body
        )
        assert status == 502
        msg = _error_of(out)["message"]
        assert "engine 1 unreachable" in msg and address not in out.decode(), msg
        assert address in caplog.text  # the address is in the log


# -- limits ----------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def _held_uploads(port: int, n: int) -> AsyncIterator[list[Any]]:
    """``n`` requests whose body never all arrives."""
    conns = [await asyncio.open_connection("127.0.0.1", port) for _ in range(n)]
    try:
        for _, w in conns:
            w.write(_post_head("/v1/completions", 100) + b'{"prompt":')
            await w.drain()
        yield conns
    finally:
        for _, w in conns:
            w.close()


async def test_max_concurrent_requests_429_with_retry_after(
    redis_url: str, deployment: str
) -> None:
    async with stack(redis_url, deployment, n=1, max_concurrent=2, body_timeout_s=600) as st:
        gw = st.gateways[0]
        async with _held_uploads(gw.ports[0], 2):
            await await_until(lambda: gw.inflight == 2)
            c = openai_client(st.url, KEY)
            try:
                with pytest.raises(openai.RateLimitError) as e:
                    await c.completions.create(model=MODEL, prompt="a", max_tokens=2)
                assert e.value.response.headers["Retry-After"] == "1"
            finally:
                await c.close()
        await await_until(lambda: gw.inflight == 0)
        c = openai_client(st.url, KEY)
        try:
            assert (await c.completions.create(model=MODEL, prompt="a", max_tokens=2)).choices
        finally:
            await c.close()
        await settled(st)


async def test_slow_body_408_slow_head_and_idle_connections_closed(
    redis_url: str, deployment: str
) -> None:
    limits = Limits(header_timeout_s=0.5, keepalive_timeout_s=0.5)
    async with stack(redis_url, deployment, n=1, limits=limits, body_timeout_s=0.5) as st:
        gw = st.gateways[0]
        port = gw.ports[0]
        async with _held_uploads(port, 1) as [(reader, _)]:
            raw = await asyncio.wait_for(reader.read(), 30)
            assert raw.startswith(b"HTTP/1.1 408"), raw
            assert _error_of(raw.partition(b"\r\n\r\n")[2])["code"] == 408
        # a head one byte at a time (slowloris), and a connection that says nothing
        slow = await asyncio.open_connection("127.0.0.1", port)
        silent = await asyncio.open_connection("127.0.0.1", port)
        head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100
        closed = False
        for ch in head:
            try:
                slow[1].write(bytes([ch]))
                await slow[1].drain()
            except ConnectionError:
                closed = True
                break
            with contextlib.suppress(asyncio.TimeoutError):
                if await asyncio.wait_for(slow[0].read(1), 0.1) == b"":
                    closed = True
                    break
        assert closed, "a head sent one byte at a time was not cut"
        assert await asyncio.wait_for(silent[0].read(), 30) == b""
        for _, w in (slow, silent):
            w.close()
        # the slow head is cut by the guard; the silent connection by the guard's or
        # aiohttp's own keep-alive timer, whichever fires first
        assert gw.guard.closed["header_timeout"] >= 1
        await settled(st)


async def test_a_connection_in_use_outlives_its_first_keep_alive_bound(
    redis_url: str, deployment: str
) -> None:
    """The guard's keep-alive timer is set once and re-armed when it fires on a
    connection that was busy since: requests every 0.3 s for longer than the bound
    keep one connection open, and it closes once it stays silent for the bound."""
    limits = Limits(header_timeout_s=1.5, keepalive_timeout_s=1.5)
    async with stack(redis_url, deployment, n=1, limits=limits) as st:
        gw = st.gateways[0]
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.ports[0])
        try:
            for _ in range(12):  # 3.6 s and more: past the bound twice
                writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
                assert head.startswith(b"HTTP/1.1 200"), head
                length = next(
                    int(line.split(b":", 1)[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                await reader.readexactly(length)
                await asyncio.sleep(0.3)
            assert gw.guard.closed["header_timeout"] == 0
            assert await asyncio.wait_for(reader.read(), 30) == b""  # silent: closed
        finally:
            writer.close()
        await settled(st)


async def test_past_the_connection_cap_idle_ones_go_and_requests_are_served(
    redis_url: str, deployment: str
) -> None:
    limits = Limits(header_timeout_s=600, keepalive_timeout_s=600, max_connections=20)
    async with stack(redis_url, deployment, n=1, limits=limits) as st:
        gw = st.gateways[0]
        silent = [await asyncio.open_connection("127.0.0.1", gw.ports[0]) for _ in range(60)]
        try:
            await await_until(lambda: gw.guard.closed["evicted"] >= 40)
            assert gw.guard.open <= 20
            c = openai_client(st.url, KEY)
            try:
                for _ in range(5):
                    got = await c.completions.create(model=MODEL, prompt="a", max_tokens=2)
                    assert got.choices
            finally:
                await c.close()
        finally:
            for _, w in silent:
                w.close()
        await settled(st)


# -- CORS and TLS ----------------------------------------------------------------------------


async def test_cors_preflight_and_answers(redis_url: str, deployment: str) -> None:
    cors = Cors(("https://app.example",))
    async with stack(redis_url, deployment, n=1, cors=cors, api_keys=ApiKeys([KEY])) as st:
        port = st.gateways[0].ports[0]
        pre = (
            "OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: x\r\nOrigin: {}\r\n"
            "Access-Control-Request-Method: POST\r\n"
            "Access-Control-Request-Headers: authorization, content-type\r\n"
            "Connection: close\r\n\r\n"
        )
        status, h, _ = await _raw(port, pre.format("https://app.example").encode())
        assert status == 204 and h["access-control-allow-origin"] == "https://app.example"
        assert h["access-control-allow-methods"] == "POST"
        assert h["access-control-allow-headers"] == "authorization, content-type"
        status, h, _ = await _raw(port, pre.format("https://evil.example").encode())
        assert status == 403 and "access-control-allow-origin" not in h
        body = b'{"prompt": "a", "max_tokens": 2}'
        extra = f"Origin: https://app.example\r\nAuthorization: Bearer {KEY}\r\n"
        status, h, _ = await _raw(port, _post_head("/v1/completions", len(body), extra) + body)
        assert status == 200 and h["access-control-allow-origin"] == "https://app.example"
        assert "X-Redisbal-Engine" in h["access-control-expose-headers"]
        await settled(st)


def _self_signed(tmp: Any) -> tuple[str, str]:
    cert, key = str(tmp / "cert.pem"), str(tmp / "key.pem")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key,
         "-out", cert, "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


async def test_tls_round_trip_with_the_openai_client(
    redis_url: str, deployment: str, tmp_path: Any
) -> None:
    cert, key = _self_signed(tmp_path)
    ctx = server_ssl(cert, key, None)
    async with stack(redis_url, deployment, n=1, ssl_context=ctx, api_keys=ApiKeys([KEY])) as st:
        url = st.url.replace("http://", "https://")
        verify = ssl.create_default_context(cafile=cert)
        c = openai_client(url, KEY, http_client=openai.DefaultAsyncHttpxClient(verify=verify))
        try:
            got = await c.completions.create(
                model=MODEL, prompt="a", max_tokens=3, extra_body={"ignore_eos": True}
            )  # (without ignore_eos the simulated engine may stop early, as a model does)
            assert got.choices[0].text.split() == ["t0", "t1", "t2"]
            stream = await c.completions.create(model=MODEL, prompt="a", max_tokens=3, stream=True)
            assert "".join([ch.choices[0].text async for ch in stream if ch.choices]).split()
        finally:
            await c.close()
        # plain HTTP to the TLS port gets nothing served
        plain = openai_client(st.url, KEY)
        try:
            with pytest.raises(openai.APIConnectionError):
                await plain.completions.create(model=MODEL, prompt="a", max_tokens=3)
        finally:
            await plain.close()
        await settled(st)
