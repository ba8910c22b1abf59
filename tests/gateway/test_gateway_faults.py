"""The gateway when things die: engine processes killed before, during and
mid-stream, a gateway replica killed, and SIGTERM with a stream in flight; where a test
sends requests through one, its access log has one line per request with the outcome
the client saw."""

from __future__ import annotations

import asyncio
import re
import signal
from typing import Any

import aiohttp
import orjson
import pytest
from support.gateway_stack import (
    FAST,
    MODEL,
    gateway_process,
    openai_client,
    process_engines,
    settled,
    stack,
    start_gateway,
    stop_gateway,
)
from support.helpers import await_until

from redisbal.gateway.accesslog import REQUEST_ID_HEADER, AccessLog
from redisbal.gateway.proxy import ENGINE_HEADER
from redisbal.sim.http_engine import HttpEngine

pytestmark = pytest.mark.gateway  # .ci/run runs these on the lowest aiohttp too


async def test_dead_engine_is_retried_before_the_first_byte_and_pinning_to_it_fails(
    redis_url: str, deployment: str
) -> None:
    async with process_engines(redis_url, deployment, 2) as procs:
        gw = await start_gateway(redis_url, deployment)
        try:
            await await_until(lambda: len(gw.live_engines()) == 2)
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
                # the refused connection was a router.failed(): avoided here at once, and
                # marked suspect for every router of the deployment
                assert gw.router.core.excluded().get("1") is not None
                await await_until(
                    lambda: gw.router.snapshot is not None and "1" in gw.router.snapshot.suspect
                )
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
            await await_until(lambda: sum(e.inflight for e in gw.router.core.known) == 0)
        finally:
            await stop_gateway(gw)


async def test_engine_killed_mid_stream_ends_the_stream_with_an_error_event(
    redis_url: str, deployment: str
) -> None:
    lines: list[str] = []
    async with process_engines(redis_url, deployment, 2) as procs:
        gw = await start_gateway(redis_url, deployment, access_log=AccessLog("json", lines.append))
        try:
            await await_until(lambda: len(gw.live_engines()) == 2)
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
            await await_until(lambda: sum(e.inflight for e in gw.router.core.known) == 0)
            # one access line, saying what the client saw: a stream begun, then failed
            await await_until(lambda: bool(lines))
            [line] = [orjson.loads(x) for x in lines]
            assert line["id"] == r.headers[REQUEST_ID_HEADER]
            assert (line["status"], line["outcome"], line["engine"]) == (200, "failed", "1")
        finally:
            await stop_gateway(gw)


async def test_non_streamed_request_on_an_engine_that_dies_is_retried(
    redis_url: str, deployment: str
) -> None:
    lines: list[str] = []
    async with process_engines(redis_url, deployment, 2) as procs:
        gw = await start_gateway(redis_url, deployment, access_log=AccessLog("json", lines.append))
        try:
            await await_until(lambda: len(gw.live_engines()) == 2)
            base = f"http://127.0.0.1:{gw.ports[0]}"
            async with aiohttp.ClientSession() as s:
                body = {"prompt": "a", "max_tokens": 200, "ignore_eos": True}
                core = gw.router.core
                # two long requests: the policy spreads them, one on each engine
                tasks = [
                    asyncio.ensure_future(s.post(base + "/v1/completions", json=body))
                    for _ in range(2)
                ]
                await await_until(lambda: [e.inflight for e in core.known] == [1, 1])
                await asyncio.sleep(0.1)
                procs[1].kill()  # mid-request, before any byte of its answer
                rids = []
                for r in await asyncio.gather(*tasks):
                    got = await r.json()
                    assert r.status == 200, got
                    assert r.headers[ENGINE_HEADER] == "0"
                    assert got["usage"]["completion_tokens"] == 200
                    rids.append(r.headers[REQUEST_ID_HEADER])
            await await_until(lambda: sum(e.inflight for e in core.known) == 0)
            # one line each, answered by engine 0; the one that was on engine 1, retried
            logged = {x["id"]: x for x in map(orjson.loads, lines)}
            assert len(lines) == 2 and sorted(logged) == sorted(rids)
            assert {(x["status"], x["outcome"], x["engine"]) for x in logged.values()} == {
                (200, "ok", "0")
            }
            assert sorted(x["retries"] for x in logged.values()) == [0, 1]
        finally:
            await stop_gateway(gw)


# -- several gateways -----------------------------------------------------------------------


async def test_two_gateways_lease_indexes_and_the_count_follows_a_killed_one(
    redis_url: str, deployment: str, tmp_path: Any
) -> None:
    async with stack(redis_url, deployment, lease_ttl_s=0.6) as st:
        a = st.gateways[0]
        assert (a.router.core.client_index, a.router.core.client_count) == (0, 1)
        async with gateway_process(
            redis_url, deployment, "--lease-ttl-s", "0.6", "--log-level", "warning"
        ) as (b, url, lines):
            assert "client 1 of 2" in lines[-1], lines
            await await_until(lambda: a.router.core.client_count == 2, 5)
            # requests through both gateways carry their own index to the engines
            client = openai_client(url, "x")
            try:
                c = await client.completions.create(model=MODEL, prompt="a", max_tokens=2)
                assert c.choices[0].text
            finally:
                await client.close()
            await await_until(lambda: sum(len(e.model.admitted) > 1 for e in st.engines) >= 1)
            b.kill()  # no release: the lease must expire
            b.wait()
            await await_until(lambda: a.router.core.client_count == 1, 5)
            assert a.router.core.client_index == 0


