"""The gateway end to end: the official ``openai`` client and raw HTTP (aiohttp)
against a real gateway, in front of real HTTP engines (redisbal.sim.http_engine)
reporting into a real redis-server.

Engines and gateways run in the test's event loop where the test needs to read
their internal counts, and as separate processes where the test kills them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import openai
import orjson
import pytest

from redisbal import endpoints
from redisbal.connection import make_client
from redisbal.gateway.server import ENGINE_HEADER, RANK_HEADER, Gateway
from redisbal.keys import DeploymentKeys
from redisbal.router import AsyncRouter
from redisbal.sim.http_engine import HttpEngine
from redisbal.sim.model import EngineParams

MODEL = "redisbal-sim"
FAST = EngineParams(running_cap=64, base_step_s=0.004, per_seq_s=0.0, prefill_s=0.0)


@dataclass
class Stack:
    engines: list[HttpEngine]
    gateways: list[Gateway] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.gateways[0].ports[0]}"

    def router_inflight(self) -> int:
        return sum(
            e.inflight for g in self.gateways for e in g.router.core.engines
        )  # the routers' own counts

    def engine_inflight(self) -> int:
        return sum(e.inflight + e.model.load for e in self.engines)


async def start_gateway(
    redis_url: str, deployment: str, *, client_index: int | str = "auto", **kw: Any
) -> Gateway:
    router = AsyncRouter(
        redis_url, deployment, client_index, 1 if client_index == "auto" else 2,
        lease_ttl_s=kw.pop("lease_ttl_s", 10.0),
    )  # fmt: skip
    await router.start(wait=3.0)
    gw = Gateway(router, redis_client=make_client(redis_url, asyncio=True), **kw)
    await gw.start("127.0.0.1", 0)
    return gw


async def stop_gateway(gw: Gateway) -> None:
    await gw.close()
    await gw.router.aclose()
    await gw.redis.aclose()


@contextlib.asynccontextmanager
async def stack(
    redis_url: str, deployment: str, n: int = 2, gateways: int = 1, **gw_kw: Any
) -> AsyncIterator[Stack]:
    engines = [
        HttpEngine(str(i), redis_url=redis_url, deployment=deployment, port=0, params=FAST)
        for i in range(n)
    ]
    for e in engines:
        await e.start()
    st = Stack(engines)
    try:
        for _ in range(gateways):
            st.gateways.append(await start_gateway(redis_url, deployment, **gw_kw))
        await wait_for(lambda: all(len(g.live_engines()) == n for g in st.gateways))
        yield st
    finally:
        for g in st.gateways:
            await stop_gateway(g)
        for e in engines:
            await e.stop()


async def wait_for(pred: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"not met within {timeout}s")
        await asyncio.sleep(0.02)


async def settled(st: Stack) -> None:
    """Every request is finished: in the routers' counts and at the engines."""
    await wait_for(lambda: st.router_inflight() == 0 and st.engine_inflight() == 0, 5.0)
    assert all(g.inflight == 0 for g in st.gateways)


# -- the official client -------------------------------------------------------------------


