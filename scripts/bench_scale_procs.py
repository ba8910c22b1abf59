"""The processes of scripts/bench_scale.py: engine drivers and router subscribers.

A driver reports the lockstep steps of its share of the engines, paced by a wall
clock shared by every driver (step s is due at ``t0 + s / rate``; a driver that
falls behind sends the next step at once, never skips one). One step of one
driver is one call of ``send_step``: a pipeline of report calls, the path the
library's ``ReportSender`` takes for many engines (``_pipelined``), or batched
report_many calls (``--batch``). It records the wall-clock time
(``time.time()``) just before each step's reports were written to the socket.

With ``--nodes`` a driver's engines form nodes of ``--batch`` engines (one engine
each without it), a node being what one Reporter sends for: each node on a
connection of its own, one call per step, the next after its reply. With
independent engines (``--independent``, which implies nodes: tick mode, the
server tags each report with its tick) every node reports once per period at a
phase of its own, spread evenly over the period across all nodes, so reports
arrive through the step as they do from engines that step on their own; a
driver then records the wall-clock time just before the call that published
each snapshot (its reply names the version) was written.

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

import hiredis
import redis.asyncio

from redisbal.barrier.operations import Scripts, report_reply
from redisbal.connection import make_client
from redisbal.keys import DeploymentKeys
from redisbal.reporting.reporter import new_incarnation
from redisbal.routing.router import AsyncRouter

STEP_RE = re.compile(rb'"step":(\d+)')
VERSION_RE = re.compile(rb'"version":(\d+)')
# (wall time of receipt, parse+adopt thread CPU s, bytes, step (-step-1: not adopted),
# process CPU s, version)
Record = tuple[float, float, int, int, float, int]


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
    # lockstep: step -> wall time its reports were written
    send_times: dict[int, float] = field(default_factory=dict)
    # nodes: each node's phase in the period (s), in the order of its engines in
    # ``engines`` (``batch`` engines a node, one without it); None: one pipeline
    node_phases: list[float] | None = None
    tick: bool = False  # independent engines: tick mode
    # independent engines: version -> wall time the call that published it was written
    publish_times: dict[int, float] = field(default_factory=dict)


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
    """The reports of a driver's engines: ``send_step`` sends one step of all of them in
    one pipeline; ``node_command`` is the call of one node (``--nodes``, ``--independent``)."""

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

    def _fields(self, lo: int, hi: int, step: str) -> list[list[str]]:
        """The report fields of engines lo..hi-1 (report.lua's ARGV after the epoch
        candidate), with new waiting and running counts."""
        b, rng = self.block, self.block.rng
        return [
            [
                b.engines[i],
                "0",
                step,
                str(rng.randint(0, 12)),
                str(rng.randint(8, 48)),
                b.kv[i],
                b.adm_text[i],
                self.incarnation,
                "1",
            ]
            for i in range(lo, hi)
        ]

    def _calls(self, fields: list[list[str]]) -> list[tuple[str, ...]]:
        """The report calls carrying these reports: ``batch`` a report_many call (as
        a Reporter sends them), or one report call each."""
        if self.batch:
            return [
                ("report_many", self.candidate, str(len(chunk)), *(f for e in chunk for f in e))
                for chunk in (fields[j : j + self.batch] for j in range(0, len(fields), self.batch))
            ]
        return [("report", self.candidate, *e) for e in fields]

    async def send_step(self, step: int) -> float:
        """Report ``step`` for every engine of this driver; returns the wall time just
        before the reports were written."""
        pipe = self.client.pipeline(transaction=False)
        for op, *argv in self._calls(self._fields(0, len(self.block.engines), str(step))):
            queued = self.scripts.call(op, *argv, client=pipe)
            if inspect.iscoroutine(queued):  # EVALSHA (no functions): queued when awaited
                await queued
        sent = time.time()
        await pipe.execute()
        self.block.advance()
        return sent

    def node_command(self, node: int, step: str) -> bytes:
        """The call reporting one node's engines at ``step`` ("tick" in tick mode), as
        RESP: nodes send on connections of their own."""
        size = self.batch or 1
        lo = node * size
        hi = min(lo + size, len(self.block.engines))
        ((op, *argv),) = self._calls(self._fields(lo, hi, step))
        words = [b"FCALL", *(str(w).encode() for w in self.scripts.fcall_args(op, *argv))]
        out = [b"*%d\r\n" % len(words)]
        for w in words:
            out.append(b"$%d\r\n%s\r\n" % (len(w), w))
        return b"".join(out)


async def _node_loop(
    job: DriverJob, sender: StepSender, node: int, phase: float, url: str
) -> tuple[int, int]:
    """One node: its own connection (as its Reporter has), one report call per
    period at its phase, the next only after the reply (a node behind sends the next
    step at once, never skips one). Returns (calls, calls sent more than a period late:
    independent nodes are always a little late, so only those count)."""
    host = urlparse(url)  # redis://host:port only (bench_scale checks it)
    reader, writer = await asyncio.open_connection(host.hostname, host.port or 6379)
    parser = hiredis.Reader()
    period = 1 / job.rate
    calls = late = 0
    while (due := job.t0 + phase + calls * period) < job.stop_at:
        wait = due - time.time()
        if wait > 0:
            await asyncio.sleep(wait)
        elif wait < -period:
            late += 1
        step = "tick" if job.tick else str(calls + 1)
        command = sender.node_command(node, step)
        sent = time.time()
        if not job.tick:  # the step's last report written, as send_step records it
            job.send_times[calls + 1] = max(job.send_times.get(calls + 1, 0.0), sent)
        writer.write(command)
        reply: Any = False
        while reply is False:
            chunk = await reader.read(1 << 16)
            if not chunk:
                raise ConnectionError("redis closed the connection")
            parser.feed(chunk)
            reply = parser.gets()
        if isinstance(reply, Exception):
            raise reply
        replies = [report_reply(r) for r in (reply if sender.batch else [reply])]
        refused = [r[0] for r in replies if r[0] != "accepted"]
        if refused:
            raise RuntimeError(f"a report was not accepted: {refused[0]}")
        version = max(r[1] for r in replies)
        if version:
            job.publish_times[version] = sent
        calls += 1
    writer.close()
    return calls, late


async def _drive_nodes(job: DriverJob, sender: StepSender, phases: list[float]) -> tuple[int, int]:
    """Every node on its own (``_node_loop``). Returns (steps, calls sent over a period
    late)."""
    if sender.scripts.mode != "functions":
        raise SystemExit("--nodes and --independent need Redis functions (Redis >= 7)")

    async def grow_admitted() -> None:  # once per period, as send_step does per step
        while time.time() < job.stop_at:
            await asyncio.sleep(1 / job.rate)
            sender.block.advance()

    growing = asyncio.create_task(grow_admitted())
    loops = [
        _node_loop(job, sender, node, phase, job.target.driver_url)
        for node, phase in enumerate(phases)
    ]
    done = await asyncio.gather(*loops)
    growing.cancel()
    return max(c for c, _ in done), sum(late for _, late in done)


async def _drive_steps(job: DriverJob, sender: StepSender) -> tuple[int, int]:
    """Lockstep engines: every step of every engine at once, step s due at t0 + s / rate
    (one behind sends the next at once). Returns (steps, steps sent late)."""
    step = late = 0
    while True:
        due = job.t0 + (step + 1) / job.rate
        now = time.time()
        if now >= job.stop_at:
            return step, late
        if due > now:
            await asyncio.sleep(due - now)
        else:
            late += 1
        step += 1
        job.send_times[step] = await sender.send_step(step)


async def _drive(job: DriverJob) -> dict[str, Any]:
    client = redis.asyncio.Redis.from_url(job.target.driver_url, socket_timeout=30)
    sender = StepSender(job, client)
    await sender.probe()
    cpu0 = time.process_time()
    if job.node_phases is None:
        steps, late = await _drive_steps(job, sender)
    else:
        steps, late = await _drive_nodes(job, sender, job.node_phases)
    cpu = time.process_time() - cpu0
    await client.aclose()
    return {
        "send_times": job.send_times,
        "publish_times": job.publish_times,
        "cpu_s": cpu,
        "steps": steps,
        "late": late,
    }


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
            step, version = snap.step, snap.version
        else:
            head = data[:400] if isinstance(data, bytes) else data[:400].encode()
            m, v = STEP_RE.search(head), VERSION_RE.search(head)
            step = -int(m.group(1)) - 1 if m else -1
            version = int(v.group(1)) if v else -1
        self.records.append((t, cpu, len(data), step, time.process_time(), version))
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
