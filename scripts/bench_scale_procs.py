"""The processes of scripts/bench_scale.py: engine drivers and router subscribers.

A driver reports the lockstep steps of its share of the engines, paced by a wall
clock shared by every driver (step s is due at ``t0 + s / rate``; a driver that
falls behind sends the next step at once, never skips one). One step of one
driver is one call of ``send_step``: a pipeline of report calls, the path the
library's ``ReportSender`` takes for many engines (``_pipelined``), or batched
report_many calls (``--batch``). It records the wall-clock time
(``time.time()``) just before each step's reports were written to the socket.

A subscriber runs the real router feed (``AsyncRouter``) and records, for every
snapshot the channel delivered (not the periodic GETs): wall-clock receive time,
thread CPU time of the parse and adoption (``Snapshot.from_json`` +
``RouterCore.apply_snapshot`` inside the feed's ``_apply``), the snapshot's size,
its step, and the process CPU so far (socket reads and RESP parsing included).
All processes run on one host, so their ``time.time()`` clocks are one clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import random
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import redis.asyncio

from redisbal.connection import make_client
from redisbal.engine import new_incarnation
from redisbal.keys import DeploymentKeys
from redisbal.router import AsyncRouter
from redisbal.scripts import Scripts

STEP_RE = re.compile(rb'"step":(\d+)')
# (wall time of receipt, parse+adopt thread CPU s, bytes, step (-step-1: not adopted),
# process CPU s)
Record = tuple[float, float, int, int, float]


@dataclass
class Target:
    """One deployment under test: where its drivers send (a node, for a cluster) and
    where its routers subscribe (the cluster URL, for a cluster)."""

    deployment: str
    driver_url: str
    router_url: str
    pubcmd: str  # "PUBLISH", or "SPUBLISH" on a cluster
    node: int = 0  # index of the node that owns its slot


@dataclass
class DriverJob:
    target: Target
    engines: list[str]
    clients: int  # K: length of every engine's admitted list
    t0: float
    rate: float
    stop_at: float
    batch: int = 0
    seed: int = 0
    send_times: dict[int, float] = field(default_factory=dict)


class EngineBlock:
    """The counts of one driver's engines: waiting/running change every step, the
    cumulative admitted counts (one per API server) grow on a rotating sixteenth
    of the engines each step, so that their digits look like a running deployment's."""

    def __init__(self, engines: list[str], clients: int, seed: int) -> None:
        rng = random.Random(seed)
        self.rng = rng
        self.engines = engines
        self.adm = [[rng.randint(1_000, 60_000) for _ in range(clients)] for _ in engines]
        self.adm_text = [",".join(map(str, a)) for a in self.adm]
        self.kv = [f"{rng.random():.4f}" for _ in engines]
        self.turn = 0

    def advance(self) -> None:
        n = len(self.engines)
        for i in range(self.turn % 16, n, 16):
            a = self.adm[i]
            for k in range(len(a)):
                a[k] += self.rng.randint(0, 3)
            self.adm_text[i] = ",".join(map(str, a))
        self.turn += 1


class StepSender:
    """Sends one step's reports for a driver's engines: ``send_step`` is the one path."""

    def __init__(self, job: DriverJob, client: Any) -> None:
        self.job = job
        self.client = client
        self.keys = DeploymentKeys(job.target.deployment)
        self.scripts = Scripts(client, self.keys, job.target.pubcmd)
        self.block = EngineBlock(job.engines, job.clients, job.seed)
        self.incarnation = new_incarnation()
        self.candidate = secrets.token_hex(8)  # the epoch, were the state missing
        self.batch = job.batch  # engines per report_many call (0: one report call each)

    async def probe(self) -> None:
        """One report call outside a pipeline: tells ``Scripts`` whether FCALL works
        (then pipelines carry FCALL) and loads the library if the server lacks it."""
        await self.scripts.call("register", self.candidate, *self.job.engines[:1])

    async def send_step(self, step: int) -> float:
        """Report ``step`` for every engine of this driver; returns the wall time just
        before the reports were written."""
        b, rng = self.block, self.block.rng
        pipe = self.client.pipeline(transaction=False)
        s = str(step)
        fields = []
        for i, eid in enumerate(b.engines):
            waiting, running = rng.randint(0, 12), rng.randint(8, 48)
            fields.append(
                [
                    eid,
                    "0",
                    s,
                    str(waiting),
                    str(running),
                    b.kv[i],
                    b.adm_text[i],
                    self.incarnation,
                    "1",
                ]
            )
        if self.batch:  # lua/report_many.lua: batch engines a call, as BatchReporter sends them
            calls = [
                ("report_many", self.candidate, str(len(chunk)), *(f for e in chunk for f in e))
                for chunk in (fields[j : j + self.batch] for j in range(0, len(fields), self.batch))
            ]
        else:
            calls = [("report", self.candidate, *e) for e in fields]
        for op, *argv in calls:
            queued = self.scripts.call(op, *argv, client=pipe)
            if inspect.iscoroutine(queued):  # EVALSHA (no functions): queued when awaited
                await queued
        sent = time.time()
        await pipe.execute()
        b.advance()
        return sent