async def test_openai_client_completions_and_chat_streamed_and_not(
    redis_url: str, deployment: str
) -> None:
    async with stack(redis_url, deployment) as st:
        client = openai.AsyncOpenAI(base_url=st.url + "/v1", api_key="none", max_retries=0)
        try:
            c = await client.completions.create(
                model=MODEL, prompt="hello there", max_tokens=7, extra_body={"ignore_eos": True}
            )
            assert c.choices[0].text.split() == [f"t{i}" for i in range(7)]
            assert c.usage is not None and c.usage.completion_tokens == 7
            assert c.choices[0].finish_reason == "length"

            ch = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            assert ch.choices[0].message.content is not None
            assert ch.choices[0].message.content.split() == [f"t{i}" for i in range(5)]
            assert ch.usage is not None and ch.usage.total_tokens == ch.usage.prompt_tokens + 5

            stream = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=9,
                stream=True, stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            parts, usage = [], None
            async for chunk in stream:
                if chunk.choices:
                    parts.append(chunk.choices[0].delta.content or "")
                if chunk.usage is not None:
                    usage = chunk.usage
            assert "".join(parts).split() == [f"t{i}" for i in range(9)]
            assert usage is not None and usage.completion_tokens == 9

            cstream = await client.completions.create(
                model=MODEL, prompt="x", max_tokens=4, stream=True,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            texts = [ch.choices[0].text async for ch in cstream if ch.choices]
            assert "".join(texts).split() == ["t0", "t1", "t2", "t3"]

            models = await client.models.list()
            assert [m.id for m in models.data] == [MODEL]
        finally:
            await client.close()
        await settled(st)
        gw = st.gateways[0]
        assert sum(e.routed for e in gw.router.core.engines) == 4
        assert sum(e.served for e in st.engines) == 4


async def test_health_and_metrics(redis_url: str, deployment: str) -> None:
    async with stack(redis_url, deployment) as st, aiohttp.ClientSession() as s:
        async with s.get(st.url + "/health") as r:
            assert r.status == 200
            body = await r.json()
            assert body["ready"] is True and sorted(body["engines"]) == ["0", "1"]
        for _ in range(4):
            async with s.post(st.url + "/v1/completions", json={"prompt": "a", "max_tokens": 2}):
                pass
        async with s.get(st.url + "/metrics") as r:
            text = await r.text()
        assert 'redisbal_gateway_requests_total{path="/v1/completions",status="200"} 4.0' in text
        assert "redisbal_gateway_decisions_total{engine=" in text
        assert 'redisbal_gateway_added_latency_seconds_count{stream="false"} 4.0' in text
        assert "redisbal_gateway_snapshot_age_seconds" in text
        await settled(st)


async def test_health_is_not_ready_without_engines(redis_url: str, deployment: str) -> None:
    gw = await start_gateway(redis_url, deployment)
    try:
        async with aiohttp.ClientSession() as s:
            base = f"http://127.0.0.1:{gw.ports[0]}"
            async with s.get(base + "/health") as r:
                assert r.status == 503 and (await r.json())["ready"] is False
            async with s.post(base + "/v1/completions", json={"prompt": "a"}) as r:
                assert r.status == 503 and r.headers["Retry-After"] == "1"
                assert "no engine" in (await r.json())["error"]["message"]
    finally:
        await stop_gateway(gw)


# -- bad input ------------------------------------------------------------------------------


async def test_bad_requests_get_clear_errors_and_route_nothing(
    redis_url: str, deployment: str
) -> None:
    async with stack(redis_url, deployment, max_body=4096) as st, aiohttp.ClientSession() as s:
        url = st.url + "/v1/completions"
        async with s.post(url, data=b"x" * 5000, headers={"Content-Type": "application/json"}) as r:
            assert r.status == 413 and "4096" in (await r.json())["error"]["message"]
        async with s.post(url, data=b'{"prompt": "a",', headers={}) as r:
            assert r.status == 400 and "malformed JSON" in (await r.json())["error"]["message"]
        async with s.post(url, data=b"[1, 2]") as r:
            assert r.status == 400 and "JSON object" in (await r.json())["error"]["message"]
        async with s.post(url, json={"prompt": "a", "stream": "yes"}) as r:
            assert r.status == 400 and "stream" in (await r.json())["error"]["message"]
        async with s.post(url, json={"prompt": "a"}, headers={RANK_HEADER: "7"}) as r:
            msg = (await r.json())["error"]["message"]
            assert r.status == 400 and "live engines: 0, 1" in msg, msg
        async with s.post(url, json={"prompt": "a"}, headers={RANK_HEADER: "one"}) as r:
            assert r.status == 400 and RANK_HEADER in (await r.json())["error"]["message"]
        async with s.post(url, json={"prompt": "a"}, headers={ENGINE_HEADER: "a{b}"}) as r:
            assert r.status == 400 and "engine id" in (await r.json())["error"]["message"]
        assert sum(e.routed for e in st.gateways[0].router.core.engines) == 0
        # pinned requests land where they were pinned
        for rank in ("0", "1", "1"):
            async with s.post(url, json={"prompt": "a", "max_tokens": 1},
                              headers={RANK_HEADER: rank}) as r:  # fmt: skip
                assert r.status == 200 and r.headers[ENGINE_HEADER] == rank
        async with s.post(url, json={"prompt": "a", "max_tokens": 1},
                          headers={ENGINE_HEADER: "0"}) as r:  # fmt: skip
            assert r.status == 200 and r.headers[ENGINE_HEADER] == "0"
        assert [e.served for e in st.engines] == [2, 2]
        await settled(st)


# -- client disconnects ---------------------------------------------------------------------


async def test_client_disconnect_mid_stream_finishes_everywhere(
    redis_url: str, deployment: str
) -> None:
    async with stack(redis_url, deployment) as st:
        body = {"prompt": "a", "max_tokens": 500, "ignore_eos": True, "stream": True}
        async with aiohttp.ClientSession() as s:
            r = await s.post(st.url + "/v1/completions", json=body)
            assert r.status == 200
            await r.content.readuntil(b"\n\n")  # one token arrived
            assert st.router_inflight() == 1 and st.engine_inflight() >= 1
            r.close()  # the client goes away mid-stream
        await settled(st)
        assert sum(e.aborted for e in st.engines) == 1
        assert sum(e.served for e in st.engines) == 0
        gw = st.gateways[0]
        assert "client_disconnect" in gw.metrics.render().decode()


async def test_no_inflight_leak_after_many_random_disconnects(
    redis_url: str, deployment: str
) -> None:
    rng = random.Random(7)
    complete = [0]
    async with stack(redis_url, deployment, n=3) as st:
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn) as s:

            async def one(i: int) -> None:
                stream = rng.random() < 0.5
                body = {"prompt": "a", "max_tokens": rng.randint(1, 30), "stream": stream}
                drop_after = rng.choice([None, None, 0.0, 0.01, 0.05])
                req = s.post(st.url + "/v1/completions", json=body)
                if drop_after is None:
                    async with req as r:
                        try:
                            await asyncio.wait_for(r.read(), 30)
                        except asyncio.TimeoutError:
                            raise AssertionError(
                                f"request {i} hung: {r.status} {r.headers} gateway inflight "
                                f"{st.gateways[0].inflight} router {st.router_inflight()} "
                                f"engines {[(e.inflight, e.model.load) for e in st.engines]}"
                            ) from None
                        assert r.status == 200
                    complete[0] += 1
                    return
                with contextlib.suppress(asyncio.TimeoutError, aiohttp.ClientError):
                    await asyncio.wait_for(_read_all(req), drop_after or 0.001)

            try:
                await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(300))), 90)
            except asyncio.TimeoutError:
                raise AssertionError(
                    f"requests hung: gateway inflight {st.gateways[0].inflight} router "
                    f"{st.router_inflight()} engines "
                    f"{[(e.inflight, e.model.load) for e in st.engines]}"
                ) from None
        await settled(st)
        core = st.gateways[0].router.core
        routed = sum(e.routed for e in core.engines)
        served = sum(e.served for e in st.engines)
        # every request that reached the engines was served or aborted there; those
        # dropped before the gateway routed them were never routed
        assert complete[0] <= served <= routed <= 300
        assert served + sum(e.aborted for e in st.engines) <= routed
        assert served < 300  # some really were dropped


