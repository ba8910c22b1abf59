"""engine-sim's injected faults a chaos run needs: a stall mid-stream (each stream sends
its first chunks, then nothing, until the fault ends) and refusals (401/403), on a real
engine over HTTP with the openai client."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import pytest
from support.gateway_stack import FAST, MODEL

from redisbal.sim.http_engine import HttpEngine

pytestmark = pytest.mark.gateway  # (needs the gateway extra's aiohttp)


async def post_fault(url: str, body: dict[str, object]) -> tuple[int, str]:
    async with aiohttp.ClientSession() as s, s.post(url + "/sim/fault", json=body) as r:
        return r.status, await r.text()


async def test_a_stall_after_some_chunks_stops_streams_mid_way_until_it_ends() -> None:
    engine = HttpEngine("e0", redis_url=None, deployment="d", port=0, params=FAST)
    await engine.start()
    client = openai.AsyncOpenAI(base_url=engine.url + "/v1", api_key="x", max_retries=0)
    try:
        assert (await post_fault(engine.url, {"mode": "stall", "after": 3}))[0] == 200
        stream = await client.completions.create(
            model=MODEL, prompt="hi", max_tokens=10, stream=True, extra_body={"ignore_eos": True}
        )
        texts: list[str] = []
        chunks = stream.__aiter__()
        for _ in range(3):  # the first 3 come
            texts.append((await asyncio.wait_for(chunks.__anext__(), 30)).choices[0].text)
        waiting = asyncio.ensure_future(chunks.__anext__())
        done, _ = await asyncio.wait([waiting], timeout=0.5)
        assert not done, "a fourth chunk came during the stall"
        assert engine.model.load == 0  # the model finished it: only the output is held
        assert (await post_fault(engine.url, {"mode": "none"}))[0] == 200
        texts.append((await asyncio.wait_for(waiting, 30)).choices[0].text)
        async for c in chunks:
            texts.extend(ch.text for ch in c.choices)
        assert texts == [f" t{i}" for i in range(10)]
    finally:
        await client.close()
        await engine.stop(drain_s=1)


async def test_a_refusing_engine_answers_its_status_and_bad_fault_bodies_are_refused() -> None:
    engine = HttpEngine("e0", redis_url=None, deployment="d", port=0, params=FAST)
    await engine.start()
    client = openai.AsyncOpenAI(base_url=engine.url + "/v1", api_key="x", max_retries=0)
    try:
        assert (await post_fault(engine.url, {"mode": "status", "status": 401}))[0] == 200
        with pytest.raises(openai.AuthenticationError):
            await client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert (await post_fault(engine.url, {"mode": "status", "status": 403}))[0] == 200
        with pytest.raises(openai.PermissionDeniedError):
            await client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert await post_fault(engine.url, {"mode": "status", "after": 3}) == (
            400,
            '{"error":{"message":"after goes with mode stall only",'
            '"type":"invalid_request_error","code":400},"object":"error"}',
        )
        status, text = await post_fault(engine.url, {"mode": "stall", "after": -1})
        assert status == 400 and "after must be a whole number" in text
        assert (await post_fault(engine.url, {"mode": "none"}))[0] == 200
        out = await client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert out.choices[0].text
    finally:
        await client.close()
        await engine.stop(drain_s=1)
