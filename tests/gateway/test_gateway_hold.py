"""Holding through the gateway (redisbal.routing.admission): with every engine at its
running cap, the gateway holds requests and sends each to the first engine that
frees a slot, instead of into one engine's queue. Real HTTP engines (engine-sim) on a
real redis-server, a real client (openai)."""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator

import aiohttp
import openai
import pytest
from support.gateway_stack import MODEL, start_engines, start_gateway, stop_gateway
from support.helpers import await_until, make_snapshot

from redisbal.gateway.metrics import GatewayMetrics
from redisbal.gateway.server import Gateway
from redisbal.routing.router import AsyncRouter
from redisbal.routing.router_core import RouterCore
from redisbal.sim.model import EngineParams

pytestmark = pytest.mark.gateway  # .ci/run runs these on the lowest aiohttp too

# 2 engines of 2 slots; a request of 8 tokens takes 8 steps of 10 ms
SLOW = EngineParams(running_cap=2, base_step_s=0.01, per_seq_s=0.0, prefill_s=0.0)


def _room_gauges(core: RouterCore) -> tuple[float, dict[str, float]]:
    """The running cap and each engine's room, as the gateway's /metrics export them."""
    families = {f.name: f for f in GatewayMetrics({"d": core}, lambda: 0.0).registry.collect()}
    cap = families["redisbal_gateway_running_cap"].samples[0].value
    rooms = {s.labels["engine"]: s.value for s in families["redisbal_gateway_engine_room"].samples}
    return cap, rooms


def test_metrics_show_the_room_holding_reads() -> None:
    """The gateway exports what holding decides by: unknown room (+Inf: nothing is
    held) until the engines' own word bounds it; the KV room from KV usage; then the
    cap a queue that outlived two reports in a row taught (reports as vLLM's plugin
    makes them, no admitted counts), and each engine's free slots under it."""
    core = RouterCore()
    core.connected = True
    core.apply_snapshot(make_snapshot({"e0": (0, 2), "e1": (0, 2)}, version=1))
    assert _room_gauges(core) == (0.0, {"e0": math.inf, "e1": math.inf})
    # KV usage bounds it: 2 running hold 80 % of the cache, room for half of one more
    kv = {"e0": 0.8, "e1": 0.1}
    core.apply_snapshot(make_snapshot({"e0": (0, 2), "e1": (0, 2)}, version=2, kv=kv))
    cap, rooms = _room_gauges(core)
    assert cap == 0.0 and rooms["e0"] == pytest.approx(0.5) and rooms["e1"] == pytest.approx(18)
    # e0 queues one request through two reports: it runs at its cap of 2
    for v in (3, 4):
        snap = make_snapshot({"e0": (1, 2), "e1": (0, 1)}, version=v, time_ms=1_000_000 + v)
        core.apply_snapshot(snap)
    assert _room_gauges(core) == (2.0, {"e0": -1.0, "e1": 1.0})


async def _wave(client: openai.AsyncOpenAI, n: int) -> list[str]:
    async def one(k: int) -> str:
        c = await client.completions.create(
            model=MODEL, prompt=f"wave {k}", max_tokens=8, extra_body={"ignore_eos": True}
        )
        return c.choices[0].text

    return await asyncio.gather(*(one(k) for k in range(n)))


@contextlib.asynccontextmanager
async def _stack(
    redis_url: str, deployment: str, report_as: str = "full"
) -> AsyncIterator[tuple[AsyncRouter, Gateway, openai.AsyncOpenAI]]:
    """Two SLOW engines (reporting as ``report_as``: redisbal.sim.report_as) behind a
    gateway that holds up to 5 s, and an openai client of it."""
    engines = await start_engines(redis_url, deployment, 2, SLOW, report_as=report_as)
    gw = None
    try:
        gw = await start_gateway(redis_url, deployment, hold_s=5.0)
        await await_until(lambda: len(gw.live_engines()) == 2)
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{gw.ports[0]}/v1", api_key="x", max_retries=0
        )
        yield gw.router, gw, client
        await client.close()
    finally:
        if gw is not None:
            await stop_gateway(gw)
        for e in engines:
            await e.stop()


async def test_requests_past_every_engines_cap_are_held_and_all_served(
    redis_url: str, deployment: str
) -> None:
    async with _stack(redis_url, deployment) as (router, gw, client):
        adm = router.admission
        assert adm is not None
        # the cap is unknown until a queue outlives a report: nothing is held yet, and
        # the queues this wave leaves at the engines teach it
        assert all(await _wave(client, 12))
        await await_until(lambda: router.core.running_cap == 2)
        held_before = adm.held_total
        texts = await _wave(client, 12)
        assert len(texts) == 12 and all(texts)
        assert adm.held_total > held_before  # 12 requests, 4 slots: most were held
        assert adm.timed_out == 0  # each went when a slot freed, none at --hold-s
        assert adm.held == 0
        metrics = f"http://127.0.0.1:{gw.ports[0]}/metrics"
        async with aiohttp.ClientSession() as http, http.get(metrics) as r:
            page = await r.text()
        count = next(
            float(line.split()[1])
            for line in page.splitlines()
            if line.startswith("redisbal_gateway_hold_seconds_count")
        )
        assert count == adm.held_total
        assert "redisbal_gateway_held 0.0" in page


async def test_engines_fed_as_vllms_metrics_feed_them_are_held_for_too(
    redis_url: str, deployment: str
) -> None:
    """Engines that report as the sidecar on vLLM's /metrics does (engine-sim
    --report-as vllm-metrics: running and waiting after each step's admission, no
    admitted counts, no cap) teach the cap by a queue in two reports in a row; then
    requests past every engine's cap are held and all served, each when a slot freed."""
    async with _stack(redis_url, deployment, "vllm-metrics") as (router, _, client):
        snap = router.snapshot
        assert snap is not None and all(c.admitted is None for c in snap.engines.values())
        adm = router.admission
        assert adm is not None
        assert all(await _wave(client, 12))  # its queues teach the cap
        await await_until(lambda: router.core.running_cap == 2)
        held_before = adm.held_total
        assert all(await _wave(client, 12))
        assert adm.held_total > held_before
        assert adm.timed_out == 0 and adm.held == 0


async def test_engines_that_declare_their_cap_are_held_for_from_the_first_wave(
    redis_url: str, deployment: str
) -> None:
    """Engines that report as vLLM's plugin does (engine-sim --report-as vllm-plugin: no
    admitted counts, the cap declared from max_num_seqs) need no queue to teach it:
    the first wave past every engine's cap is held, and all of it served."""
    async with _stack(redis_url, deployment, "vllm-plugin") as (router, _, client):
        core = router.core
        await await_until(lambda: all(e.declared_cap == 2 for e in core.by_id.values()))
        assert core.running_cap == 0  # nothing learned: no queue formed yet
        adm = router.admission
        assert adm is not None and adm.held_total == 0
        assert all(await _wave(client, 12))  # 12 requests, 4 slots: the first wave
        assert adm.held_total > 0
        assert adm.timed_out == 0 and adm.held == 0
