"""engine-sim reports as each real engine's path does (``--report-as``,
redisbal.sim.report_as): admitted counts or none, the running cap declared or not,
SGLang's /v1/loads and /metrics served or not. Real engines (HTTP and Redis-list
transport) on a real redis-server, their reports read back from Redis."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import pytest
import redis
from click.testing import CliRunner
from support.helpers import Barrier, await_until

from redisbal import running_caps
from redisbal.barrier.snapshot import Snapshot
from redisbal.errors import InvalidArgument
from redisbal.keys import DeploymentKeys
from redisbal.ops.cli import cli
from redisbal.sim.engine_sim import EngineSimRunner
from redisbal.sim.http_engine import HttpEngine
from redisbal.sim.model import EngineParams, SimRequest
from redisbal.sim.report_as import REPORT_AS, Feed

PARAMS = EngineParams(running_cap=3, base_step_s=0.005, per_seq_s=0.0, prefill_s=0.0)
# form -> (admitted counts, cap declared, SGLang's /v1/loads and /metrics)
EXPECTED = {
    "full": (True, False, False),
    "vllm-plugin": (False, True, False),
    "vllm-metrics": (False, False, False),
    "sglang": (False, True, True),
}
TOTAL = {"vllm-plugin", "vllm-metrics", "sglang"}  # the forms that send an admitted total


def snapshot(r: redis.Redis, keys: DeploymentKeys) -> Snapshot | None:
    raw = r.get(keys.snapshot)
    return Snapshot.from_json(raw) if raw else None


@pytest.mark.parametrize("form", REPORT_AS)
async def test_an_http_engine_reports_and_serves_as_its_form(
    form: str, r: redis.Redis, redis_url: str, keys: DeploymentKeys
) -> None:
    admitted, declares, sglang = EXPECTED[form]
    Barrier(r, keys).configure()
    e = HttpEngine(
        "e0", redis_url=redis_url, deployment=keys.deployment, port=0, params=PARAMS, report_as=form
    )
    await e.start()
    try:
        client = openai.AsyncOpenAI(base_url=f"{e.url}/v1", api_key="x", max_retries=0)
        done = await client.completions.create(model="redisbal-sim", prompt="hi", max_tokens=2)
        assert done.choices[0].text
        await client.close()

        def served() -> Snapshot | None:  # a snapshot made after the request ended
            snap = snapshot(r, keys)
            c = snap.engines.get("e0") if snap is not None else None
            return snap if c is not None and (c.running, c.waiting) == (0, 0) else None

        await await_until(lambda: served() is not None, 5.0, "the engine idle again")
        if admitted:
            await await_until(lambda: (s := served()) and s.engines["e0"].admitted == (1,), 5.0)
        if form in TOTAL:  # the one request, finished
            await await_until(lambda: (s := served()) and s.engines["e0"].admitted_total == 1, 5.0)
        snap = served()
        assert snap is not None
        assert (snap.engines["e0"].admitted is not None) == admitted
        assert (snap.engines["e0"].admitted_total is not None) == (form in TOTAL)
        assert running_caps.fetch_sync(r, keys) == ({"e0": 3} if declares else {})
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{e.url}/v1/loads") as resp:
                assert resp.status == (200 if sglang else 404)
                if sglang:
                    body = await resp.json()
                    assert body["loads"][0]["dp_rank"] == 0
                    assert body["loads"][0]["max_running_requests"] == 3
            async with s.get(f"{e.url}/metrics") as resp:
                page = await resp.text()
        assert ("sglang:num_running_reqs" in page) == sglang
        assert ("vllm:num_requests_running" in page) == (not sglang)
    finally:
        await e.stop()
    assert r.hlen(keys.running_caps) == 0  # it left: its cap with it


@pytest.mark.parametrize("form", ["full", "vllm-plugin"])
async def test_the_list_transport_engines_report_as_their_form(
    form: str, r: redis.Redis, redis_url: str, keys: DeploymentKeys
) -> None:
    admitted, declares, _ = EXPECTED[form]
    runner = EngineSimRunner(
        redis_url, keys.deployment, ["e0", "e1"], mode="tick", params=PARAMS, report_as=form
    )
    task = asyncio.create_task(runner.run(duration_s=30.0))
    try:

        def both() -> Snapshot | None:
            snap = snapshot(r, keys)
            return snap if snap is not None and len(snap.engines) == 2 else None

        await await_until(lambda: both() is not None, 10.0, "both engines reported")
        snap = both()
        assert snap is not None
        assert all((c.admitted is not None) == admitted for c in snap.engines.values())
        assert all((c.admitted_total is not None) == (form in TOTAL) for c in snap.engines.values())
        assert running_caps.fetch_sync(r, keys) == ({"e0": 3, "e1": 3} if declares else {})
        assert runner.report_before_step == admitted  # the plugin reports after admission
    finally:
        runner.stop()
        await task


def test_an_aborted_request_never_counts_as_finished_in_the_total() -> None:
    """As vLLM's: finished + waiting + running, an aborted request leaving waiting or
    running without reaching the finished count (the total drifts low by one)."""
    e = HttpEngine(
        "e0", redis_url="redis://localhost:1", deployment="d", port=0, params=PARAMS,
        report_as="vllm-plugin",
    )  # fmt: skip
    m = e.model
    reqs = [SimRequest(i, 0, 2, 0.0) for i in range(4)]
    for req in reqs:
        m.arrive(req, 0.0)
    assert m.admitted_total == 0  # still in the input queue: not taken in yet
    m.begin_step(0.0)
    assert (len(m.running), len(m.waiting), m.admitted_total) == (3, 1, 4)
    e._abort(reqs[0])  # running
    e._abort(reqs[3])  # waiting
    assert m.admitted_total == 2
    t = 0.0
    while m.busy():
        t += 0.01
        m.end_step(t)
        m.begin_step(t)
    assert (m.finished, e.aborted, m.admitted_total) == (2, 2, 2)


def test_an_unknown_form_is_a_one_line_error() -> None:
    with pytest.raises(InvalidArgument, match="report_as must be one of full, vllm-plugin"):
        Feed.of("vllm")
    res = CliRunner().invoke(cli, ["engine-sim", "--report-as", "vllm"])
    assert res.exit_code == 2 and "'vllm' is not one of" in res.output
