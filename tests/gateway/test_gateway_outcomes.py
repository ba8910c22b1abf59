"""The gateway routes on what requests get, not on what engines report: real HTTP
engines with injected faults (POST /sim/fault), a real gateway and the real
``openai`` client with no retries."""

from __future__ import annotations

import asyncio
import re
import signal
import socket
import time
from typing import Any

import aiohttp
import openai
import pytest
import redis
from support.gateway_stack import (
    MODEL,
    openai_client,
    process_engines,
    settled,
    stack,
    start_engines,
    start_gateway,
    stop_gateway,
)
from support.helpers import await_until, coordinator

from redisbal.gateway.proxy import ENGINE_HEADER
from redisbal.gateway.retry import RetryBudget
from redisbal.gateway.server import Gateway
from redisbal.ops.status import gather_status
from redisbal.routing.outcomes import OutcomeTracker
from redisbal.sim.http_engine import HttpEngine
from redisbal.sim.model import EngineParams

pytestmark = pytest.mark.gateway  # .ci/run runs these on the lowest aiohttp too


async def set_fault(url: str, mode: str, status: int = 500, **more: float) -> None:
    body = {"mode": mode, "status": status, **more}
    async with aiohttp.ClientSession() as s, s.post(url + "/sim/fault", json=body) as r:
        assert r.status == 200, await r.text()


async def brought_back(gw: Gateway, bad: HttpEngine, client: openai.AsyncOpenAI) -> None:
    """``bad`` (engine "0") answers well again: its fault ended, the probes that reach it
    answer, and it is chosen again."""
    await set_fault(bad.url, "none")
    before = bad.arrived
    deadline = time.monotonic() + 10  # (guards a hang only)
    while bad.arrived < before + 5 and time.monotonic() < deadline:
        await stream_one(client)
    assert bad.arrived >= before + 5
    await await_until(lambda: "0" not in gw.router.core.excluded())


async def sim_state(url: str) -> dict[str, Any]:
    """An engine-sim engine's ``/sim/state``: what it served and aborted."""
    async with aiohttp.ClientSession() as s, s.get(url + "/sim/state") as r:
        assert r.status == 200, await r.text()
        out: dict[str, Any] = await r.json()
        return out


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    total = 0.0
    for m in re.finditer(rf"^{name}(?:{{([^}}]*)}})? (\S+)$", text, re.M):
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
    return total


async def stream_one(client: openai.AsyncOpenAI) -> str:
    out = await client.completions.create(model=MODEL, prompt="hi", max_tokens=4, stream=True)
    return "".join([c.choices[0].text async for c in out if c.choices])


async def test_an_engine_answering_500_while_reporting_idle_is_avoided_then_taken_back(
    redis_url: str, deployment: str
) -> None:
    async with stack(redis_url, deployment, n=3, suspect_s=0.4) as st:
        gw, bad = st.gateways[0], st.engines[0]
        await set_fault(bad.url, "status", 500)
        client = openai.AsyncOpenAI(base_url=st.url + "/v1", api_key="x", max_retries=0)
        # every request succeeds: a 500 before the first byte goes to another engine
        for _ in range(6):  # (in batches: the retry budget is a share of the traffic)
            assert all(await asyncio.gather(*(stream_one(client) for _ in range(10))))
        text = gw.metrics.render().decode()
        assert metric(text, "redisbal_gateway_errors_total", reason="5xx") >= 1
        assert metric(text, "redisbal_gateway_engine_outcomes_total", engine="0", outcome="5xx")
        assert metric(text, "redisbal_gateway_ejections_total", engine="0") >= 1
        # avoided everywhere through Redis, whatever its reports say
        await await_until(lambda: "0" in gw.router.core.excluded())
        decisions = metric(text, "redisbal_gateway_decisions_total", engine="0")
        assert decisions < 20, f"engine 0 got {decisions} of 60+ decisions while failing"
        # it answers well again: a probe brings it back, here and in the deployment
        await brought_back(gw, bad, client)
        await settled(st)