async def _drive(job: DriverJob) -> dict[str, Any]:
    client = redis.asyncio.Redis.from_url(job.target.driver_url, socket_timeout=30)
    sender = StepSender(job, client)
    await sender.probe()
    step = 1
    behind = 0
    cpu0 = time.process_time()
    while True:
        due = job.t0 + step / job.rate
        now = time.time()
        if now >= job.stop_at:
            break
        if due > now:
            await asyncio.sleep(due - now)
        else:
            behind += 1
        job.send_times[step] = await sender.send_step(step)
        step += 1
    cpu = time.process_time() - cpu0
    await client.aclose()
    return {"send_times": job.send_times, "cpu_s": cpu, "steps": step - 1, "late": behind}


def driver_main(job: DriverJob, out: Any) -> None:
    """Process entry: drive until ``stop_at``, put the send times on ``out``."""
    try:
        res = asyncio.run(_drive(job))
    except BaseException as exc:  # reported by the parent as one line
        out.put(("driver", job.target.deployment, {"error": f"{type(exc).__name__}: {exc}"}))
        return
    out.put(("driver", job.target.deployment, res))


class MeasuredRouter(AsyncRouter):
    """The real feed, with a record per snapshot pushed on the channel."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.records: list[Record] = []
        self._polling = False

    async def _fetch(self) -> None:
        self._polling = True
        try:
            await super()._fetch()
        finally:
            self._polling = False

    def _apply(self, data: bytes | str | None) -> bool:
        t = time.time()
        c0 = time.thread_time()
        before = self.core.snapshot
        unknown_roster = super()._apply(data)
        cpu = time.thread_time() - c0
        if self._polling or not data:
            return unknown_roster
        # the step of every pushed snapshot, adopted or not: a feed that lags behind the
        # channel adopts the newer one its periodic GET fetched first, and the messages
        # then arrive as old versions; their arrival still counts for latency
        snap = self.core.snapshot
        if snap is not None and snap is not before:
            step = snap.step
        else:
            m = STEP_RE.search(data[:400] if isinstance(data, bytes) else data[:400].encode())
            step = -int(m.group(1)) - 1 if m else -1
        self.records.append((t, cpu, len(data), step, time.process_time()))
        return unknown_roster


async def _subscribe(
    target: Target, index: int, count: int, poll_s: float, ready: Any, stop: Any
) -> list[Record]:
    client = make_client(
        target.router_url, asyncio=True, socket_connect_timeout=2.0, socket_timeout=30.0
    )
    router = MeasuredRouter(
        deployment=target.deployment,
        client=client,
        client_index=index,
        client_count=count,
        poll_s=poll_s,
        stale_after_s=60.0,
    )
    await router.start()
    ready.put(index)
    while not stop.is_set():
        await asyncio.sleep(0.1)
    await router.aclose()
    with contextlib.suppress(Exception):
        await client.aclose()
    return router.records


def subscriber_main(
    target: Target, index: int, count: int, poll_s: float, ready: Any, stop: Any, out: Any
) -> None:
    """Process entry: one router of ``target`` until ``stop``; its records on ``out``."""
    try:
        recs = asyncio.run(_subscribe(target, index, count, poll_s, ready, stop))
    except BaseException as exc:
        ready.put(index)
        out.put(("sub", target.deployment, {"index": index, "error": f"{type(exc).__name__}"}))
        return
    out.put(("sub", target.deployment, {"index": index, "records": recs}))


async def _sinks(target: Target, count: int, ready: Any, stop: Any) -> int:
    """``count`` raw subscriptions to the target's channel that read and drop what comes:
    subscribers Redis pays for like any other, at almost no CPU of this host."""
    url = urlparse(target.driver_url)
    channel = DeploymentKeys(target.deployment).channel
    verb = "SSUBSCRIBE" if target.pubcmd == "SPUBLISH" else "SUBSCRIBE"
    command = f"*2\r\n${len(verb)}\r\n{verb}\r\n${len(channel)}\r\n{channel}\r\n".encode()
    streams = []
    for _ in range(count):
        reader, writer = await asyncio.open_connection(url.hostname, url.port or 6379)
        writer.write(command)
        await writer.drain()
        await reader.readuntil(channel.encode())  # the confirmation names the channel
        streams.append((reader, writer))
    ready.put(-1)
    total = 0

    async def drain(reader: asyncio.StreamReader) -> None:
        nonlocal total
        while chunk := await reader.read(1 << 16):
            total += len(chunk)

    tasks = [asyncio.create_task(drain(r)) for r, _ in streams]
    while not stop.is_set():
        await asyncio.sleep(0.2)
    for t in tasks:
        t.cancel()
    for _, w in streams:
        w.close()
    return total


def sink_main(target: Target, count: int, ready: Any, stop: Any, out: Any) -> None:
    """Process entry: ``count`` byte-sink subscribers of ``target`` until ``stop``."""
    try:
        total = asyncio.run(_sinks(target, count, ready, stop))
    except BaseException as exc:
        ready.put(-1)
        out.put(("sink", target.deployment, {"error": f"{type(exc).__name__}: {exc}"}))
        return
    out.put(("sink", target.deployment, {"bytes": total}))
