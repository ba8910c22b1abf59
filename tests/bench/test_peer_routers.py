"""The real peer routers against the simulated HTTP engines (opt-in: ``pytest -m peers``).

vllm-router 0.1.17 and sglang-router 0.3.2, as the benchmark installs them
(redisbal.bench.peer_routers; ``REDISBAL_PEER_VENV`` names the venv, default
``~/.cache/redisbal/peer-routers``), in front of two engines: each router's own
/metrics and /workers, and the calls the engines answered, must show that the
router's prefix-aware and load-aware paths run on what engine-sim serves. Skipped,
with the reason, where the pinned routers are not installed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from support.helpers import await_until

from redisbal.bench import peer_routers
from redisbal.sim.http_engine import HttpEngine
from redisbal.sim.model import EngineParams

pytestmark = pytest.mark.peers
MODEL = "redisbal-sim"
FAST = EngineParams(running_cap=8, base_step_s=0.004, per_seq_s=0.0, prefill_s=0.0)


def _exe(router: str) -> Path:
    exe = peer_routers.binary(router)
    if exe is None:
        pytest.skip(
            f"{router} {peer_routers.PINNED[router]} is not installed in "
            f"{peer_routers.default_venv()} "
            "(scripts/gateway_policies.py installs it on first use; or set REDISBAL_PEER_VENV)"
        )
    return exe


@contextlib.asynccontextmanager
async def engines(n: int) -> AsyncIterator[list[HttpEngine]]:
    es = [HttpEngine(str(i), redis_url=None, deployment="x", port=0, params=FAST) for i in range(n)]
    for e in es:
        await e.start()
    try:
        yield es
    finally:
        await asyncio.gather(*(e.stop(drain_s=2.0) for e in es))


@contextlib.asynccontextmanager
async def router(name: str, es: list[HttpEngine], tmp: Path) -> AsyncIterator[Any]:
    port, mport = peer_routers.free_ports(2)
    rp = peer_routers.RouterProcess(
        name, _exe(name.split(":")[0]), port, mport, [e.url for e in es], tmp / "router.log"
    )
    rp.start()
    try:

        def ready() -> bool:
            assert rp.proc is not None and rp.proc.poll() is None, rp.tail()
            return bool(rp.ready())

        await await_until(ready, 30, f"{name} to be ready", 0.2, threaded=True)
        yield rp
    finally:
        await asyncio.to_thread(rp.stop)


async def _send(url: str, prompts: list[str]) -> None:
    async with aiohttp.ClientSession() as s:
        for p in prompts:
            body = {"model": MODEL, "prompt": p, "max_tokens": 2}
            async with s.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()


async def _peer_calls(es: list[HttpEngine]) -> dict[str, int]:
    out: dict[str, int] = {}
    async with aiohttp.ClientSession() as s:
        for e in es:
            async with s.get(e.url + "/sim/peer_calls") as r:
                for k, v in (await r.json()).items():
                    out[k] = out.get(k, 0) + v
    return out


async def test_vllm_router_cache_aware_routes_by_prefix_on_rendered_tokens(
    tmp_path: Path,
) -> None:
    system = "You are a careful assistant who answers briefly. " * 8
    prompts = [system + f"question number {i} about something" for i in range(6)]
    async with engines(2) as es, router("vllm-router:cache_aware", es, tmp_path) as rp:
        await _send(rp.url, prompts)
        await asyncio.to_thread(rp.scrape)
        calls = await _peer_calls(es)
    check = peer_routers.check_paths("vllm-router:cache_aware", [rp], calls, len(prompts))
    assert check["ok"], check
    # a shared prefix: after the first, requests are decided as prefix hits
    assert check["prefix_outcomes"].get("prefix_hit", 0) >= len(prompts) - 1, check
    assert "missing_tokens" not in check["prefix_outcomes"]


async def test_sglang_router_registers_the_model_and_reads_loads(tmp_path: Path) -> None:
    async with engines(2) as es, router("sglang-router:power_of_two", es, tmp_path) as rp:
        await _send(rp.url, ["hello there"] * 4)
        # the router's own view of the workers' loads: read from the engines' /get_load
        async with aiohttp.ClientSession() as s, s.get(rp.url + "/get_loads") as r:
            loads = (await r.json())["workers"]
        await asyncio.to_thread(rp.scrape)
        calls = await _peer_calls(es)
    assert sorted(w["worker"] for w in loads) == sorted(e.url for e in es)
    assert all(w["load"] >= 0 for w in loads), loads  # -1: a load it could not read
    check = peer_routers.check_paths("sglang-router:power_of_two", [rp], calls, 4)
    assert check["ok"], check
    assert check["models"] == [MODEL]


# (the two above check the paths that read more: rendered prefixes, polled loads)
OWN_STATE = [
    n
    for n in peer_routers.NAMES
    if n not in ("vllm-router:cache_aware", "sglang-router:power_of_two")
]


@pytest.mark.parametrize("name", OWN_STATE)
async def test_every_shipped_policy_decides_every_request_itself(name: str, tmp_path: Path) -> None:
    """Each policy the benchmark names is one the router ships and runs as named: its
    own /metrics count a decision of that policy for every request sent."""
    async with engines(2) as es, router(name, es, tmp_path) as rp:
        await _send(rp.url, [f"hello {i}" for i in range(4)])
        await asyncio.to_thread(rp.scrape)
        calls = await _peer_calls(es)
    check = peer_routers.check_paths(name, [rp], calls, 4)
    assert check["ok"], check