async def test_stalled_streams_are_retried_before_the_first_byte_and_cut_after_it(
    redis_url: str, deployment: str
) -> None:
    async with stack(redis_url, deployment, n=2, idle_timeout_s=0.5) as st:
        gw, bad = st.gateways[0], st.engines[0]
        base = st.url
        async with aiohttp.ClientSession() as s:
            # a stream under way on engine 0 when it stalls: its first byte went out
            body = {"prompt": "a", "max_tokens": 400, "ignore_eos": True, "stream": True}
            async with s.post(
                base + "/v1/completions", json=body, headers={ENGINE_HEADER: "0"}
            ) as r:
                await r.content.readany()
                await set_fault(bad.url, "stall")
                rest = (await r.read()).decode()
            assert '"type":"upstream_error"' in rest and "[DONE]" not in rest
            # new requests never wait on it: no first byte in the bound, another engine
            client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
            assert all(await asyncio.gather(*(stream_one(client) for _ in range(10))))
        text = gw.metrics.render().decode()
        assert metric(text, "redisbal_gateway_errors_total", reason="idle_timeout") == 1
        assert "0" in gw.router.core.excluded()
        await set_fault(bad.url, "none")
        await settled(st)


async def test_an_engine_leaving_a_stream_without_its_first_token_gets_no_more_until_it_answers(
    redis_url: str, deployment: str
) -> None:
    """The late rule alone: its reports stay healthy and the first-byte bound (30 s
    here) never fails the waiting request, yet once that request waited a few times
    the engine's usual first-token time, the router passes the engine over; its answer
    brings it back. Without the rule a third of these requests would wait 30 s."""
    slow_to_fail = OutcomeTracker(first_byte_min_s=30.0, first_byte_max_s=60.0)
    async with stack(redis_url, deployment, n=3, outcomes=slow_to_fail) as st:
        gw, bad = st.gateways[0], st.engines[0]
        core = gw.router.core
        client = openai.AsyncOpenAI(base_url=st.url + "/v1", api_key="x", max_retries=0)
        assert all(await asyncio.gather(*(stream_one(client) for _ in range(30))))
        await await_until(lambda: all(core.outcomes.late_bound(e) for e in "012"))
        await set_fault(bad.url, "stall")
        async with aiohttp.ClientSession() as s:
            body = {"prompt": "a", "max_tokens": 4, "stream": True}
            waiting = asyncio.ensure_future(
                s.post(st.url + "/v1/completions", json=body, headers={ENGINE_HEADER: "0"})
            )
            await await_until(lambda: core.by_id["0"].inflight == 1)
            since = time.monotonic()
            bound = core.outcomes.late_bound("0") or 0.0
            await await_until(lambda: time.monotonic() - since > bound + 0.1, 70.0)
            text = gw.metrics.render().decode()
            before = metric(text, "redisbal_gateway_decisions_total", engine="0")
            for _ in range(20):
                assert await stream_one(client)
            text = gw.metrics.render().decode()
            assert metric(text, "redisbal_gateway_decisions_total", engine="0") == before
            assert core.excluded() == {"0": "late"}
            assert metric(text, "redisbal_gateway_errors_total", reason="first_byte_timeout") == 0
            await set_fault(bad.url, "none")  # the waiting stream gets its first token
            async with await waiting as r:
                assert r.status == 200
                await r.read()
        await await_until(lambda: core.excluded() == {})
        got = [await stream_one(client) for _ in range(30)]
        text = gw.metrics.render().decode()
        assert all(got) and metric(text, "redisbal_gateway_decisions_total", engine="0") > before
        await settled(st)


