"""Real-time runs whose API-server routers live in separate processes."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis

from redisbal.bench.run import Run
from redisbal.bench.scenarios import Arrival, Scenario, make_schedule
from redisbal.bench.vllm import VLLM_POLICIES, baseline_router
from redisbal.errors import SetupFailed
from redisbal.keys import DeploymentKeys
from redisbal.sim.model import SimRequest


def _router_process(
    url: str, deployment: str, policy: str, index: int, sc: Scenario, seed: int, t_base: float
) -> None:
    """Entry point of one API-server process (spawned): see ProcRun."""
    asyncio.run(_router_main(url, deployment, policy, index, sc, seed, t_base))


async def _router_main(
    url: str, deployment: str, policy: str, index: int, sc: Scenario, seed: int, t_base: float
) -> None:
    keys = DeploymentKeys(deployment)
    router = baseline_router(
        url,
        deployment,
        index,
        sc.clients,
        policy,
        random.Random(f"router-{seed}-{index}"),
        compat=policy in VLLM_POLICIES,
    )
    client = aioredis.Redis.from_url(url)
    try:
        await router.start(wait=10.0)
        await client.sadd(keys.key("bench:ready"), index)
        start = None
        deadline = time.monotonic() + 60.0
        while start is None and time.monotonic() < deadline:
            v = await client.get(keys.key("bench:start"))
            if v is not None:
                start = float(v)
            else:
                await asyncio.sleep(0.005)
        if start is None:
            return
        sched = [(k, a) for k, a in enumerate(make_schedule(sc, seed)) if a.client == index]
        decisions: dict[int, Any] = {}
        routed_key, done_key = keys.key("bench:routed"), keys.key(f"bench:done:{index}")
        i, n = 0, len(sched)
        next_stop_check = 0.0
        route_ns = 0
        while time.monotonic() < deadline + 120.0:
            now = time.monotonic() - t_base
            buf = []
            while i < n and start + sched[i][1].t <= now:
                k = sched[i][0]
                t = time.perf_counter_ns()
                d = router.route()
                route_ns += time.perf_counter_ns() - t
                decisions[k] = d
                buf.append(f"{k} {d.engine_id} {now:.6f}")
                i += 1
            pipe = client.pipeline(transaction=False)
            if buf:
                pipe.rpush(routed_key, *buf)
            pipe.lpop(done_key, 1024)
            res = await pipe.execute()
            for rid in res[-1] or []:
                dec = decisions.pop(int(rid), None)
                if dec is not None:
                    router.finished(dec)
            if i >= n and now >= next_stop_check:
                next_stop_check = now + 0.05
                if await client.exists(keys.key("bench:stop")):
                    break
            wait = 0.01 if i >= n else min(0.005, max(0.0, start + sched[i][1].t - now))
            await asyncio.sleep(wait)
        c = router.core.counters
        await client.hset(
            keys.key(f"bench:stats:{index}"),
            mapping={"snapshots": c["snapshots"], "route_ns": route_ns, "routes": c["routes"]},
        )
    finally:
        await router.aclose()
        await client.aclose()


class ProcRun(Run):
    """As Run, but each API server's router runs in its own process (spawned), with its
    own Redis connections; requests travel router -> engines over a Redis list and
    completions back over one list per router (the "RPC" of this simulation)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.procs: list[Any] = []
        self.done_buf: dict[int, list[int]] = {}
        self.routed = 0
        self.aio: Any = None
        self.schedule: list[Arrival] = []

    def _finish(self, req: SimRequest) -> None:
        self.done_buf.setdefault(req.client_index, []).append(req.rid)
        self.done += 1

    async def start_routers(self, n_engines: int) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self.aio = aioredis.Redis.from_url(self.url)
        for i in range(self.sc.clients):
            p = ctx.Process(
                target=_router_process,
                args=(self.url, self.deployment, self.policy, i, self.sc, self.seed, self.t_base),
                daemon=True,
            )
            p.start()
            self.procs.append(p)
        deadline = time.monotonic() + 60.0
        while time.monotonic() < deadline:
            if await self.aio.scard(self.keys.key("bench:ready")) >= self.sc.clients:
                return
            if any(p.exitcode not in (None, 0) for p in self.procs):
                break
            await asyncio.sleep(0.05)
        raise SetupFailed(f"{self.deployment}: router processes did not get ready")

    async def pump(self) -> None:
        """Deliver routed requests to the engines; send completions back."""
        routed_key = self.keys.key("bench:routed")
        while not self.stop:
            pipe = self.aio.pipeline(transaction=False)
            pipe.lpop(routed_key, 4096)
            for ci, rids in self.done_buf.items():
                if rids:
                    pipe.rpush(self.keys.key(f"bench:done:{ci}"), *rids)
            self.done_buf = {}
            res = await pipe.execute()
            for item in res[0] or []:
                k_s, eid, t_s = item.decode().split(" ")
                a = self.schedule[int(k_s)]
                req = SimRequest(
                    int(k_s), a.client, a.output_len, float(t_s), engine_id=eid, group=a.group
                )
                self.requests.append(req)
                self.routed += 1
                self.world.transit[eid] = self.world.transit.get(eid, 0) + 1
                self._deliver(req)
            await asyncio.sleep(0.001)

    async def traffic(self, schedule: Sequence[Arrival], start: float) -> None:
        self.schedule = list(schedule)
        self.tasks.append(asyncio.create_task(self.pump()))
        await self.aio.set(self.keys.key("bench:start"), repr(start))
        last = start + (schedule[-1].t if schedule else 0.0)
        churned = not self.sc.churn
        churn_at = start + (schedule[-1].t / 2 if schedule else 0.0)
        deadline = time.monotonic() + (last - self.now()) + 10.0
        while self.routed < len(schedule) and time.monotonic() < deadline:
            if not churned and self.now() >= churn_at:
                churned = True
                await self.churn()
            await asyncio.sleep(0.005)

    async def finish_traffic(self) -> None:
        """Stop the router processes and collect their counters."""
        if self.aio is None:
            return
        with contextlib.suppress(Exception):
            await self.aio.set(self.keys.key("bench:stop"), "1")
        for p in self.procs:
            await asyncio.to_thread(p.join, 5)
        with contextlib.suppress(Exception):
            for i in range(self.sc.clients):
                st = await self.aio.hgetall(self.keys.key(f"bench:stats:{i}"))
                if st:
                    self.proc_snapshots.append(int(st[b"snapshots"]))
                    self.route_ns += int(st[b"route_ns"])

    async def teardown(self) -> None:
        if self.aio is not None:
            with contextlib.suppress(Exception):
                await self.aio.set(self.keys.key("bench:stop"), "1")
            for p in self.procs:
                await asyncio.to_thread(p.join, 5)
                if p.is_alive():
                    p.terminate()
            with contextlib.suppress(Exception):
                extra = ["routed", "start", "stop", "ready"]
                extra += [f"done:{i}" for i in range(self.sc.clients)]
                extra += [f"stats:{i}" for i in range(self.sc.clients)]
                await self.aio.delete(*(self.keys.key(f"bench:{x}") for x in extra))
            await self.aio.aclose()
        await super().teardown()
