"""What the simulated HTTP engines serve to real routers (redisbal.sim.peer_router_endpoints):
vLLM's /tokenize and render endpoints, SGLang's /get_load, /server_info and
/model_info, each in the real engine's format, read with a real aiohttp client from a
real engine (no Redis: the engine only serves)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from redisbal.routing.cache_view import sim_token_ids as token_ids
from redisbal.sim.http_engine import HttpEngine
from redisbal.sim.model import EngineParams

MODEL = "redisbal-sim"
SLOW = EngineParams(running_cap=1, base_step_s=0.05, per_seq_s=0.0, prefill_s=0.0)


@contextlib.asynccontextmanager
async def serving() -> AsyncIterator[HttpEngine]:
    """One engine in the test's own loop (a fixture's loop is the session's)."""
    e = HttpEngine("0", redis_url=None, deployment="peerfmt", port=0, params=SLOW)
    await e.start()
    try:
        yield e
    finally:
        await e.stop(drain_s=2.0)


async def _post(url: str, body: Any) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        return r.status, await r.json(content_type=None)


async def _get(url: str) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        return r.status, await r.json(content_type=None)


async def test_tokenize_in_vllms_format_counts_what_the_engine_charges() -> None:
    async with serving() as engine:
        text = "You are a helpful assistant. " * 5
        status, got = await _post(engine.url + "/tokenize", {"model": MODEL, "prompt": text})
        assert status == 200
        assert set(got) == {"count", "max_model_len", "tokens", "token_strs"}
        assert got["tokens"] == token_ids(text) and got["count"] == len(text) // 4
        # the same count as the usage of a completion of the same prompt
        body = {"model": MODEL, "prompt": text, "max_tokens": 1}
        status, done = await _post(engine.url + "/v1/completions", body)
        assert status == 200 and done["usage"]["prompt_tokens"] == got["count"]
        msgs = [{"role": "system", "content": "abcd" * 3}, {"role": "user", "content": "efgh"}]
        status, chat = await _post(engine.url + "/tokenize", {"model": MODEL, "messages": msgs})
        assert status == 200 and chat["tokens"] == token_ids("abcd" * 3 + "efgh")


async def test_render_endpoints_in_vllms_format() -> None:
    async with serving() as engine:
        body = {"model": MODEL, "prompt": ["first prompt text", "second one"], "max_tokens": 7}
        status, got = await _post(engine.url + "/v1/completions/render", body)
        assert status == 200 and isinstance(got, list) and len(got) == 2
        assert [g["token_ids"] for g in got] == [token_ids(p) for p in body["prompt"]]
        assert got[0]["request_id"].startswith("cmpl-") and got[0]["model"] == MODEL
        assert got[0]["sampling_params"]["max_tokens"] == 7
        msgs = [{"role": "user", "content": "hello there, engine"}]
        status, chat = await _post(
            engine.url + "/v1/chat/completions/render", {"model": MODEL, "messages": msgs}
        )
        assert status == 200 and isinstance(chat, dict)
        assert chat["token_ids"] == token_ids("hello there, engine")
        assert chat["request_id"].startswith("chatcmpl-")
        assert engine.arrived == 0  # rendering generates nothing


@pytest.mark.parametrize(
    ("path", "body", "status", "words"),
    [
        ("/tokenize", {"model": MODEL}, 400, "prompt"),
        ("/tokenize", {"model": "other", "prompt": "x"}, 404, "does not exist"),
        ("/v1/completions/render", {"prompt": 3}, 400, "prompt"),
        ("/v1/completions/render", [1, 2], 400, "JSON object"),
        ("/v1/chat/completions/render", {"messages": []}, 400, "messages"),
    ],
)
async def test_bad_requests_get_one_line_errors(
    path: str, body: Any, status: int, words: str
) -> None:
    async with serving() as engine:
        got_status, got = await _post(engine.url + path, body)
        assert got_status == status
        assert words in got["error"]["message"] and "\n" not in got["error"]["message"]


async def test_malformed_json_is_a_400() -> None:
    async with (
        serving() as engine,
        aiohttp.ClientSession() as s,
        s.post(engine.url + "/tokenize", data=b"{") as r,
    ):
        assert r.status == 400 and "malformed JSON" in (await r.json())["error"]["message"]


async def test_get_load_in_sglangs_format_counts_queued_and_running() -> None:
    async with serving() as engine:
        status, idle = await _get(engine.url + "/get_load")
        assert status == 200
        assert idle == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]
        body = {"model": MODEL, "prompt": "abcd" * 8, "max_tokens": 40, "ignore_eos": True}
        tasks = [asyncio.create_task(_post(engine.url + "/v1/completions", body)) for _ in range(3)]
        try:
            for _ in range(200):  # one slot: one runs, two wait
                _, load = await _get(engine.url + "/get_load")
                if load[0]["num_reqs"] == 3 and load[0]["num_waiting_reqs"] == 2:
                    break
                await asyncio.sleep(0.01)
            assert load[0]["num_reqs"] == 3 and load[0]["num_waiting_reqs"] == 2
            assert load[0]["num_tokens"] >= 8  # the running request's prompt at least
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


@pytest.mark.parametrize("path", ["/server_info", "/get_server_info"])
async def test_server_info_names_the_served_model(path: str) -> None:
    async with serving() as engine:
        status, got = await _get(engine.url + path)
        assert status == 200
        assert got["served_model_name"] == MODEL and got["dp_size"] == 1
        # no model_path: a router would try to fetch a tokenizer of that name from a hub
        assert "model_path" not in got


@pytest.mark.parametrize("path", ["/model_info", "/get_model_info"])
async def test_model_info(path: str) -> None:
    async with serving() as engine:
        status, got = await _get(engine.url + path)
        assert status == 200 and got["is_generation"] is True and "model_path" not in got


async def test_peer_calls_counts_each_route_answered() -> None:
    async with serving() as engine:
        await _get(engine.url + "/get_load")
        await _get(engine.url + "/get_load")
        await _post(engine.url + "/tokenize", {"prompt": "abcd"})
        await _get(engine.url + "/get_server_info")
        status, calls = await _get(engine.url + "/sim/peer_calls")
        assert status == 200
        assert calls == {"/get_load": 2, "/tokenize": 1, "/get_server_info": 1}