async def test_rejected_requests_leave_no_phantom_load(redis_url: str, deployment: str) -> None:
    async with stack(redis_url, deployment, n=2) as st:
        gw, bad = st.gateways[0], st.engines[0]
        async with aiohttp.ClientSession() as s:
            await set_fault(bad.url, "status", 400)
            for _ in range(5):
                async with s.post(
                    st.url + "/v1/completions",
                    json={"prompt": "a", "max_tokens": 2},
                    headers={ENGINE_HEADER: "0"},
                ) as r:
                    assert r.status == 400  # passed on, not retried: the client's to fix
            await set_fault(bad.url, "none")
            got = []
            for _ in range(40):  # sequential: an even split is 20 each
                async with s.post(
                    st.url + "/v1/completions", json={"prompt": "a", "max_tokens": 2}
                ) as r:
                    assert r.status == 200
                    got.append(r.headers[ENGINE_HEADER])
        # ties between idle engines are broken at random, so the count is Binomial(40, 1/2):
        # outside 8..32 once in about 50,000 runs; the phantom load of the refused routes
        # left engine 0 with 0-1 of 40
        assert 8 <= got.count("0") <= 32, got
        assert "0" not in gw.router.core.excluded()  # a rejection is no evidence
        text = gw.metrics.render().decode()
        assert metric(text, "redisbal_gateway_engine_outcomes_total", outcome="rejected") == 5
        await settled(st)


async def test_models_is_answered_while_the_first_engine_hangs(
    redis_url: str, deployment: str
) -> None:
    hung = socket.socket()  # accepts connections (the kernel does) and never answers
    hung.bind(("127.0.0.1", 0))
    hung.listen(16)
    try:
        async with stack(redis_url, deployment, n=2) as st:
            gw = st.gateways[0]
            gw.static_urls["0"] = gw.urls["0"] = f"http://127.0.0.1:{hung.getsockname()[1]}"
            async with (
                aiohttp.ClientSession() as s,
                s.get(st.url + "/v1/models", timeout=aiohttp.ClientTimeout(total=5)) as r,
            ):
                assert r.status == 200
                assert (await r.json())["data"][0]["id"] == MODEL
    finally:
        hung.close()


async def test_a_completed_stream_is_no_client_disconnect(redis_url: str, deployment: str) -> None:
    async with stack(redis_url, deployment, n=2) as st:
        client = openai.AsyncOpenAI(base_url=st.url + "/v1", api_key="x", max_retries=0)
        assert all(await asyncio.gather(*(stream_one(client) for _ in range(40))))
        await settled(st)
        text = st.gateways[0].metrics.render().decode()
        assert metric(text, "redisbal_gateway_errors_total", reason="client_disconnect") == 0


async def test_a_stopped_engine_is_given_up_once_its_reports_stop(
    redis_url: str, deployment: str
) -> None:
    """SIGSTOP: the kernel still accepts connections and nothing answers. Non-streamed
    requests have no first-byte bound (only the whole-response timeout, 600 s here), yet
    they finish: once forced snapshots name the engine a laggard (its heartbeats
    stopped), a request that waited for it goes to another engine; from then on the
    engine gets no request at all (silent), over every snapshot until it reports again.
    Without that, the requests sent to it would wait out the test's timeout."""
    with coordinator(redis_url, deployment, stall_ms=100, dead_after_ms=60_000):
        async with process_engines(redis_url, deployment, 3) as procs:
            gw = await start_gateway(redis_url, deployment, timeout_s=600.0)
            try:
                client = openai.AsyncOpenAI(
                    base_url=f"http://127.0.0.1:{gw.ports[0]}/v1", api_key="x", max_retries=0
                )
                await await_until(lambda: len(gw.live_engines()) == 3)

                async def batch(tokens: int) -> None:
                    done = await asyncio.gather(
                        *(
                            client.completions.create(
                                model=MODEL,
                                prompt="hi",
                                max_tokens=tokens,
                                extra_body={"ignore_eos": True},
                            )
                            for _ in range(30)
                        )
                    )
                    assert all(out.choices for out in done)

                # long answers under way on engine 0 when it stops: they wait on it
                first = asyncio.ensure_future(batch(200))
                await await_until(lambda: gw.router.core.by_id["0"].inflight >= 1)
                procs[0].send_signal(signal.SIGSTOP)
                try:
                    await first  # given up once it is silent, served elsewhere
                    assert gw.router.silent_s("0") > 0, "the snapshots do not name it silent"
                    text = gw.metrics.render().decode()
                    got = metric(
                        text, "redisbal_gateway_engine_outcomes_total", engine="0",
                        outcome="first_byte_timeout",
                    )  # fmt: skip
                    assert got >= 1, "no request to the stopped engine was given up"
                    before = metric(text, "redisbal_gateway_decisions_total", engine="0")
                    await batch(4)  # silent now: none goes there
                    text = gw.metrics.render().decode()
                    assert metric(text, "redisbal_gateway_decisions_total", engine="0") == before
                    assert gw.router.core.excluded().get("0") in ("silent", "suspect")
                finally:
                    procs[0].send_signal(signal.SIGCONT)
                await client.close()
            finally:
                await stop_gateway(gw)


