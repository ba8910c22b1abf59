"""Shared by the gateway tests: real HTTP engines (in the test's loop or as
processes) and gateways in front of them (in the test's loop, or ``redisbal gateway``
as a process), on a real redis-server."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import openai

from redisbal.connection import make_client
from redisbal.gateway.server import Gateway
from redisbal.routing.router import AsyncRouter
from redisbal.sim.http_engine import HttpEngine
from redisbal.sim.model import EngineParams
from support.cli import REDISBAL, scrubbed_env
from support.helpers import await_until
from support.procs import free_port_block

MODEL = "redisbal-sim"
# a KV cache as real engines report one (vLLM's always do), far larger than tests fill
FAST = EngineParams(
    running_cap=64, base_step_s=0.004, per_seq_s=0.0, prefill_s=0.0, kv_capacity_tokens=1 << 20
)


@dataclass
class Stack:
    engines: list[HttpEngine]
    gateways: list[Gateway] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.gateways[0].ports[0]}"

    def router_inflight(self) -> int:
        return sum(
            e.inflight for g in self.gateways for e in g.router.core.known
        )  # the routers' own counts

    def engine_inflight(self) -> int:
        return sum(e.inflight + e.model.load for e in self.engines)


def openai_client(url: str, key: str = "none", **kw: Any) -> openai.AsyncOpenAI:
    """The official client of the gateway at base URL ``url``, without retries (a
    failure shows); ``kw`` go to the client."""
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, **kw)


async def start_gateway(
    redis_url: str, deployment: str, *, client_index: int | str = "auto", **kw: Any
) -> Gateway:
    """A gateway in the test's loop, its router's options (``lease_ttl_s``,
    ``suspect_s``, ``outcomes``, ``hold_s``, ``learn_routes``) taken from ``kw``, the
    rest the Gateway's."""
    held = {"hold_s": kw.pop("hold_s")} if "hold_s" in kw else {}
    router = AsyncRouter(
        redis_url, deployment, client_index, 1 if client_index == "auto" else 2,
        lease_ttl_s=kw.pop("lease_ttl_s", 10.0), suspect_s=kw.pop("suspect_s", 1.0),
        outcomes=kw.pop("outcomes", None), learn_routes=kw.pop("learn_routes", 0), **held,
    )  # fmt: skip
    await router.start(wait=3.0)
    gw = Gateway(router, redis_client=make_client(redis_url, asyncio=True), **kw)
    await gw.start("127.0.0.1", 0)
    return gw


async def stop_gateway(gw: Gateway) -> None:
    await gw.close()
    await gw.router.aclose()
    await gw.redis.aclose()


async def start_engines(
    redis_url: str, deployment: str, n: int, params: EngineParams = FAST, **kw: Any
) -> list[HttpEngine]:
    """``n`` engine-sim HTTP engines ("0".."n-1") in the test's loop, started; ``kw``
    go to each ``HttpEngine``."""
    engines = [
        HttpEngine(str(i), redis_url=redis_url, deployment=deployment, port=0, params=params, **kw)
        for i in range(n)
    ]
    for e in engines:
        await e.start()
    return engines


@contextlib.asynccontextmanager
async def stack(
    redis_url: str, deployment: str, n: int = 2, gateways: int = 1, **gw_kw: Any
) -> AsyncIterator[Stack]:
    engines = await start_engines(redis_url, deployment, n)
    st = Stack(engines)
    try:
        for _ in range(gateways):
            st.gateways.append(await start_gateway(redis_url, deployment, **gw_kw))
        await await_until(lambda: all(len(g.live_engines()) == n for g in st.gateways))
        yield st
    finally:
        for g in st.gateways:
            await stop_gateway(g)
        for e in engines:
            await e.stop()


async def settled(st: Stack) -> None:
    """Every request is finished: in the routers' counts and at the engines."""
    await await_until(lambda: st.router_inflight() == 0 and st.engine_inflight() == 0, 5.0)
    assert all(g.inflight == 0 for g in st.gateways)


def _spawn_engine(redis_url: str, deployment: str, index: int, base: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "redisbal", "engine-sim", "--redis-url", redis_url,
         "--deployment", deployment, "--engines", "1", "--first-id", str(index),
         "--http-port", str(base + index), "--base-step-ms", "4", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


@contextlib.asynccontextmanager
async def process_engines(redis_url: str, deployment: str, n: int) -> AsyncIterator[list[Any]]:
    base = free_port_block(n)
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
            if p.stdout is not None:  # an open pipe warns when collected, in a later test
                p.stdout.close()


@contextlib.asynccontextmanager
async def gateway_process(
    redis_url: str | None,
    deployment: str | None,
    *args: str,
    env: Mapping[str, str] | None = None,
    preexec: Callable[[], None] | None = None,
) -> AsyncIterator[tuple[subprocess.Popen[str], str, list[str]]]:
    """``redisbal gateway ARGS`` as a process on a free port, listening: the process,
    its base URL and its stderr lines up to the "listening" one (the rest stays piped
    for the test to read). Its environment is scrubbed, then given ``redis_url`` and
    ``deployment`` (when not None) and ``env``; killed at the end if still running, and
    its stderr closed."""
    given = {"REDISBAL_REDIS_URL": redis_url, "REDISBAL_DEPLOYMENT": deployment}
    extra = {k: v for k, v in given.items() if v is not None}
    port = free_port_block(1)
    g = subprocess.Popen(
        [REDISBAL, "gateway", "--port", str(port), *args],
        env=scrubbed_env({**extra, **(env or {})}), stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True, preexec_fn=preexec,
    )  # fmt: skip
    lines: list[str] = []
    try:
        assert g.stderr is not None
        while not lines or "listening" not in lines[-1]:
            line = await asyncio.to_thread(g.stderr.readline)
            assert line, "".join(lines)
            lines.append(line)
        yield g, f"http://127.0.0.1:{port}", lines
    finally:
        if g.poll() is None:
            g.kill()
            g.wait()
        if g.stderr is not None:
            g.stderr.close()
