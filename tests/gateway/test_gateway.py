"""The gateway end to end: the official ``openai`` client and raw HTTP (aiohttp)
against a real gateway, in front of real HTTP engines (redisbal.sim.http_engine)
reporting into a real redis-server. Engines and gateways run in the test's event
loop, so the tests read the routers' and the engines' own counts; the last one runs
engines without reports, behind `redisbal scrape` sidecars, as processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import subprocess
import sys
from typing import Any

import aiohttp
import openai
import orjson
import pytest
import redis
from support.cli import REDISBAL, scrubbed_env
from support.gateway_stack import FAST, MODEL, settled, stack, start_gateway, stop_gateway
from support.helpers import Barrier, await_until

from redisbal import endpoints
from redisbal.barrier.snapshot import Snapshot
from redisbal.connection import make_client
from redisbal.gateway.proxy import ENGINE_HEADER, KEY_HEADER, RANK_HEADER, request_hints
from redisbal.gateway.server import Gateway
from redisbal.integrations.metrics_page import parse_page
from redisbal.keys import DeploymentKeys
from redisbal.routing.router import AsyncRouter
from redisbal.sim.http_engine import HttpEngine

pytestmark = pytest.mark.gateway  # .ci/run runs these on the lowest aiohttp too

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
        assert sum(e.routed for e in gw.router.core.known) == 4
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


async def test_paths_and_methods_it_does_not_serve_are_error_json(
    redis_url: str, deployment: str
) -> None:
    """A 404 or 405 is error JSON like the gateway's other errors: the OpenAI client reads
    its message."""
    gw = await start_gateway(redis_url, deployment)
    base = f"http://127.0.0.1:{gw.ports[0]}"
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
    try:
        with pytest.raises(openai.NotFoundError, match="no such path: /v1/embeddings"):
            await client.embeddings.create(model=MODEL, input="hi")
        async with aiohttp.ClientSession() as s, s.get(base + "/v1/completions") as r:
            assert r.status == 405 and r.headers["Allow"] == "POST"
            assert "GET is not served on /v1/completions" in (await r.json())["error"]["message"]
    finally:
        await client.close()
        await stop_gateway(gw)


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
        for rank in ("one", "³"):  # "³" is a digit to str.isdigit(), not to int(): was a 500
            async with s.post(url, json={"prompt": "a"}, headers={RANK_HEADER: rank}) as r:
                assert r.status == 400 and RANK_HEADER in (await r.json())["error"]["message"]
        async with s.post(url, json={"prompt": "a"}, headers={ENGINE_HEADER: "a{b}"}) as r:
            assert r.status == 400 and "engine id" in (await r.json())["error"]["message"]
        assert sum(e.routed for e in st.gateways[0].router.core.known) == 0
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


# -- what the router is told ----------------------------------------------------------------


async def test_a_session_key_keeps_its_requests_on_one_engine_across_gateways(
    redis_url: str, deployment: str
) -> None:
    async with stack(redis_url, deployment, n=4, gateways=2) as st:
        clients = [
            openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{g.ports[0]}/v1", api_key="x",
                               max_retries=0)
            for g in st.gateways
        ]  # fmt: skip
        homes: dict[str, set[str]] = {}
        try:
            for turn in range(3):
                for k in range(6):
                    key = f"session-{k}"
                    raw = await clients[(turn + k) % 2].completions.with_raw_response.create(
                        model=MODEL, prompt="hello " * 50 * (turn + 1), max_tokens=2,
                        extra_headers={KEY_HEADER: key},
                    )  # fmt: skip
                    homes.setdefault(key, set()).add(raw.headers[ENGINE_HEADER])
                await settled(st)  # every route is in the snapshot before the next turn
        finally:
            for c in clients:
                await c.close()
        assert all(len(h) == 1 for h in homes.values()), homes  # one engine per session
        assert len({next(iter(h)) for h in homes.values()}) > 1  # sessions spread out
        body = {"prompt": "a", "user": ""}
        async with aiohttp.ClientSession() as s, s.post(st.url + "/v1/completions", json=body) as r:
            assert r.status == 400 and "user" in (await r.json())["error"]["message"]
        await settled(st)


@pytest.mark.parametrize("user_key", [True, False])
async def test_the_body_user_is_a_key_unless_turned_off(
    redis_url: str, deployment: str, user_key: bool
) -> None:
    """With user_key (the default) one user's requests stay on one engine once users
    come back (the first two go by load: a user who never returns has no cache to go
    to); without it (--no-user-key) they go wherever load sends them: both engines,
    ties at random."""
    async with stack(redis_url, deployment, n=2, user_key=user_key) as st:
        client = openai.AsyncOpenAI(base_url=gw_url(st.gateways[0]) + "/v1", api_key="x",
                                    max_retries=0)  # fmt: skip
        went: list[str] = []
        try:
            for _ in range(20):
                raw = await client.completions.with_raw_response.create(
                    model=MODEL, prompt="hello", max_tokens=1, user="the-same-user"
                )
                went.append(raw.headers[ENGINE_HEADER])
                await settled(st)  # both engines idle again: a tie
        finally:
            await client.close()
        if user_key:
            assert len(set(went[2:])) == 1, went
        else:
            assert len(set(went)) == 2, went


def test_request_hints_read_the_key_and_estimate_the_prompt_size() -> None:
    assert request_hints({"prompt": "x" * 400}, None) == (None, False, 100)
    chat = {"messages": [{"role": "user", "content": "y" * 40},
                         {"role": "user", "content": [{"type": "text", "text": "z" * 40}]}],
            "user": "u1"}  # fmt: skip
    assert request_hints(chat, None) == ("u1", True, 20)  # the body's user: a guessed key
    assert request_hints(chat, "s9") == ("s9", False, 20)  # the header wins over the user
    assert request_hints(chat, None, user_key=False) == (None, False, 20)
    assert request_hints(chat, "s9", user_key=False) == ("s9", False, 20)
    assert request_hints({"user": 5}, None, user_key=False) == (None, False, 0)  # not read
    with pytest.raises(ValueError, match="1-1024 characters"):
        request_hints({"user": 5}, None)


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


# 300 in CI; GATEWAY_DISCONNECT_REQUESTS=10000 for the figure in docs/RELIABILITY.md
DISCONNECT_REQUESTS = int(os.environ.get("GATEWAY_DISCONNECT_REQUESTS", "300"))


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
                for first in range(0, DISCONNECT_REQUESTS, 300):  # 300 at a time
                    last = min(first + 300, DISCONNECT_REQUESTS)
                    await asyncio.wait_for(
                        asyncio.gather(*(one(i) for i in range(first, last))), 90
                    )
            except asyncio.TimeoutError:
                raise AssertionError(
                    f"requests hung: gateway inflight {st.gateways[0].inflight} router "
                    f"{st.router_inflight()} engines "
                    f"{[(e.inflight, e.model.load) for e in st.engines]}"
                ) from None
        await settled(st)
        core = st.gateways[0].router.core
        routed = sum(e.routed for e in core.known)
        served = sum(e.served for e in st.engines)
        # every request that reached the engines was served or aborted there; those
        # dropped before the gateway routed them were never routed
        assert complete[0] <= served <= routed <= DISCONNECT_REQUESTS
        assert served + sum(e.aborted for e in st.engines) <= routed
        assert served < DISCONNECT_REQUESTS  # some really were dropped
        print(
            f"GATEWAY disconnects: {DISCONNECT_REQUESTS} requests, {complete[0]} complete, "
            f"{routed} routed, {served} served; in flight after: gateway "
            f"{st.gateways[0].inflight}, router {st.router_inflight()}"
        )


async def _read_all(req: Any) -> None:
    async with req as r:
        await r.read()


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
        "from redisbal.ops.cli import main\n"
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
            assert [e.inflight for e in gw.router.core.known] == [0, 0]
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
    async with stack(redis_url, deployment) as st:
        for stream in ("--stream", "--no-stream"):
            proc = await asyncio.create_subprocess_exec(
                REDISBAL, "loadgen", "--url", st.url, "--trace", str(trace), stream, "--json",
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
    out = subprocess.run([REDISBAL, "loadgen", "--url", "http://127.0.0.1:1", "--trace",
                          str(trace)], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 2 and f"{trace}:2: t must be seconds >= 0" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


async def test_loadgen_interrupted_keeps_what_it_measured(redis_url: str, deployment: str) -> None:
    """SIGINT mid-run: the summary of the finished requests is still printed (it was lost,
    with click's "Aborted!"), the unfinished ones are counted apart, and the exit status
    says the run is partial. An empty schedule is refused up front."""
    async with stack(redis_url, deployment) as st:
        proc = await asyncio.create_subprocess_exec(
            REDISBAL, "loadgen", "--url", st.url, "--rate", "20", "--duration", "600",
            "--json", "--no-progress", "--max-output", "4",
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        await await_until(lambda: sum(e.served for e in st.engines) >= 3, timeout=30.0)
        proc.send_signal(signal.SIGINT)
        out, err = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 130, err.decode()
        got = orjson.loads(out)
        assert got["requests"] >= 3 and got["ok"] >= 3 and got["unfinished"] > 0, got
        assert "loadgen: interrupted" in err.decode() and "Traceback" not in err.decode()
        await settled(st)
    args = ["loadgen", "--url", "http://127.0.0.1:1", "--rate", "0.01", "--duration", "0.1"]
    out = subprocess.run([REDISBAL, *args], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "Error: nothing to send" in out.stderr, out.stderr


def test_loadgen_says_so_when_no_request_succeeded() -> None:
    """The summary still prints (its errors say why), and the exit status is not 0."""
    args = ["loadgen", "--url", "http://127.0.0.1:1", "--rate", "50", "--duration", "0.2"]
    out = subprocess.run([REDISBAL, *args, "--no-progress"], capture_output=True, text=True,
                         timeout=60)  # fmt: skip
    assert out.returncode == 1, out.stderr
    assert "errors:" in out.stdout and "Error: none of the" in out.stderr, out.stdout + out.stderr
    assert "Traceback" not in out.stderr


# -- behind a /metrics sidecar ---------------------------------------------------------------


async def test_gateway_routes_unmodified_http_engines_by_their_scraped_metrics(
    redis_url: str, r: redis.Redis, keys: DeploymentKeys
) -> None:
    """The whole sidecar path: HTTP engines that know nothing of Redis (engine-sim
    --no-report), one `redisbal scrape` per engine reporting its /metrics, a gateway
    routing the official client's requests. An engine kept busy by requests sent to it
    directly (the gateway never sees them) shows only in its scraped counts; the gateway
    must route around it."""
    Barrier(r, keys).configure()
    env = scrubbed_env()
    engines = subprocess.Popen(
        [sys.executable, "-m", "redisbal", "engine-sim", "--no-report", "--http-port", "0",
         "--engines", "3", "--base-step-ms", "4", "--per-seq-ms", "0", "--prefill-ms", "0",
         "--no-summary", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip
    sidecars: list[subprocess.Popen[str]] = []
    gw = None
    preload: list[aiohttp.ClientResponse] = []
    try:
        assert engines.stdout is not None
        seen = []
        while not (line := await asyncio.to_thread(engines.stdout.readline)).startswith(
            "http engines ready: "
        ):
            assert line and len(seen) < 20, seen  # their log lines come first
            seen.append(line)
        urls = line.split(": ", 1)[1].split()
        assert len(urls) == 3
        assert r.hlen(keys.urls) == 0 and latest(r, keys) is None  # they report nothing
        for u in urls:
            cmd = [sys.executable, "-m", "redisbal", "scrape", "--redis-url", redis_url,
                   "--deployment", keys.deployment, "--metrics-url", u + "/metrics",
                   "--engine-id", "{engine}", "--interval", "20ms"]  # fmt: skip
            sidecars.append(
                subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            )
        ids = ["0", "1", "2"]
        await await_until(lambda: sorted(counts_of(latest(r, keys))) == ids, timeout=20.0)
        # the sidecars registered where each engine serves: the origin of its /metrics URL
        assert {k.decode(): v.decode() for k, v in r.hgetall(keys.urls).items()} == dict(
            zip(ids, urls, strict=True)
        )
        gw = await start_gateway(redis_url, keys.deployment)
        await await_until(lambda: len(gw.live_engines()) == 3, timeout=10.0)

        async with aiohttp.ClientSession() as session:
            # 24 long streams straight to engine 0, held open: it runs them all
            body = {"model": MODEL, "prompt": "x", "max_tokens": 30000, "stream": True,
                    "ignore_eos": True}  # fmt: skip
            for _ in range(24):
                resp = await session.post(urls[0] + "/v1/completions", json=body)
                assert resp.status == 200
                preload.append(resp)

            async def scraped() -> dict[str, tuple[int, int]]:
                out = {}
                for eid, u in zip(ids, urls, strict=True):
                    async with session.get(u + "/metrics") as m:
                        (s,) = parse_page(await m.text())
                    out[eid] = (s.waiting, s.running)
                return out

            # the snapshot shows what the pages show
            await await_until(lambda: counts_of(latest(r, keys)).get("0") == (0, 24), timeout=10.0)
            pages = await scraped()
            assert pages == {"0": (0, 24), "1": (0, 0), "2": (0, 0)}
            assert counts_of(latest(r, keys)) == pages

            client = openai.AsyncOpenAI(base_url=gw_url(gw) + "/v1", api_key="none", max_retries=0)
            try:

                async def one() -> str:
                    raw = await client.completions.with_raw_response.create(
                        model=MODEL, prompt="hi", max_tokens=3, extra_body={"ignore_eos": True}
                    )
                    c = raw.parse()
                    assert c.choices[0].text.split() == ["t0", "t1", "t2"]
                    assert c.choices[0].finish_reason == "length"
                    return raw.headers["x-redisbal-engine"]

                went: list[str] = []
                for _ in range(5):  # 5 waves of 6 concurrent requests
                    went += await asyncio.gather(*(one() for _ in range(6)))
            finally:
                await client.close()
            assert len(went) == 30  # every request succeeded
            by = {e: went.count(e) for e in ids}
            assert by["0"] < min(by["1"], by["2"]), by  # the busy engine got fewer
            # the engines saw exactly that: the header says where each request went
            for eid, u in zip(ids, urls, strict=True):
                async with session.get(u + "/sim/state") as st:
                    state = await st.json()
                assert state["arrived"] == by[eid] + (24 if eid == "0" else 0), (eid, state)

            for resp in preload:  # the client goes away: engine 0 aborts them
                resp.close()
            preload.clear()
            await await_until(
                lambda: counts_of(latest(r, keys)) == dict.fromkeys(ids, (0, 0)), 10.0
            )
            assert await scraped() == counts_of(latest(r, keys))
    finally:
        for resp in preload:
            resp.close()
        if gw is not None:
            await stop_gateway(gw)
        for p in [*sidecars, engines]:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in [*sidecars, engines]:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    for p in sidecars:
        assert p.returncode == 0
        assert p.stderr is not None and "Traceback" not in p.stderr.read()
    assert engines.returncode == 0


def latest(r: redis.Redis, keys: DeploymentKeys) -> Snapshot | None:
    raw = r.get(keys.snapshot)
    return Snapshot.from_json(raw) if raw else None


def counts_of(snap: Snapshot | None) -> dict[str, tuple[int, int]]:
    return {} if snap is None else {e: (c.waiting, c.running) for e, c in snap.engines.items()}


def gw_url(gw: Gateway) -> str:
    return f"http://127.0.0.1:{gw.ports[0]}"