async def test_a_slow_engine_is_waited_for_not_taken_for_a_stopped_one(
    redis_url: str, deployment: str
) -> None:
    """An engine process that gets the CPU only now and then (its loop held 1.5 s at a
    time: a front end starved of CPU, long steps) reports at that pace, and is alive.
    Once the deployment has seen its reports pause that long, a request sent to it
    waits for it and is served there, once: none is given up and sent elsewhere, so
    the engines together serve exactly the requests made. With a fixed bound (0.5 s
    without a report) the requests it held were given up and served again elsewhere."""
    with coordinator(redis_url, deployment, stall_ms=100, dead_after_ms=60_000):
        async with process_engines(redis_url, deployment, 2):
            gw = await start_gateway(redis_url, deployment, timeout_s=600.0)
            try:
                client = openai.AsyncOpenAI(
                    base_url=f"http://127.0.0.1:{gw.ports[0]}/v1", api_key="x", max_retries=0
                )
                await await_until(lambda: len(gw.live_engines()) == 2)
                urls = [gw.urls["0"], gw.urls["1"]]
                await set_fault(urls[0], "slow", hold_s=1.5)
                # the deployment's snapshots show its reports pausing at its new pace
                await await_until(lambda: gw.router.silent_after_s("0") > 2.0, 60.0)

                async def one() -> None:
                    out = await client.completions.create(
                        model=MODEL, prompt="hi", max_tokens=40, extra_body={"ignore_eos": True}
                    )
                    assert out.choices

                made = 0
                while (await sim_state(urls[0]))["arrived"] < 3:  # some reach the slow one
                    assert made < 200, "no request went to the slow engine"
                    await asyncio.gather(*(one() for _ in range(10)))
                    made += 10
                await set_fault(urls[0], "none")
                states = [await sim_state(u) for u in urls]
                text = gw.metrics.render().decode()
                given_up = metric(text, "redisbal_gateway_abandoned_total", engine="0")
                assert given_up == 0, f"{given_up:g} requests given up on the slow engine"
                assert states[0]["aborted"] == 0
                assert sum(st["served"] for st in states) == made  # none served twice
                await client.close()
            finally:
                await stop_gateway(gw)