async def _read_all(req: Any) -> None:
    async with req as r:
        await r.read()


# -- engines that die -----------------------------------------------------------------------


def _spawn_engine(redis_url: str, deployment: str, index: int, base: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "redisbal.sim.http_engine", "--redis-url", redis_url,
         "--deployment", deployment, "--engines", "1", "--first-index", str(index),
         "--http-port", str(base), "--base-step-ms", "4", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def _free_base(n: int) -> int:
    """A base port with n free ports after it (best effort)."""
    import socket

    for _ in range(50):
        base = random.randint(20000, 40000)
        ok = True
        for p in range(base, base + n):
            with socket.socket() as sock:
                try:
                    sock.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
        if ok:
            return base
    raise RuntimeError("no free ports")


@contextlib.asynccontextmanager
async def process_engines(redis_url: str, deployment: str, n: int) -> AsyncIterator[list[Any]]:
    base = _free_base(n)
    procs = [_spawn_engine(redis_url, deployment, i, base) for i in range(n)]
    try:
        for p in procs:
            assert p.stdout is not None
            line = await asyncio.to_thread(p.stdout.readline)
            assert "ready" in line, line
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            p.wait(10)


async def test_dead_engine_is_retried_before_the_first_byte_and_pinning_to_it_fails(
    redis_url: str, deployment: str
) -> None:
    async with process_engines(redis_url, deployment, 2) as procs:
        gw = await start_gateway(redis_url, deployment)
        try:
            await wait_for(lambda: len(gw.live_engines()) == 2)
            procs[1].kill()
            procs[1].wait()
            base = f"http://127.0.0.1:{gw.ports[0]}"
            async with aiohttp.ClientSession() as s:
                statuses = []
                for stream in (False, True) * 4:  # the router still believes in engine 1
                    body = {"prompt": "a", "max_tokens": 3, "stream": stream}
                    async with s.post(base + "/v1/completions", json=body) as r:
                        text = await r.text()
                        statuses.append((r.status, r.headers.get(ENGINE_HEADER)))
                        if stream:
                            assert text.endswith("data: [DONE]\n\n"), text
                assert statuses == [(200, "0")] * 8
                async with s.post(base + "/v1/completions", json={"prompt": "a"},
                                  headers={ENGINE_HEADER: "1"}) as r:  # fmt: skip
                    err = await r.json()
                    # pinned: no retry elsewhere; a clear error naming the engine
                    assert r.status in (400, 502), err
                    assert "1" in err["error"]["message"]
            text = gw.metrics.render().decode()
            assert "redisbal_gateway_retries_total" in text
            retries = float(re.findall(r"^redisbal_gateway_retries_total (\S+)$", text, re.M)[0])
            assert retries >= 1
            await wait_for(lambda: sum(e.inflight for e in gw.router.core.engines) == 0)
        finally:
            await stop_gateway(gw)


async def test_engine_killed_mid_stream_ends_the_stream_with_an_error_event(
    redis_url: str, deployment: str
) -> None:
    async with process_engines(redis_url, deployment, 2) as procs:
        gw = await start_gateway(redis_url, deployment)
        try:
            await wait_for(lambda: len(gw.live_engines()) == 2)
            base = f"http://127.0.0.1:{gw.ports[0]}"
            async with aiohttp.ClientSession() as s:
                body = {"prompt": "a", "max_tokens": 2000, "ignore_eos": True, "stream": True}
                r = await s.post(base + "/v1/completions", json=body,
                                 headers={ENGINE_HEADER: "1"})  # fmt: skip
                await r.content.readuntil(b"\n\n")
                procs[1].kill()
                rest = (await r.read()).decode()
                events = [e for e in rest.split("\n\n") if e.strip()]
                last = orjson.loads(events[-1].removeprefix("data: "))
                assert "error" in last and "mid-stream" in last["error"]["message"], events[-1]
                assert "[DONE]" not in rest
            await wait_for(lambda: sum(e.inflight for e in gw.router.core.engines) == 0)
        finally:
            await stop_gateway(gw)


async def test_non_streamed_request_on_an_engine_that_dies_is_retried(
    redis_url: str, deployment: str
) -> None:
    async with process_engines(redis_url, deployment, 2) as procs:
        gw = await start_gateway(redis_url, deployment)
        try:
            await wait_for(lambda: len(gw.live_engines()) == 2)
            base = f"http://127.0.0.1:{gw.ports[0]}"
            async with aiohttp.ClientSession() as s:
                body = {"prompt": "a", "max_tokens": 200, "ignore_eos": True}
                core = gw.router.core
                # two long requests: the policy spreads them, one on each engine
                tasks = [
                    asyncio.ensure_future(s.post(base + "/v1/completions", json=body))
                    for _ in range(2)
                ]
                await wait_for(lambda: [e.inflight for e in core.engines] == [1, 1])
                await asyncio.sleep(0.1)
                procs[1].kill()  # mid-request, before any byte of its answer
                for r in await asyncio.gather(*tasks):
                    got = await r.json()
                    assert r.status == 200, got
                    assert r.headers[ENGINE_HEADER] == "0"
                    assert got["usage"]["completion_tokens"] == 200
            await wait_for(lambda: sum(e.inflight for e in core.engines) == 0)
        finally:
            await stop_gateway(gw)


# -- several gateways -----------------------------------------------------------------------


async def test_two_gateways_lease_indexes_and_the_count_follows_a_killed_one(
    redis_url: str, deployment: str, tmp_path: Any
) -> None:
    async with stack(redis_url, deployment, lease_ttl_s=0.6) as st:
        a = st.gateways[0]
        assert (a.router.core.client_index, a.router.core.client_count) == (0, 1)
        env = {**os.environ, "REDISBAL_REDIS_URL": redis_url, "REDISBAL_DEPLOYMENT": deployment}
        port = _free_base(1)
        b = subprocess.Popen(
            [os.path.join(os.path.dirname(sys.executable), "redisbal"), "gateway", "--port",
             str(port), "--lease-ttl-s", "0.6", "--log-level", "warning"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            assert b.stderr is not None
            line = await asyncio.to_thread(b.stderr.readline)
            assert "client 1 of 2" in line, line
            await wait_for(lambda: a.router.core.client_count == 2, 5)
            # requests through both gateways carry their own index to the engines
            client = openai.AsyncOpenAI(
                base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0
            )
            try:
                c = await client.completions.create(model=MODEL, prompt="a", max_tokens=2)
                assert c.choices[0].text
            finally:
                await client.close()
            await wait_for(lambda: sum(len(e.model.admitted) > 1 for e in st.engines) >= 1)
            b.kill()  # no release: the lease must expire
            b.wait()
            await wait_for(lambda: a.router.core.client_count == 1, 5)
            assert a.router.core.client_index == 0
        finally:
            if b.poll() is None:
                b.kill()
                b.wait()


async def test_sigterm_drains_in_flight_streams_then_exits_zero(
    redis_url: str, deployment: str
) -> None:
    async with stack(redis_url, deployment) as st:
        env = {**os.environ, "REDISBAL_REDIS_URL": redis_url, "REDISBAL_DEPLOYMENT": deployment}
        port = _free_base(1)
        g = subprocess.Popen(
            [os.path.join(os.path.dirname(sys.executable), "redisbal"), "gateway", "--port",
             str(port), "--drain-s", "20"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            assert g.stderr is not None
            line = await asyncio.to_thread(g.stderr.readline)
            assert "listening" in line, line
            base = f"http://127.0.0.1:{port}"
            async with aiohttp.ClientSession() as s:
                body = {"prompt": "a", "max_tokens": 60, "ignore_eos": True, "stream": True}
                r = await s.post(base + "/v1/completions", json=body)
                await r.content.readuntil(b"\n\n")
                g.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.3)
                with pytest.raises(aiohttp.ClientConnectionError):
                    async with aiohttp.ClientSession() as s2, s2.get(base + "/health"):
                        pass
                rest = (await r.read()).decode()
                assert rest.endswith("data: [DONE]\n\n")
                assert rest.count("data: ") == 60  # 59 more tokens and [DONE]
            rc = await asyncio.to_thread(g.wait, 20)
            assert rc == 0, g.stderr.read()
        finally:
            if g.poll() is None:
                g.kill()
                g.wait()
        await settled(st)


async def test_urls_registry_checks_what_it_stores_and_reads(
    redis_url: str, deployment: str
) -> None:
    keys = DeploymentKeys(deployment)
    client = make_client(redis_url, asyncio=True)
    try:
        for bad in ("ftp://x", "http://", "http://u:p@h:1", "http://h:1/?q", "http://h x",
                    "x" * 600, "http://h:99999"):  # fmt: skip
            with pytest.raises(endpoints.InvalidURL):
                await endpoints.register(client, keys, "e0", bad)
        with pytest.raises(ValueError, match="engine_id"):
            await endpoints.register(client, keys, "a{b}", "http://h:1")
        assert await client.exists(keys.urls) == 0  # nothing stored
        assert await endpoints.register(client, keys, "e0", "http://h:8000/") == "http://h:8000"
        await client.hset(keys.urls, "e1", "javascript:alert(1)")  # another client wrote junk
        assert await endpoints.fetch(client, keys) == {"e0": "http://h:8000"}
        assert endpoints.parse_engine_arg("e2=https://h:1") == ("e2", "https://h:1")
        with pytest.raises(endpoints.InvalidURL, match="ID=URL"):
            endpoints.parse_engine_arg("http://h:1")
    finally:
        await client.aclose()


def test_gateway_command_without_the_extra_fails_with_one_line() -> None:
    code = (
        "import sys; sys.modules['aiohttp'] = None\n"
        "from redisbal.cli import main\n"
        "sys.argv = ['redisbal', 'gateway', '--redis-url', 'redis://127.0.0.1:1/0']\n"
        "main()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        "Error: the gateway needs the 'gateway' extra (aiohttp is missing): "
        "pip install 'redisbal[gateway]'"
    ], out.stderr


async def test_static_engine_urls_and_vllm_style_engine_metrics(
    redis_url: str, deployment: str
) -> None:
    """--engine ID=URL: an engine that never registered in Redis is routable."""
    eng = HttpEngine("e9", redis_url=None, deployment=deployment, port=0, params=FAST)
    await eng.start()
    router = AsyncRouter(redis_url, deployment, "auto", engines=["e9"])
    await router.start()
    gw = Gateway(router, redis_client=make_client(redis_url, asyncio=True),
                 static_urls={"e9": eng.url})  # fmt: skip
    await gw.start("127.0.0.1", 0)
    try:
        base = f"http://127.0.0.1:{gw.ports[0]}"
        async with aiohttp.ClientSession() as s:
            async with s.get(base + "/health") as r:
                body = await r.json()
                assert r.status == 200 and body["engines"] == ["e9"], body
                assert body["snapshot_version"] is None  # ready on the known engine set
            body = {"prompt": "a", "max_tokens": 3, "ignore_eos": True, "stream": True}
            async with s.post(base + "/v1/completions", json=body) as r:
                assert r.status == 200 and r.headers[ENGINE_HEADER] == "e9"
                assert (await r.text()).count("data: ") == 4
            # pinned to an engine the router knows but that has no URL: 503, nothing leaks
            gw.router.core.set_engines(["e9", "e8"])
            async with s.post(base + "/v1/completions", json=body,
                              headers={ENGINE_HEADER: "e8"}) as r:  # fmt: skip
                msg = (await r.json())["error"]["message"]
                assert r.status == 503 and "'e8' has no known URL" in msg, msg
            assert [e.inflight for e in gw.router.core.engines] == [0, 0]
            async with s.get(eng.url + "/metrics") as r:
                text = await r.text()
        for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
            assert f'vllm:{name}{{engine="e9",model_name="{MODEL}"}} ' in text, text
            assert f"# TYPE vllm:{name} gauge" in text
    finally:
        await stop_gateway(gw)
        await eng.stop()


async def test_loadgen_replays_a_trace_through_the_gateway_and_reports_json(
    redis_url: str, deployment: str, tmp_path: Any
) -> None:
    trace = tmp_path / "trace.jsonl"
    lines = [{"t": i * 0.05, "prompt_tokens": 5 + i, "output_tokens": 3 + i, "key": f"u{i}"}
             for i in range(6)]  # fmt: skip
    trace.write_bytes(b"\n".join(orjson.dumps(x) for x in lines) + b"\n")
    redisbal = os.path.join(os.path.dirname(sys.executable), "redisbal")
    async with stack(redis_url, deployment) as st:
        for stream in ("--stream", "--no-stream"):
            proc = await asyncio.create_subprocess_exec(
                redisbal, "loadgen", "--url", st.url, "--trace", str(trace), stream, "--json",
                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            )  # fmt: skip
            out, err = await proc.communicate()
            assert proc.returncode == 0, err.decode()
            got = orjson.loads(out)
            assert (got["requests"], got["ok"], got["errors"]) == (6, 6, {}), got
            assert got["ttft_p50_ms"] is not None and got["e2e_p99_ms"] >= got["e2e_p50_ms"]
            # exactly the trace's output tokens: 3 + 4 + ... + 8
            assert got["tokens_per_s"] * got["elapsed_s"] == pytest.approx(33, abs=0.5)
            if stream == "--stream":
                assert got["itl_p50_ms"] is not None
        await settled(st)
    trace.write_bytes(b'{"t": 0, "prompt_tokens": 5, "output_tokens": 3}\n{"t": -1}\n')
    out = subprocess.run([redisbal, "loadgen", "--url", "http://127.0.0.1:1", "--trace",
                          str(trace)], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 2 and f"{trace}:2: t must be seconds >= 0" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


async def test_no_request_lost_when_one_of_four_engines_is_killed_under_load(
    redis_url: str, deployment: str
) -> None:
    async with process_engines(redis_url, deployment, 4) as procs:
        gw = await start_gateway(redis_url, deployment)
        try:
            await wait_for(lambda: len(gw.live_engines()) == 4)
            base = f"http://127.0.0.1:{gw.ports[0]}"
            conn = aiohttp.TCPConnector(limit=0)
            async with aiohttp.ClientSession(connector=conn) as s:

                async def one(i: int) -> tuple[int, str]:
                    await asyncio.sleep(i * 0.01)  # 100 requests/s for 2 s
                    body = {"prompt": "a", "max_tokens": 20, "ignore_eos": True}
                    async with s.post(base + "/v1/completions", json=body) as r:
                        got = await r.json()
                        if r.status != 200:
                            return r.status, str(got)
                        assert got["usage"]["completion_tokens"] == 20
                        return r.status, r.headers[ENGINE_HEADER]

                async def killer() -> None:
                    await asyncio.sleep(0.7)
                    procs[2].kill()

                results, _ = await asyncio.gather(
                    asyncio.gather(*(one(i) for i in range(200))), killer()
                )
            assert [st for st, _ in results] == [200] * 200, [x for x in results if x[0] != 200]
            assert {e for _, e in results[150:]} <= {"0", "1", "3"}  # served by the live ones
            await wait_for(lambda: sum(e.inflight for e in gw.router.core.engines) == 0)
        finally:
            await stop_gateway(gw)