async def test_a_second_signal_cuts_the_drain_short(redis_url: str, deployment: str) -> None:
    async with stack(redis_url, deployment) as st:
        async with gateway_process(redis_url, deployment, "--drain-s", "600") as (g, base, _):
            assert g.stderr is not None
            async with aiohttp.ClientSession() as s:
                body = {"prompt": "a", "max_tokens": 1000, "ignore_eos": True, "stream": True}
                r = await s.post(base + "/v1/completions", json=body)
                await r.content.readuntil(b"\n\n")
                g.send_signal(signal.SIGINT)
                line = await asyncio.to_thread(g.stderr.readline)
                assert "draining 1 in-flight" in line, line
                g.send_signal(signal.SIGINT)
                rc = await asyncio.to_thread(g.wait, 30)  # not the 600 s drain
                err = g.stderr.read()
                assert rc == 1 and "stopped at once with requests in flight" in err, err
                assert "Traceback" not in err
                r.close()
        await settled(st)


async def test_sigterm_drains_in_flight_streams_then_exits_zero(
    redis_url: str, deployment: str
) -> None:
    async with stack(redis_url, deployment) as st:
        async with gateway_process(redis_url, deployment, "--drain-s", "20") as (g, base, _):
            assert g.stderr is not None
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
        await settled(st)


@pytest.mark.slow
async def test_no_request_lost_when_one_of_four_engines_is_killed_under_load(
    redis_url: str, deployment: str
) -> None:
    lines: list[str] = []
    async with process_engines(redis_url, deployment, 4) as procs:
        gw = await start_gateway(redis_url, deployment, access_log=AccessLog("json", lines.append))
        try:
            await await_until(lambda: len(gw.live_engines()) == 4)
            base = f"http://127.0.0.1:{gw.ports[0]}"
            conn = aiohttp.TCPConnector(limit=0)
            async with aiohttp.ClientSession(connector=conn) as s:

                async def one(i: int) -> tuple[int, str]:
                    await asyncio.sleep(i * 0.01)  # 100 requests/s for 2 s
                    body = {"prompt": "a", "max_tokens": 20, "ignore_eos": True}
                    rid = {REQUEST_ID_HEADER: f"load-{i}"}
                    async with s.post(base + "/v1/completions", json=body, headers=rid) as r:
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
            await await_until(lambda: sum(e.inflight for e in gw.router.core.known) == 0)
            # exactly one access line per request, each answered as its client saw
            logged = [orjson.loads(x) for x in lines]
            assert sorted(x["id"] for x in logged) == sorted(f"load-{i}" for i in range(200))
            assert {(x["status"], x["outcome"]) for x in logged} == {(200, "ok")}
            assert [x["engine"] for x in sorted(logged, key=lambda x: int(x["id"][5:]))] == [
                e for _, e in results
            ]
        finally:
            await stop_gateway(gw)


@pytest.mark.slow
async def test_engine_sigterm_leaves_then_finishes_its_streams_and_exits(
    redis_url: str, deployment: str
) -> None:
    """A graceful engine stop: it leaves at once, new requests go elsewhere, and the
    stream it holds still ends with [DONE] (it hung until aiohttp's 60 s shutdown
    timeout cut it when the step loop stopped first)."""
    async with process_engines(redis_url, deployment, 2) as procs:
        gw = await start_gateway(redis_url, deployment)
        try:
            await await_until(lambda: len(gw.live_engines()) == 2)
            url0 = gw.urls["0"]
            base = f"http://127.0.0.1:{gw.ports[0]}"
            async with aiohttp.ClientSession() as s:
                # >= 6 s of 4 ms steps: the stream is open when the engine leaves
                body = {"prompt": "a", "max_tokens": 1500, "ignore_eos": True, "stream": True}
                r = await s.post(base + "/v1/completions", json=body, headers={ENGINE_HEADER: "0"})
                await r.content.readuntil(b"\n\n")
                procs[0].send_signal(signal.SIGTERM)
                await await_until(lambda: gw.live_engines() == ["1"])  # left, stream still open
                assert not r.content.at_eof()
                async with s.post(url0 + "/v1/completions", json=body) as direct:
                    assert direct.status == 503, await direct.text()
                short = {"prompt": "a", "max_tokens": 3, "ignore_eos": True}
                async with s.post(base + "/v1/completions", json=short) as other:
                    assert other.status == 200 and other.headers[ENGINE_HEADER] == "1"
                rest = (await asyncio.wait_for(r.read(), 40)).decode()
                assert rest.endswith("data: [DONE]\n\n"), rest[-300:]
                assert rest.count("data: ") == 1500  # 1499 more tokens and [DONE]
            rc = await asyncio.to_thread(procs[0].wait, 20)
            assert rc == 0, procs[0].stdout.read() if procs[0].stdout else ""
        finally:
            await stop_gateway(gw)


async def test_engines_back_after_all_left_are_served_before_the_next_url_refresh(
    redis_url: str, deployment: str
) -> None:
    """Every engine left (their URLs unregistered) and came back: the router has them
    again at their first report, so the gateway must not answer 503 "no engine with a
    known URL" until its periodic URL refresh (every 1 s by default; never here)."""
    async with stack(redis_url, deployment, n=1, refresh_s=3600.0) as st:
        gw = st.gateways[0]
        await st.engines[0].stop()
        await await_until(lambda: not gw.router.core.by_id)
        await gw.refresh_urls()  # a periodic refresh while none was there drops its URL
        assert not gw.urls
        again = HttpEngine("0", redis_url=redis_url, deployment=deployment, port=0, params=FAST)
        await again.start()
        try:
            await await_until(lambda: "0" in gw.router.core.by_id)
            assert "0" not in gw.urls  # its URL is only in Redis so far
            async with aiohttp.ClientSession() as s:
                body = {"prompt": "a", "max_tokens": 2, "ignore_eos": True}
                async with s.post(st.url + "/v1/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    assert r.headers[ENGINE_HEADER] == "0"
        finally:
            await again.stop()