async def test_an_attempt_given_up_on_a_stopped_engine_is_aborted_there(
    redis_url: str, deployment: str
) -> None:
    """SIGSTOP: the engine's reports stop, the gateway gives up on the requests it holds
    (whole answers: only the silence rule can) and sends them elsewhere, counting each
    attempt abandoned. Their connections are dropped, not kept for reuse, so once the
    engine runs again it aborts them rather than serving them: the engines together
    serve exactly the requests made, and the stopped one counts them aborted."""
    with coordinator(redis_url, deployment, stall_ms=100, dead_after_ms=60_000):
        async with process_engines(redis_url, deployment, 3) as procs:
            gw = await start_gateway(redis_url, deployment, timeout_s=600.0)
            try:
                client = openai.AsyncOpenAI(
                    base_url=f"http://127.0.0.1:{gw.ports[0]}/v1", api_key="x", max_retries=0
                )
                await await_until(lambda: len(gw.live_engines()) == 3)
                urls = [gw.urls[e] for e in ("0", "1", "2")]

                async def one() -> None:
                    out = await client.completions.create(
                        model=MODEL, prompt="hi", max_tokens=400, extra_body={"ignore_eos": True}
                    )
                    assert out.choices

                batch = asyncio.gather(*(one() for _ in range(30)))
                await await_until(lambda: gw.router.core.by_id["0"].inflight >= 1)
                procs[0].send_signal(signal.SIGSTOP)
                try:
                    await batch  # given up once it is silent, served elsewhere
                    text = gw.metrics.render().decode()
                    given_up = metric(
                        text, "redisbal_gateway_abandoned_total", engine="0",
                        reason="first_byte_timeout",
                    )  # fmt: skip
                    assert given_up >= 1, "no request to the stopped engine was given up"
                finally:
                    procs[0].send_signal(signal.SIGCONT)
                deadline = time.monotonic() + 30  # (guards a hang only)
                while (await sim_state(urls[0]))["inflight"]:  # it has ended what it held
                    assert time.monotonic() < deadline, "the engine still holds requests"
                    await asyncio.sleep(0.05)
                states = [await sim_state(u) for u in urls]
                assert states[0]["aborted"] >= given_up
                assert sum(st["served"] for st in states) == 30  # none served twice
                await client.close()
            finally:
                await stop_gateway(gw)


def suspect_reason(redis_url: str, deployment: str, engine: str) -> str:
    """What ``redisbal status`` says of ``engine``'s suspect mark ("" without one)."""
    with redis.Redis.from_url(redis_url) as r:
        rows = {e["engine"]: e for e in gather_status(r, deployment)["engines"]}
    mark = rows.get(engine, {}).get("suspect")
    return str(mark["reason"]) if mark else ""


