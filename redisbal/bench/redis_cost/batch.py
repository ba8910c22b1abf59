"""``batch``: Redis CPU per engine-step with reports sent as users send them, one per
round trip or batched.

For each N it starts a fresh redis-server (TCP on 127.0.0.1, as a deployment reaches it),
registers N lockstep engines in one deployment per mode and drives them step by step:

- ``a``: every engine on its own connection, one lua/report.lua call per round trip, the
  engines of a step all at once (asyncio): what a Reporter per engine process sends, so
  Redis also pays a read and a write per report;
- ``bB``: lua/report_many.lua, B engines per call, one connection per call (a
  Reporter per process of B engines), the calls of a step all at once.

Each repeat runs every mode once, one after the other on the same server, and measures
Redis CPU (INFO cpu: used_cpu_user + used_cpu_sys) over ``--steps`` steps after a few
warm-up steps. It prints the CPU per engine-step and the ratios bB/a within the repeat,
with the load average: the server shares the host with this driver, so compare ratios
taken in one run, and repeat. The server's idle CPU (cron at hz 10) is printed first:
it is charged to whichever mode runs, in proportion to how long the driver takes.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import redis
import redis.asyncio

from redisbal.barrier.operations import Scripts
from redisbal.bench.redis_cost.common import (
    ADMITTED,
    add_server_option,
    load_average,
    server_binary,
)
from redisbal.keys import DeploymentKeys
from redisbal.reporting.reporter import new_incarnation
from redisbal.sim.embedded import RedisServer

WARMUP_STEPS = 5


def cpu_s(r: redis.Redis) -> float:
    info = r.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


class Mode:
    """One deployment of N engines and its senders: batch 0 is one report call per engine."""

    def __init__(self, url: str, n: int, batch: int, tag: str) -> None:
        self.n, self.batch = n, batch
        self.keys = DeploymentKeys(f"bb-{tag}")
        self.ids = [f"e{i}" for i in range(n)]
        self.incs = [new_incarnation() for _ in range(n)]
        per = batch or 1
        self.groups = [list(range(j, min(j + per, n))) for j in range(0, n, per)]
        # one connection per sender: an engine's reporter, or a batch reporter's
        self.clients = [
            redis.asyncio.Redis.from_url(url, single_connection_client=True) for _ in self.groups
        ]
        self.scripts = [Scripts(c, self.keys) for c in self.clients]
        self.step = 0

    def fields(self, i: int) -> list[str]:
        s = self.step
        return [self.ids[i], "0", str(s), str((i + s) % 5), str(10 + i), "0.4000", ADMITTED,
                self.incs[i], "1"]  # fmt: skip

    async def register(self) -> None:
        for i in self.ids:
            await self.scripts[0].call("register", "ep", i)

    async def run(self, steps: int) -> None:
        for _ in range(steps):
            if self.batch:
                calls = [
                    sc.call("report_many", "ep", len(g), *(f for i in g for f in self.fields(i)))
                    for sc, g in zip(self.scripts, self.groups, strict=True)
                ]
            else:
                calls = [sc.call("report", "ep", *self.fields(g[0])) for sc, g in
                         zip(self.scripts, self.groups, strict=True)]  # fmt: skip
            await asyncio.gather(*calls)
            self.step += 1

    async def close(self) -> None:
        for c in self.clients:
            await c.aclose()


async def bench(binary: str, n: int, batches: list[int], steps: int, repeats: int) -> None:
    with RedisServer(binary, tcp=True) as server:
        r = server.client()
        c0 = cpu_s(r)
        time.sleep(2)
        idle = (cpu_s(r) - c0) / 2
        print(f"\n{n} engines ({binary}): idle Redis CPU {idle * 1e6:.0f} us/s")
        modes = {"a": Mode(server.url, n, 0, f"{n}a")}
        modes.update({f"b{b}": Mode(server.url, n, b, f"{n}b{b}") for b in batches})
        for m in modes.values():
            await m.register()
            await m.run(WARMUP_STEPS)
        ratios: dict[str, list[float]] = {k: [] for k in modes if k != "a"}
        for rep in range(repeats):
            us: dict[str, float] = {}
            walls: dict[str, float] = {}
            for k, m in modes.items():
                c0, t0 = cpu_s(r), time.monotonic()
                await m.run(steps)
                walls[k] = time.monotonic() - t0
                us[k] = (cpu_s(r) - c0) * 1e6 / (steps * n)
            for k in ratios:
                ratios[k].append(us[k] / us["a"])
            load = load_average()
            cells = "  ".join(f"{k} {us[k]:5.1f} us ({walls[k]:.1f} s)" for k in modes)
            rs = "  ".join(f"{k}/a {us[k] / us['a']:.3f}" for k in ratios)
            print(f"  run {rep + 1}: {cells}  |  {rs}  |  load {load:.1f}")
        for k, v in ratios.items():
            spread = f"{min(v):.3f}-{max(v):.3f}"
            print(f"  {k}/a: median {statistics.median(v):.3f}, range {spread} ({len(v)} runs)")
        for m in modes.values():
            await m.close()


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--engines", default="64,256", help="comma-separated engine counts")
    ap.add_argument("--batches", default="8,32", help="comma-separated engines per call")
    ap.add_argument("--steps", type=int, default=200, help="measured steps per mode and run")
    ap.add_argument("--repeats", type=int, default=3)
    add_server_option(ap)


def run(args: argparse.Namespace) -> int:
    binary = server_binary(args.redis_server)
    batches = [int(b) for b in args.batches.split(",")]
    for n in (int(x) for x in args.engines.split(",")):
        asyncio.run(bench(binary, n, batches, args.steps, args.repeats))
    return 0