async def test_an_engine_refusing_what_the_others_accept_is_retried_avoided_and_named(
    redis_url: str, deployment: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A 401 from one engine for the credentials and model the others accept (a wrong
    engine key there) is that engine's fault: retried elsewhere, avoided by every
    router, logged once, counted by status and shown with its status in ``status``."""
    async with stack(redis_url, deployment, n=3) as st:
        gw, bad = st.gateways[0], st.engines[0]
        client = openai_client(st.url, "k")
        assert all(await asyncio.gather(*(stream_one(client) for _ in range(12))))
        await set_fault(bad.url, "status", 401)
        caplog.set_level("WARNING", "redisbal.gateway")
        for _ in range(6):  # (in batches: the retry budget is a share of the traffic)
            assert all(await asyncio.gather(*(stream_one(client) for _ in range(10))))
        text = gw.metrics.render().decode()
        assert metric(text, "redisbal_gateway_engine_outcomes_total", engine="0", outcome="401")
        await await_until(lambda: "0" in gw.router.core.excluded())
        await await_until(lambda: "401 x" in suspect_reason(redis_url, deployment, "0"))
        said = [r for r in caplog.records if "refuses with 401" in r.getMessage()]
        assert len(said) == 1, [r.getMessage() for r in said]
        decisions = metric(text, "redisbal_gateway_decisions_total", engine="0")
        assert decisions < 20, f"engine 0 got {decisions} of 70+ decisions while refusing"
        # it accepts again: a probe brings it back
        await brought_back(gw, bad, client)
        await settled(st)


async def test_a_refusal_no_engine_accepts_goes_back_to_the_client_and_blames_none(
    redis_url: str, deployment: str
) -> None:
    """The client's own mistakes: credentials every engine refuses, a model no engine
    serves. The engine's answer goes back as it came, and no engine is marked."""
    async with stack(redis_url, deployment, n=3) as st:
        gw = st.gateways[0]
        good = openai_client(st.url, "good")
        assert all(await asyncio.gather(*(stream_one(good) for _ in range(6))))
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            await good.completions.create(model="nope", prompt="a", max_tokens=2, stream=True)
        for e in st.engines:  # a revoked key: refused everywhere
            await set_fault(e.url, "status", 401)
        bad = openai_client(st.url, "revoked")
        for _ in range(5):
            with pytest.raises(openai.AuthenticationError):
                await stream_one(bad)
        text = gw.metrics.render().decode()
        assert metric(text, "redisbal_gateway_retries_total") == 0
        assert metric(text, "redisbal_gateway_engine_outcomes_total", outcome="rejected") == 6
        assert not gw.router.core.excluded()
        for e in st.engines:
            await set_fault(e.url, "none")
        await settled(st)


async def test_an_engine_whose_streams_stop_mid_way_is_passed_over_before_the_idle_bound(
    redis_url: str, deployment: str
) -> None:
    """An engine whose streams send their first chunks, then nothing (connections open,
    reports healthy) while the other engines' streams flow: every router passes it over
    long before the idle-read bound (20 s here) would fail a stream, new requests go
    elsewhere, and once its streams flow again a probe's stream brings it back."""
    async with stack(redis_url, deployment, n=3, idle_timeout_s=20.0) as st:
        gw, bad = st.gateways[0], st.engines[0]
        client = openai_client(st.url, "k")
        assert all(await asyncio.gather(*(stream_one(client) for _ in range(30))))
        body = {"prompt": "a", "max_tokens": 2000, "ignore_eos": True, "stream": True}

        async def long_stream(s: aiohttp.ClientSession, engine: str) -> str:
            async with s.post(
                st.url + "/v1/completions", json=body, headers={ENGINE_HEADER: engine}
            ) as r:
                return (await r.read()).decode()

        async with aiohttp.ClientSession() as s:
            # streams under way on every engine; engine 0's stops mid-way
            longs = [asyncio.ensure_future(long_stream(s, e)) for e in ("0", "1", "2")]
            await await_until(lambda: all(e.inflight for e in st.engines))
            await set_fault(bad.url, "stall", after=3)
            await await_until(lambda: "0" in gw.router.core.excluded(), 10.0)
            assert not any(t.done() for t in longs)  # no stream was cut to notice it
            await await_until(lambda: "stall x" in suspect_reason(redis_url, deployment, "0"))
            text = gw.metrics.render().decode()
            assert metric(
                text, "redisbal_gateway_engine_outcomes_total", engine="0", outcome="stall"
            )
            # new requests go elsewhere while it stays passed over: then a request reaches
            # it only as a probe (one at a time, each once its back-off ran out), until a
            # probe's stream flows to its end. How many probes come in 20 requests depends
            # on how long they take (a loaded host: more back-offs run out), so it is the
            # decisions the router made while it passed the engine over that are checked,
            # by its own word: none but probes went there.
            core = gw.router.core
            short = {"prompt": "a", "max_tokens": 2, "stream": True}
            served, while_over = [], 0
            for _ in range(20):
                out = core.excluded()  # (every engine out: routers choose among all)
                over = "0" in out and len(out) < len(core.known)
                probes = core.counters["probes"]
                async with s.post(st.url + "/v1/completions", json=short) as r:
                    await r.read()
                    served.append(r.headers[ENGINE_HEADER])
                if over:
                    while_over += 1
                    probed = core.counters["probes"] > probes
                    assert served[-1] != "0" or probed, f"routed to while passed over: {served}"
            assert while_over, "passed over for none of the requests: the test checked nothing"
            # a probe's short stream flowed, so it may be back; while its long stream
            # stays silent it is named again and passed over
            await await_until(lambda: "0" in core.excluded(), 10.0, "passed over again")
            await set_fault(bad.url, "none")  # its streams flow again
            done = await asyncio.gather(*longs)
            assert all("[DONE]" in t for t in done)
        before = bad.arrived
        deadline = time.monotonic() + 10
        while bad.arrived < before + 3 and time.monotonic() < deadline:
            await stream_one(client)
        await await_until(lambda: "0" not in gw.router.core.excluded())
        await settled(st)


async def test_an_engine_stalled_mid_stream_gets_one_probe_per_router_until_it_flows(
    redis_url: str, deployment: str
) -> None:
    """Two gateways, steady load, an engine whose streams stop after 3 chunks: once it
    is named stalled, it gets probes only (copies of requests that go elsewhere: no
    client's request is decided to it), and at most one of each router in flight:
    a probe named stalled in turn is still the one in flight, so no back-off (0.4 s
    at most here) sends another while it hangs (before, each back-off sent one more,
    and they piled up until the idle-read bound). Once its streams flow, the probes'
    streams end and it gets requests again."""
    async with stack(
        redis_url, deployment, n=3, gateways=2, idle_timeout_s=60.0, suspect_s=0.4
    ) as st:
        bad = st.engines[0]
        urls = [f"http://127.0.0.1:{g.ports[0]}" for g in st.gateways]
        clients = [openai_client(u, "k") for u in urls]
        for c in clients:  # each gateway learns every engine's usual gaps between chunks
            assert all(await asyncio.gather(*(stream_one(c) for _ in range(30))))
        long = {"prompt": "a", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        # 8 tokens: more than the stall lets through, so a probe of it cannot end early
        steady = {"prompt": "a", "max_tokens": 8, "ignore_eos": True, "stream": True}

        async def post(s: aiohttp.ClientSession, url: str, body: dict[str, Any], **h: str) -> str:
            async with s.post(url + "/v1/completions", json=body, headers=h) as r:
                return (await r.read()).decode()

        async with aiohttp.ClientSession() as s:
            # every gateway has streams under way on every engine: the others' flow
            longs = [
                asyncio.ensure_future(post(s, u, long, **{ENGINE_HEADER: e}))
                for u in urls
                for e in ("0", "1", "2")
            ]
            await await_until(lambda: all(e.inflight >= 2 for e in st.engines))
            await set_fault(bad.url, "stall", after=3)
            for g in st.gateways:  # named stalled here, or marked for the deployment
                await await_until(lambda g=g: "0" in g.router.core.excluded(), 10.0)
            arrived = bad.arrived
            probes = [g.router.core.counters["probes"] for g in st.gateways]
            sent = [
                metric(g.metrics.render().decode(), "redisbal_gateway_decisions_total", engine="0")
                for g in st.gateways
            ]
            # steady load over many back-offs: what does not go to engine 0 ends
            pending: list[asyncio.Future[str]] = []
            for _ in range(40):
                batch = [asyncio.ensure_future(post(s, u, steady)) for u in urls for _ in range(2)]
                await asyncio.wait(batch, timeout=0.2)
                pending += [t for t in batch if not t.done()]
            for i, g in enumerate(st.gateways):
                text = g.metrics.render().decode()
                to_bad = metric(text, "redisbal_gateway_decisions_total", engine="0") - sent[i]
                probed = g.router.core.counters["probes"] - probes[i]
                assert to_bad == 0, f"gateway {i}: {to_bad} requests decided to it"
                assert probed <= 1, f"gateway {i} sent {probed} probes while one hung"
            assert sum(g.router.core.counters["probes"] for g in st.gateways) > sum(probes), (
                "no probe went: the test checked nothing"
            )
            # what reached the stalled engine: those probes, hanging there
            assert bad.arrived - arrived <= len(st.gateways)
            await set_fault(bad.url, "none")  # its streams flow again
            done = await asyncio.gather(*longs, *pending)
            assert all("[DONE]" in t for t in done)

        def answered(g: Gateway) -> float:  # (a probe hanging there flowed to its end)
            text = g.metrics.render().decode()
            return metric(text, "redisbal_gateway_probes_total", engine="0", outcome="answered")

        for g in st.gateways:
            await await_until(lambda g=g: answered(g))
        before = bad.arrived
        deadline = time.monotonic() + 10  # (guards a hang only)
        while bad.arrived < before + 3 and time.monotonic() < deadline:
            await stream_one(clients[0])
            await stream_one(clients[1])
        assert bad.arrived >= before + 3
        for g in st.gateways:
            await await_until(lambda g=g: "0" not in g.router.core.excluded())
        await settled(st)


# engines of one slot: a 40-token answer holds it 2 s, and what comes meanwhile queues
ONE_SLOT = EngineParams(running_cap=1, base_step_s=0.05, per_seq_s=0.0, prefill_s=0.0)


async def _queued_behind_long_streams(
    redis_url: str, deployment: str, n: int, spent_budget: bool
) -> tuple[str, dict[str, float]]:
    """``n`` ONE_SLOT engines, each busy with a long stream, then a short stream that
    queues at one of them far past its first-byte bound (the first long streams teach
    a usual first byte of one step; the floor is 0.3 s); ``spent_budget``: the gateway
    has no retry left. Returns the short stream's text and the gateway's given-up
    (abandoned) count per engine."""
    engines = await start_engines(redis_url, deployment, n, ONE_SLOT)
    outcomes = OutcomeTracker(first_byte_min_s=0.3, first_byte_factor=2.0)
    gw = await start_gateway(redis_url, deployment, hold_s=0.0, outcomes=outcomes)
    try:
        await await_until(lambda: len(gw.live_engines()) == n)
        if spent_budget:
            gw.models.default.budget = RetryBudget(ratio=0.0, floor=0)
        client = openai_client(f"http://127.0.0.1:{gw.ports[0]}")

        async def stream(tokens: int) -> str:
            out = await client.completions.create(
                model=MODEL, prompt="q", max_tokens=tokens, stream=True,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            return "".join([c.choices[0].text async for c in out if c.choices])

        long = [asyncio.create_task(stream(40)) for _ in range(n)]
        await await_until(lambda: all(e.model.running for e in engines))
        # the engines' counts say so before the short one comes: it queues behind them
        await await_until(lambda: all(gw.router.core.by_id[e].running == 1 for e in gw.urls))
        # and their first tokens came: the short one's first-byte bound is the floor
        await await_until(lambda: all(gw.router.first_byte_bound(e) < 1.0 for e in gw.urls))
        short = await stream(2)
        await asyncio.gather(*long)
        text = gw.metrics.render().decode()
        given_up = {e: metric(text, "redisbal_gateway_abandoned_total", engine=e) for e in gw.urls}
        await client.close()
        return short, given_up
    finally:
        await stop_gateway(gw)
        for e in engines:
            await e.stop()


async def test_a_queued_request_is_waited_for_when_it_could_go_nowhere_else(
    redis_url: str, deployment: str
) -> None:
    """A request queued at an engine (its counts say requests wait there) past its
    first-byte bound is waited for, not given up, when no retry could take it
    elsewhere: the only engine of the deployment, or a retry budget spent (an
    overloaded deployment, where every engine queues). Giving up failed it: the
    engine was about to serve it."""
    for n, spent in ((1, False), (2, True)):
        text, given_up = await _queued_behind_long_streams(redis_url, deployment, n, spent)
        assert text, (n, spent)
        assert sum(given_up.values()) == 0, (n, spent, given_up)
