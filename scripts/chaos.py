#!/usr/bin/env python3
"""Chaos run: every everyday fault, at random (seeded) times and overlapping, under steady
load, on a whole local deployment; reports what happened, as it is.

The stack, all processes on 127.0.0.1: Redis as a primary, a replica and three Sentinels
(clients use a ``redis+sentinel://`` URL), ``--coordinators`` coordinators, ``--engines``
engine-sim HTTP engines (one process each, so one can be SIGKILLed, SIGSTOPped and
restarted; each appends what it did with every request to a ledger file), and
``--gateways`` ``redisbal gateway`` replicas. The load: open-loop Poisson arrivals at
``--rate`` a second of streamed chat completions (the ``openai`` client, no retries) in
multi-turn sessions (a session's turns repeat its history and share its ``user``, the
gateway's session key), spread round-robin over the gateways that are up (this script is
the load balancer in front of them: it stops sending to a gateway when it terminates it
and sends again once its /health answers).

``--router ROUTER:POLICY`` (``vllm-router:power_of_two``, ``sglang-router:cache_aware``,
any of redisbal.bench.peer_routers.NAMES but those on KV events) puts ``--gateways``
replicas of that real peer router (``peer_routers.RouterProcess``: pinned, in a venv of
their own, installed on first use; each with every engine's URL as its workers and its
own defaults) in place of the gateways, with the same engines, load and seeded faults.
The rest of the stack stays as it is (the engines still report to Redis), so Redis and
coordinator faults still happen at their times, but nothing in front of the engines
reads what they hit: they are reported n/a, and so are the access-log checks (the
gateways' log). ``gateway_term`` terminates a router replica and starts it again (sent
to again once its /readiness answers).

The faults (``--faults``; each ``--rounds`` times at random times, overlapping):
engine_kill (SIGKILL, restarted after a while), engine_stop (SIGSTOP, SIGCONT later),
engine_500 (answers 500), engine_stall (streams stop, new ones before their first
byte), engine_midstall (each stream sends 3 chunks, then nothing), engine_refuse
(401 or 403 to everything), gateway_term (SIGTERM, restarted), coordinator_kill
(SIGKILL, restarted), redis_failover (the primary SIGKILLed; Sentinel promotes the
replica; the old primary comes back as a replica), redis_restart (the primary
SIGKILLed and started again at once, empty: a restart without persistence; the
replica resyncs the empty data set). At most 3 engines are faulty at once, one
gateway, one Redis fault.

What it reports (JSON to ``--json``, a table on stdout, progress on stderr):
requests sent, answered and failed, each failure sorted as "in flight at a fault" (it
had reached an engine that was then killed, stopped or stalled, or a gateway that was
then terminated, and was still running at that moment) or "avoidable" (everything
else, by cause and error); per fault: decisions to the faulty engine while it was
faulty (the requests sent after the fault's first second and before its end that reached
it, by its ledger; n/a for a killed one, which reads nothing) and, beside them, the
front ends' own count where their /metrics has one, and the time to
recover (an engine: from its recovery until a request reaches it again; a gateway: from
its restart until it answers one; a coordinator: until the snapshot moves on; Redis:
until a new snapshot holds every engine that is up), against the bound of
docs/RELIABILITY.md; what was left in flight at the end (the gateways'
``redisbal_gateway_inflight`` or the peer routers' own gauge, the engines' own counts);
requests executed twice (a request's id finished by two engines' models) and delivered
twice (an answer the client got that joins two engines' answers: chunks of two answer
ids); the front ends' RSS and open fds over time (/proc); the gateways' JSON access
logs against the client (each
request sends its id as ``X-Request-Id``): exactly one line per request, and the lines'
outcomes adding up to what the client saw (answered, failed by status).

    python scripts/chaos.py --short --json chaos.json     # ~60 s, fewer faults
    nice -n 10 python scripts/chaos.py --json chaos.json  # 10 minutes
    nice -n 10 python scripts/chaos.py --router vllm-router:power_of_two --json peer.json
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import contextvars
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

BIN = os.path.join(os.path.dirname(sys.executable), "redisbal")
MODEL = "redisbal-sim"
ENGINE_FAULTS = (
    "engine_kill",
    "engine_stop",
    "engine_500",
    "engine_stall",
    "engine_midstall",
    "engine_refuse",
)
FAULTS = (*ENGINE_FAULTS, "gateway_term", "coordinator_kill", "redis_failover", "redis_restart")
# The documented recovery bounds (docs/RELIABILITY.md, "Chaos run"), generous on purpose: a
# busy 2-core machine must meet them. Seconds from the fault's end (or its act, for those
# that end at once) until the recovery named in the module docstring.
BOUND_S = {
    **dict.fromkeys(ENGINE_FAULTS, 30.0),
    "gateway_term": 30.0,
    "coordinator_kill": 30.0,
    "redis_failover": 60.0,
    "redis_restart": 60.0,
}
# how long each fault lasts (uniform between), seconds
HOLD_S = {
    "engine_kill": (3.0, 10.0),
    "engine_stop": (3.0, 8.0),
    "engine_500": (5.0, 12.0),
    "engine_stall": (6.0, 15.0),  # (the gateways' idle-read bound is 10 s)
    "engine_midstall": (6.0, 15.0),
    "engine_refuse": (5.0, 12.0),
    "gateway_term": (1.0, 4.0),
    "coordinator_kill": (2.0, 6.0),
    "redis_failover": (0.0, 0.0),
    "redis_restart": (0.0, 0.0),
}
# the faults that cut what is in flight at the engine
STALLING = ("engine_kill", "engine_stop", "engine_stall", "engine_midstall")
MAX_ENGINE_FAULTS = 3
# how long a process may take to answer /health after it starts: eight engines, the
# gateways and the coordinators start at once, and on 2 busy cores an engine took over
# 60 s; a process that exits fails the start at once instead
START_S = 180.0


def log(msg: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get_text(url: str, timeout: float = 2.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return str(r.read().decode())


def post_json(url: str, body: dict[str, Any]) -> None:
    req = urllib.request.Request(
        url, data=orjson.dumps(body), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=5) as r:
        r.read()


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=1) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def wait_for(pred: Any, timeout: float, what: str, every: float = 0.1) -> float:
    """Poll ``pred`` until true; the time it became true (or SystemExit past ``timeout``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return time.time()
        time.sleep(every)
    raise SystemExit(f"chaos: {what} did not happen within {timeout:.0f} s")


# -- the engine child: an engine-sim HTTP engine that keeps a ledger ------------------------------


def engine_main(a: argparse.Namespace) -> None:
    """One engine (``chaos.py engine``) until SIGTERM; its ledger lines: ``time event id``,
    event reach (its HTTP handler read the request, whatever it then answered: a status
    fault's too), arrive (taken in), finish (its model finished it) or abort (its client
    left before the whole answer was sent); a gateway's probe of the engine (a copy of a
    request routed elsewhere) as probe_reach, probe_arrive and so on."""
    from aiohttp import web

    from redisbal.gateway.proxy import PROBE_HEADER
    from redisbal.sim.http_engine import HttpEngine
    from redisbal.sim.model import SimRequest

    PROBE = "probe:"  # a probe's tag, before its request's id

    TAG: contextvars.ContextVar[str | None] = contextvars.ContextVar("chaos_id", default=None)

    class LedgerEngine(HttpEngine):
        def __init__(self, ledger: str, **kw: Any) -> None:
            super().__init__(**kw)
            self._fd = os.open(ledger, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            self._tags: dict[int, str] = {}

        def _note(self, event: str, tag: str) -> None:
            if tag.startswith(PROBE):  # a gateway's probe: a copy of the request, apart
                event, tag = "probe_" + event, tag[len(PROBE) :]
            os.write(self._fd, f"{time.time():.3f} {event} {tag}\n".encode())  # (survives SIGKILL)

        async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
            # the request's id: the body's chaos_id, or its X-Request-Id where the front end
            # rebuilt the body without the fields it does not know (sglang-router does)
            tag = request.headers.get("X-Request-Id")
            with contextlib.suppress(Exception):  # (a bad body: the engine's own to answer)
                body = orjson.loads(await request.read())  # (aiohttp keeps it for the next read)
                if isinstance(body, dict) and isinstance(body.get("chaos_id"), str):
                    tag = body["chaos_id"]
            if tag and request.headers.get(PROBE_HEADER):
                tag = PROBE + tag
            TAG.set(tag)  # (this request's task: _parse runs in it)
            if tag:
                self._note("reach", tag)
            return await super()._generate(request, chat)

        def _parse(self, body: Any, chat: bool) -> Any:
            out = super()._parse(body, chat)
            tag = TAG.get()
            if not isinstance(out, web.Response) and tag:
                self._tags[self._rid + 1] = tag  # the request made next (no await between)
                self._note("arrive", tag)
            return out

        def _on_finish(self, req: SimRequest) -> None:
            super()._on_finish(req)
            tag = self._tags.get(req.rid)
            if tag is not None:
                self._note("finish", tag)

        def _abort(self, req: SimRequest) -> None:
            super()._abort(req)
            tag = self._tags.pop(req.rid, None)
            if tag is not None:
                self._note("abort", tag)

    async def run() -> None:
        engine = LedgerEngine(
            a.ledger,
            engine_id=a.id,
            redis_url=a.redis_url,
            deployment=a.deployment,
            port=a.port,
            seed=a.seed,
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await engine.start()
        await stop.wait()
        await engine.stop(drain_s=5.0)

    asyncio.run(run())


# -- the stack ------------------------------------------------------------------------------------


class Redis:
    """A primary, a replica and three Sentinels (quorum 2) watching service ``chaos``."""

    def __init__(self, workdir: Path) -> None:
        from redisbal.sim.embedded import RedisServer

        self.dir = workdir / "redis"
        self.servers: dict[int, Any] = {}
        p_port, r_port = free_port(), free_port()
        for port, extra in ((p_port, []), (r_port, ["--replicaof", "127.0.0.1", str(p_port)])):
            d = self.dir / str(port)
            d.mkdir(parents=True)
            self.servers[port] = RedisServer(tcp=True, port=port, extra_args=extra, workdir=str(d))
        self.sentinel_ports = [free_port() for _ in range(3)]
        self.sentinels: list[subprocess.Popen[bytes]] = []
        self.p_port = p_port

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/chaos"

    def start(self) -> None:
        from redisbal.sim.embedded import find_redis_server

        for srv in self.servers.values():
            srv.start()
            srv.extra_args = []  # started again, each is what the Sentinels make it
        for port in self.sentinel_ports:
            d = self.dir / f"sentinel-{port}"
            d.mkdir()
            conf = d / "sentinel.conf"
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {d}\nlogfile {d / 'sentinel.log'}\n"
                f"sentinel monitor chaos 127.0.0.1 {self.p_port} 2\n"
                "sentinel down-after-milliseconds chaos 1500\n"
                "sentinel failover-timeout chaos 6000\n"
            )
            self.sentinels.append(
                subprocess.Popen(
                    [find_redis_server(), str(conf), "--sentinel"],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )
        wait_for(self._ready, 60, "Sentinels to see the replica and each other", 0.2)

    def _sentinel(self, port: int) -> Any:
        import redis

        return redis.Redis("127.0.0.1", port, socket_timeout=2, decode_responses=True)

    def _ready(self) -> bool:
        try:
            for port in self.sentinel_ports:
                with self._sentinel(port) as c:
                    m = c.sentinel_master("chaos")
                if int(m["num-other-sentinels"]) < 2 or int(m["num-slaves"]) < 1:
                    return False
        except Exception:
            return False
        return True

    def primary_port(self) -> int:
        for port in self.sentinel_ports:
            with contextlib.suppress(Exception), self._sentinel(port) as c:
                return int(c.sentinel_get_master_addr_by_name("chaos")[1])
        raise SystemExit("chaos: no Sentinel answered")

    def failover(self) -> float:
        """SIGKILL the primary, wait until the replica is promoted and takes writes, start
        the old one again (Sentinel makes it a replica); the time it was killed."""
        old = self.primary_port()
        self.servers[old].kill()
        killed = time.time()

        def promoted() -> bool:
            with contextlib.suppress(Exception):
                port = self.primary_port()
                if port != old:
                    with self.servers[port].client(socket_timeout=1) as c:
                        return bool(c.info("replication")["role"] == "master")
            return False

        wait_for(promoted, 60, "a Sentinel failover", 0.1)
        self._start(old)
        return killed

    def restart_empty(self) -> float:
        """SIGKILL the primary and start it again at once, empty, on the same port, before
        the Sentinels give up on it; the time it was killed."""
        port = self.primary_port()
        self.servers[port].kill()
        killed = time.time()
        self._start(port)
        return killed

    def _start(self, port: int) -> None:
        """Start a server again, empty: without the RDB file a full resync left as a
        replica (it would load that old data set)."""
        srv = self.servers[port]
        for rdb in Path(srv.dir).glob("*.rdb"):
            rdb.unlink()
        srv.start()

    def stop(self) -> None:
        for p in self.sentinels:
            if p.poll() is None:
                p.terminate()
        for p in self.sentinels:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(5)
        for srv in self.servers.values():
            srv.stop()


@dataclass
class Role:
    """One process of the stack that a fault may stop and start again on the same port."""

    name: str
    cmd: list[str]
    logfile: Path
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    up: bool = False  # this script sends to it (gateways) / counts it as serving (engines)
    stopped: bool = False  # SIGSTOPped

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        with self.logfile.open("ab") as out:
            self.proc = subprocess.Popen(
                self.cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def wait_up(self, pred: Any, what: str) -> None:
        """Poll ``pred`` until true, for up to START_S; SystemExit at once if the process
        has exited (with where its log is), or past the bound."""

        def up() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise SystemExit(f"chaos: {what} exited with code {self.proc.returncode} "
                                 f"before it was up; see {self.logfile}")  # fmt: skip
            return bool(pred())

        wait_for(up, START_S, what)

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


@dataclass
class Front(Role):
    """A ``redisbal gateway`` replica: what the load is sent to."""

    def ready(self) -> bool:
        """Ready for the load balancer (this script) to send to it again."""
        return healthy(self.url)

    def inflight(self) -> float:
        """Its requests in flight now (an OSError if it does not answer)."""
        return gauge(get_text(self.url + "/metrics"), "redisbal_gateway_inflight")

    def decisions(self) -> dict[str, float] | None:
        """Its routing decisions so far, by engine id (None: its /metrics has none)."""
        text = get_text(self.url + "/metrics")
        return metric_by_label(text, "redisbal_gateway_decisions_total", "engine")


@dataclass
class PeerFront(Front):
    """A replica of a real peer router (redisbal.bench.peer_routers.RouterProcess) in
    place of a gateway, its workers the engines' URLs."""

    rp: Any = None  # the RouterProcess
    engine_of: dict[str, str] = field(default_factory=dict)  # worker URL -> engine id

    def start(self) -> None:
        self.rp.start()
        self.proc = self.rp.proc

    def ready(self) -> bool:
        return bool(self.rp.serving())

    def inflight(self) -> float:
        return float(self.rp.inflight())

    def decisions(self) -> dict[str, float] | None:
        per = self.rp.decisions()
        return None if per is None else {self.engine_of.get(u, u): v for u, v in per.items()}


class Stack:
    def __init__(self, a: argparse.Namespace, workdir: Path) -> None:
        self.a = a
        self.dir = workdir
        self.redis = Redis(workdir)
        self.deployment = "chaos"
        common = ["--deployment", self.deployment, "--log-level", "warning"]
        url = self.redis.url
        self.coordinators = [
            Role(f"c{i}", [BIN, "coordinator", "--redis-url", url, *common, "--id", f"c{i}"],
                 workdir / f"coordinator-c{i}.log")
            for i in range(a.coordinators)
        ]  # fmt: skip
        self.engines: dict[str, Role] = {}
        for i in range(a.engines):
            eid, port = f"e{i}", free_port()
            self.engines[eid] = Role(
                eid,
                [sys.executable, os.path.abspath(__file__), "engine", "--id", eid,
                 "--port", str(port), "--redis-url", url, "--deployment", self.deployment,
                 "--ledger", str(self.ledger(eid)), "--seed", str(a.seed * 100 + i)],
                workdir / f"engine-{eid}.log", port,
            )  # fmt: skip
        self.peer = a.router != "redisbal"
        self.gateways: list[Front] = []
        for i in range(a.gateways):
            port = free_port()
            if self.peer:
                self.gateways.append(self._peer(f"r{i}", port))
                continue
            self.gateways.append(
                Front(f"g{i}", [BIN, "gateway", "--redis-url", url, *common, "--port", str(port),
                                "--access-log", "json", *a.gateway_args],
                      workdir / f"gateway-g{i}.log", port)
            )  # fmt: skip

    def _peer(self, name: str, port: int) -> PeerFront:
        """A replica of the peer router ``--router`` in front of every engine, with the
        router's defaults (and ``--gateway-args``: its own flags)."""
        from redisbal.bench import peer_routers

        router, _ = peer_routers.split_name(self.a.router)
        exe = peer_routers.binary(router, Path(self.a.routers_venv))
        if exe is None:  # (main installed it)
            raise SystemExit(f"chaos: {router} is not installed in {self.a.routers_venv}")
        engine_of = {e.url: eid for eid, e in self.engines.items()}
        log_path = self.dir / f"router-{name}.log"
        rp = peer_routers.RouterProcess(self.a.router, exe, port, free_port(), list(engine_of),
                                        log_path, args=self.a.gateway_args)  # fmt: skip
        return PeerFront(name, [], log_path, port, rp=rp, engine_of=engine_of)

    def ledger(self, eid: str) -> Path:
        return self.dir / f"ledger-{eid}.txt"

    def start(self) -> None:
        fronts = f"{self.a.router} replicas" if self.peer else "gateways"
        log(f"starting Redis + Sentinel, {len(self.coordinators)} coordinators, "
            f"{len(self.engines)} engines, {len(self.gateways)} {fronts}")  # fmt: skip
        self.redis.start()
        for r in [*self.coordinators, *self.engines.values()]:
            r.start()
        for e in self.engines.values():
            e.wait_up(lambda e=e: healthy(e.url), f"engine {e.name}")
            e.up = True
        for g in self.gateways:
            g.start()
        for g in self.gateways:
            if isinstance(g, PeerFront):  # at first, every engine registered and healthy
                from redisbal.bench.peer_routers import RouterError

                try:
                    g.rp.wait_ready(60)
                except RouterError as exc:
                    raise SystemExit(f"chaos: {exc}") from None
            g.wait_up(g.ready, f"front end {g.name}")
            g.up = True

    def stop(self) -> None:
        for r in [*self.gateways, *self.engines.values(), *self.coordinators]:
            r.stop()
        self.redis.stop()


# -- observing ------------------------------------------------------------------------------------


def metric_by_label(text: str, metric: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    prefix = metric + "{"
    for line in text.splitlines():
        if line.startswith(prefix):
            labels, _, value = line[len(prefix) :].rpartition("} ")
            for part in labels.split(","):
                k, _, v = part.partition("=")
                if k == label:
                    out[v.strip('"')] = out.get(v.strip('"'), 0.0) + float(value)
    return out


def gauge(text: str, metric: str) -> float:
    for line in text.splitlines():
        if line.startswith(metric + " "):
            return float(line.split()[1])
    return 0.0


def proc_figures(pid: int) -> tuple[float, int] | None:
    """A process's RSS in MB and its open fds, from /proc."""
    try:
        with open(f"/proc/{pid}/status") as f:
            rss_kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        return rss_kb / 1024.0, len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, StopIteration):
        return None


class Observer:
    """Samples on a thread: the stored snapshot (every 0.2 s), the front ends' decisions
    per engine by their /metrics (every second; where it counts them) and their RSS and
    fds (every ``proc_every_s``)."""

    def __init__(self, stack: Stack, proc_every_s: float) -> None:
        self.stack = stack
        self.proc_every_s = proc_every_s
        # (time, epoch, version, engine ids) each time the stored snapshot changed
        self.snapshots: list[tuple[float, str, int, frozenset[str]]] = []
        # (time, lease owner, lease valid) every 0.2 s
        self.leases: list[tuple[float, str, bool]] = []
        # (time, front end, decisions per engine)
        self.decisions: list[tuple[float, str, dict[str, float]]] = []
        # front end -> [(seconds from the start, pid, RSS MB, fds)]
        self.procs: dict[str, list[tuple[float, int, float, int]]] = collections.defaultdict(list)
        self._stop = threading.Event()
        self.t0 = time.time()
        self._threads = [
            threading.Thread(target=self._snapshots, daemon=True),
            threading.Thread(target=self._gateways, daemon=True),
        ]

    def start(self) -> Observer:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(10)

    def _snapshots(self) -> None:
        from redisbal.barrier.snapshot import Snapshot
        from redisbal.connection import make_client
        from redisbal.keys import DeploymentKeys

        keys = DeploymentKeys(self.stack.deployment)
        client = make_client(self.stack.redis.url, socket_timeout=1.0, socket_connect_timeout=1.0)
        seen: tuple[str, int] | None = None
        while not self._stop.wait(0.2):
            try:
                raw = client.get(keys.snapshot)
                owner, until = client.hmget(keys.config, "lease_owner", "lease_until_ms")
                sec, usec = client.time()
            except Exception:
                continue
            valid = until is not None and int(until) > sec * 1000 + usec // 1000
            self.leases.append((time.time(), (owner or b"").decode(), valid))
            if not raw:
                continue
            snap = Snapshot.from_json(raw)
            if (snap.epoch, snap.version) != seen:
                seen = (snap.epoch, snap.version)
                self.snapshots.append((time.time(), snap.epoch, snap.version,
                                       frozenset(snap.engines)))  # fmt: skip

    def _gateways(self) -> None:
        next_proc = 0.0
        while not self._stop.wait(1.0):
            now = time.time()
            for g in self.stack.gateways:
                if not g.up:
                    continue
                with contextlib.suppress(OSError, ValueError):
                    per = g.decisions()
                    if per is not None:
                        self.decisions.append((now, g.name, per))
            if now >= next_proc:
                next_proc = now + self.proc_every_s
                for g in self.stack.gateways:
                    if g.proc is not None and g.proc.poll() is None:
                        fig = proc_figures(g.proc.pid)
                        if fig is not None:
                            self.procs[g.name].append(
                                (round(now - self.t0, 1), g.proc.pid, round(fig[0], 1), fig[1])
                            )

    def decisions_to(self, engine: str, t0: float, t1: float) -> int | None:
        """The front ends' decisions for ``engine`` between t0 and t1 by their /metrics (a
        restarted one's counters start from 0 again); None where they count none."""
        if not self.decisions:
            return None
        total = 0.0
        last: dict[str, float] = {}
        for t, g, per in list(self.decisions):
            v = per.get(engine, 0.0)
            prev = last.get(g)
            last[g] = v
            if prev is None or not t0 < t <= t1:
                continue
            total += v - prev if v >= prev else v
        return int(total)

    def snapshot_after(self, t: float, pred: Any) -> float | None:
        for ts, epoch, version, engines in list(self.snapshots):
            if ts > t and pred(epoch, version, engines):
                return ts
        return None


def read_ledgers(stack: Stack) -> dict[str, list[tuple[float, str, str]]]:
    """Every engine's ledger: engine -> [(time, event, request id)]."""
    out: dict[str, list[tuple[float, str, str]]] = {}
    for eid in stack.engines:
        rows = []
        with contextlib.suppress(FileNotFoundError), stack.ledger(eid).open() as f:
            for line in f:
                parts = line.split()
                if len(parts) == 3:
                    rows.append((float(parts[0]), parts[1], parts[2]))
        out[eid] = rows
    return out


# -- the load -------------------------------------------------------------------------------------


@dataclass
class Result:
    rid: str
    gateway: str
    sent: float
    ended: float = 0.0
    ok: bool = False
    error: str = ""
    status: int | None = None
    chunks: int = 0
    answers: int = 0  # engines' answers its chunks came from (their ids): 2 is a splice
    longest_wait: float = 0.0  # the longest wait for a chunk, the first one included


@dataclass
class Session:
    key: str
    messages: list[dict[str, str]] = field(default_factory=list)
    busy: bool = False
    turns: int = 0


class Load:
    def __init__(self, stack: Stack, a: argparse.Namespace) -> None:
        self.stack = stack
        self.a = a
        self.rng = random.Random(a.seed)
        self.results: list[Result] = []
        self.running: set[asyncio.Task[None]] = set()
        self._n = 0
        self._sessions: list[Session] = []

    def _session(self) -> Session:
        idle = [s for s in self._sessions if not s.busy and s.turns < 6]
        if idle and self.rng.random() < 0.7:
            return self.rng.choice(idle)
        s = Session(f"s{len(self._sessions)}")
        system = f"You are assistant {self.rng.randrange(4)}. " * 20  # 4 shared system prompts
        s.messages.append({"role": "system", "content": system})
        self._sessions.append(s)
        return s

    async def run(self, duration: float) -> None:
        import openai

        clients = {
            g.name: openai.AsyncOpenAI(base_url=g.url + "/v1", api_key="x", max_retries=0)
            for g in self.stack.gateways
        }
        t0 = time.monotonic()
        at = 0.0
        rr = 0
        try:
            while True:
                at += self.rng.expovariate(self.a.rate)
                if at >= duration:
                    break
                await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
                up = [g for g in self.stack.gateways if g.up]
                if not up:
                    continue
                rr += 1
                g = up[rr % len(up)]
                task = asyncio.ensure_future(self._one(clients[g.name], g.name, self._session()))
                self.running.add(task)
                task.add_done_callback(self.running.discard)
            if self.running:
                await asyncio.wait(self.running, timeout=self.a.drain_s)
        finally:
            for c in clients.values():
                await c.close()

    async def _one(self, client: Any, gateway: str, s: Session) -> None:
        import openai

        self._n += 1
        r = Result(f"r{self._n}", gateway, time.time())
        self.results.append(r)
        s.busy = True
        s.turns += 1
        s.messages.append({"role": "user", "content": f"Turn {s.turns}: tell me more. " * 8})
        text: list[str] = []
        ids: set[str] = set()
        last = time.monotonic()
        try:
            stream = await client.chat.completions.create(
                model=MODEL,
                messages=s.messages,
                max_tokens=self.rng.randint(16, 64),
                stream=True,
                user=s.key,
                timeout=self.a.request_timeout_s,
                extra_body={"chaos_id": r.rid},
                extra_headers={"X-Request-Id": r.rid},  # its access-log line's id
            )
            async for chunk in stream:
                now = time.monotonic()
                r.longest_wait, last = max(r.longest_wait, now - last), now
                ids.add(chunk.id)
                if chunk.choices:
                    r.chunks += 1
                    text.append(chunk.choices[0].delta.content or "")
                    if chunk.choices[0].finish_reason is not None:
                        r.ok = True
            if not r.ok:
                r.error = "stream ended without a finish"
        except openai.APIStatusError as exc:
            r.status, r.error = exc.status_code, f"{exc.status_code} {str(exc.message)[:60]}"
        except Exception as exc:
            r.error = f"{type(exc).__name__}: {str(exc)[:60]}"
        finally:
            r.ended = time.time()
            r.answers = len(ids)
            if not r.ok:  # (a failed one: the wait for what never came counts)
                r.longest_wait = max(r.longest_wait, time.monotonic() - last)
            s.messages.append({"role": "assistant", "content": "".join(text)})
            s.busy = False


# -- the faults -----------------------------------------------------------------------------------


@dataclass
class Fault:
    kind: str
    at: float  # planned, seconds from the start
    hold: float
    target: str = ""
    started: float = 0.0  # wall times, as done
    ended: float = 0.0
    recovered: float | None = None
    note: str = ""
    applies: bool = True  # False: nothing in front of the engines uses what it hit (n/a)
    decisions: int | None = None  # requests that reached the faulty engine (its ledger)
    front_decisions: int | None = None  # the front ends' decisions to it (their /metrics)

    def row(self, t0: float, obs: Observer) -> dict[str, Any]:
        rec = None if self.recovered is None else round(self.recovered - self.ended, 2)
        return {
            "kind": self.kind,
            "target": self.target,
            "start_s": round(self.started - t0, 1) if self.started else None,
            "end_s": round(self.ended - t0, 1) if self.ended else None,
            "decisions_while_faulty": self.decisions,
            "front_decisions_while_faulty": self.front_decisions,
            "applies": self.applies,
            "recovery_s": rec,
            "bound_s": BOUND_S[self.kind],
            # None: not applicable, neither recovered nor not
            "recovered_in_bound": (rec is not None and rec <= BOUND_S[self.kind])
            if self.applies
            else None,
            "note": self.note,
        }


def plan(a: argparse.Namespace, rng: random.Random) -> list[Fault]:
    kinds = [k for k in a.faults.split(",") for _ in range(a.rounds)]
    lo, hi = a.warmup_s, max(a.warmup_s + 1, a.duration - a.quiet_s)
    out = [Fault(k, rng.uniform(lo, hi), rng.uniform(*HOLD_S[k])) for k in kinds]
    return sorted(out, key=lambda f: f.at)


class Chaos:
    """Runs the planned faults, each on a thread of its own, and measures recoveries."""

    def __init__(self, stack: Stack, obs: Observer, load: Load, faults: list[Fault], t0: float,
                 seed: int) -> None:  # fmt: skip
        self.stack, self.obs, self.load, self.faults, self.t0 = stack, obs, load, faults, t0
        self.rng = random.Random(seed + 1)
        self.lock = threading.Lock()
        self.busy_engines: set[str] = set()
        self.redis_lock = threading.Lock()
        self.gateway_lock = threading.Lock()
        self.threads: list[threading.Thread] = []
        self.errors: list[str] = []
        # why a Redis or coordinator fault is not applicable with a peer router in front
        self.no_redis = (
            f"{stack.a.router} reads no Redis and has no coordinator "
            "(the fault hit only the engines' reporters)"
        )

    def _not_applicable(self, f: Fault) -> bool:
        """With a peer router in front, a Redis or coordinator fault touches nothing
        that routes: marked n/a (and True)."""
        if self.stack.peer:
            f.applies, f.note = False, "; ".join(filter(None, ("n/a: " + self.no_redis, f.note)))
        return self.stack.peer

    def start(self) -> None:
        for f in self.faults:
            t = threading.Thread(target=self._run, args=(f,), daemon=True)
            t.start()
            self.threads.append(t)

    def join(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.1, end - time.monotonic()))

    def active(self) -> list[str]:
        return [f"{f.kind}:{f.target}" for f in self.faults if f.started and not f.ended]

    def _run(self, f: Fault) -> None:
        time.sleep(max(0.0, self.t0 + f.at - time.time()))
        try:
            if f.kind.startswith("engine_"):
                self._engine(f)
            elif f.kind == "gateway_term":
                with self.gateway_lock:
                    self._gateway(f)
            elif f.kind == "coordinator_kill":
                self._coordinator(f)
            else:
                with self.redis_lock:
                    self._redis(f)
        except BaseException as exc:  # (reported, not raised: a thread)
            self.errors.append(f"{f.kind}: {type(exc).__name__}: {exc}")
            f.note = f"harness error: {exc}"

    def _pick_engine(self) -> str:
        while True:
            with self.lock:
                free = [e for e in self.stack.engines if e not in self.busy_engines]
                if len(self.busy_engines) < MAX_ENGINE_FAULTS and free:
                    eid = self.rng.choice(free)
                    self.busy_engines.add(eid)
                    return eid
            time.sleep(0.5)

    def _engine(self, f: Fault) -> None:
        eid = f.target = self._pick_engine()
        e = self.stack.engines[eid]
        try:
            f.started = time.time()
            if f.kind == "engine_kill":
                e.up = False
                e.signal(signal.SIGKILL)
                if e.proc is not None:
                    e.proc.wait(10)
            elif f.kind == "engine_stop":
                e.stopped = True
                e.signal(signal.SIGSTOP)
            elif f.kind == "engine_500":
                post_json(e.url + "/sim/fault", {"mode": "status", "status": 500})
            elif f.kind == "engine_refuse":
                status = self.rng.choice((401, 403))
                f.note = f"status {status}"
                post_json(e.url + "/sim/fault", {"mode": "status", "status": status})
            elif f.kind == "engine_stall":
                post_json(e.url + "/sim/fault", {"mode": "stall"})
            elif f.kind == "engine_midstall":
                post_json(e.url + "/sim/fault", {"mode": "stall", "after": 3})
            log(f"fault {f.kind} on {eid} for {f.hold:.1f} s")
            time.sleep(f.hold)
            if f.kind == "engine_kill":
                e.start()
                e.wait_up(lambda: healthy(e.url), f"engine {eid} back")
                e.up = True
            elif f.kind == "engine_stop":
                e.signal(signal.SIGCONT)
                e.stopped = False
            else:
                post_json(e.url + "/sim/fault", {"mode": "none"})
            f.ended = time.time()
            f.front_decisions = self.obs.decisions_to(eid, f.started + 1.0, f.ended + 1.0)
            log(f"fault {f.kind} on {eid} ended")
        finally:
            with self.lock:
                self.busy_engines.discard(eid)
        f.recovered = self._poll(f, lambda: self._arrived_at(eid, f.ended))

    def _arrived_at(self, eid: str, after: float) -> float | None:
        with contextlib.suppress(FileNotFoundError), self.stack.ledger(eid).open() as fh:
            for line in fh:
                t, event, _ = line.split()
                if event == "arrive" and float(t) > after:
                    return float(t)
        return None

    def _poll(self, f: Fault, check: Any) -> float | None:
        """Poll ``check`` (a time, or None) until the fault's bound plus a margin has passed."""
        deadline = f.ended + BOUND_S[f.kind] + 10.0
        while time.time() < deadline:
            got = check()
            if got is not None:
                return float(got)
            time.sleep(0.25)
        return None

    def _gateway(self, f: Fault) -> None:
        g = self.rng.choice(self.stack.gateways)
        f.target = g.name
        g.up = False  # the load balancer (this script) stops sending to it first
        f.started = time.time()
        g.signal(signal.SIGTERM)
        log(f"fault gateway_term on {g.name}")
        if g.proc is not None:
            try:
                g.proc.wait(60)
            except subprocess.TimeoutExpired:
                f.note = "did not exit within 60 s of SIGTERM; killed"
                g.proc.kill()
                g.proc.wait(5)
            else:
                f.note = f"exit {g.proc.returncode} after {time.time() - f.started:.1f} s"
        time.sleep(f.hold)
        g.start()
        f.ended = time.time()
        g.wait_up(g.ready, f"front end {g.name} back")
        g.up = True

        def answered() -> float | None:
            # (r.ok is set at the finish chunk, r.ended when the stream closes: a
            # request between the two, read from this thread, is not answered yet)
            done = [r.ended for r in list(self.load.results)
                    if r.gateway == g.name and r.ok and r.ended and r.sent >= f.ended]  # fmt: skip
            return min(done) if done else None

        f.recovered = self._poll(f, answered)

    def _coordinator(self, f: Fault) -> None:
        c = self.rng.choice(self.stack.coordinators)
        f.target = c.name
        held = [o for _t, o, valid in self.obs.leases[-1:] if valid]
        f.note = "it held the lease" if held == [c.name] else "a standby"
        f.started = time.time()
        c.signal(signal.SIGKILL)
        log(f"fault coordinator_kill on {c.name} ({f.note})")
        time.sleep(f.hold)
        restarted = time.time()
        c.start()
        f.ended = f.started  # recovery counts from the kill: the other one takes over
        if self._not_applicable(f):
            return

        def held_again() -> float | None:
            for t, owner, valid in list(self.obs.leases):
                if t > f.started and valid and (owner != c.name or t > restarted):
                    return t
            return None

        f.recovered = self._poll(f, held_again)

    def _redis(self, f: Fault) -> None:
        f.target = f"primary :{self.stack.redis.primary_port()}"
        log(f"fault {f.kind}")
        if f.kind == "redis_failover":
            f.started = self.stack.redis.failover()
            f.note = f"new primary :{self.stack.redis.primary_port()}"
        else:
            f.started = self.stack.redis.restart_empty()
        f.ended = f.started
        if self._not_applicable(f):
            return

        def whole(_ep: str, _v: int, engines: frozenset[str]) -> bool:
            serving = {e for e, r in self.stack.engines.items() if r.up and not r.stopped}
            return serving <= engines

        f.recovered = self._poll(f, lambda: self.obs.snapshot_after(f.started, whole))


# -- the report -----------------------------------------------------------------------------------


def classify(
    results: list[Result], faults: list[Fault], ledgers: dict[str, list[tuple[float, str, str]]]
) -> dict[str, Any]:
    arrivals: dict[str, list[tuple[str, float]]] = collections.defaultdict(list)
    reached: dict[str, set[str]] = collections.defaultdict(set)
    for eid, rows in ledgers.items():
        for t, event, rid in rows:
            if event == "arrive":
                arrivals[rid].append((eid, t))
            elif event == "reach":
                reached[rid].add(eid)
    at_fault = 0
    causes: collections.Counter[str] = collections.Counter()
    errors: collections.Counter[str] = collections.Counter()
    failures: list[dict[str, Any]] = []
    t0 = min((r.sent for r in results), default=0.0)
    for r in results:
        if r.ok:
            continue
        errors[r.error[:50]] += 1
        failures.append({"id": r.rid, "gateway": r.gateway, "sent_s": round(r.sent - t0, 2),
                         "ended_s": round(r.ended - t0, 2), "error": r.error,
                         "engines": [e for e, _ in arrivals[r.rid]],
                         "reached": sorted(reached[r.rid])})  # fmt: skip
        hit = False
        for f in faults:
            if not f.started or not r.sent <= f.started <= r.ended:
                continue
            if f.kind in STALLING and any(
                e == f.target and t <= f.started for e, t in arrivals[r.rid]
            ):
                hit = True
            if f.kind == "gateway_term" and r.gateway == f.target:
                hit = True
        failures[-1]["sort"] = "in flight at a fault" if hit else "avoidable"
        if hit:
            at_fault += 1
            continue
        # the engine it reached while that engine was faulty (a status fault answers
        # before the engine takes the request in: its ledger's reach, or its answer, names it)
        touched = {e for e, _ in arrivals[r.rid]} | reached[r.rid]
        cause = "other"
        for f in faults:
            end = f.ended or r.ended
            overlaps = f.started <= r.ended and r.sent <= end + 1
            named = f"engine {f.target}" in r.error
            if f.kind.startswith("engine_") and overlaps and (f.target in touched or named):
                cause = f"at {f.kind}"
                break
            if (
                f.kind.startswith(("redis_", "coordinator_"))
                and f.started <= r.ended
                and r.sent <= (f.recovered or end) + 1
            ):
                cause = f"during {f.kind}"
        failures[-1]["cause"] = cause
        causes[cause] += 1
    failed = sum(1 for r in results if not r.ok)
    return {
        "sent": len(results),
        "answered": sum(1 for r in results if r.ok),
        "failed": failed,
        "in_flight_at_fault": at_fault,
        "avoidable": failed - at_fault,
        "avoidable_by_cause": dict(causes.most_common()),
        "errors": dict(errors.most_common(12)),
        "failures": failures,
        # answered, but a chunk (the first one included) took over 2 s: what a client saw
        "answered_after_a_wait_over_2s": sum(1 for r in results if r.ok and r.longest_wait > 2),
        "longest_wait_answered_s": round(
            max((r.longest_wait for r in results if r.ok), default=0.0), 2
        ),
    }


def reached_while_faulty(
    results: list[Result], ledgers: dict[str, list[tuple[float, str, str]]], faults: list[Fault]
) -> None:
    """Each engine fault's ``decisions``: the requests sent after its first second and
    before its end that reached the faulty engine (its ledger's reach, whenever the engine
    read them: a stopped one reads them at SIGCONT). A killed engine reads nothing: n/a."""
    sent = {r.rid: r.sent for r in results}
    for f in faults:
        if f.kind not in ENGINE_FAULTS or f.kind == "engine_kill" or not f.ended:
            continue
        ids = {
            rid
            for _t, event, rid in ledgers.get(f.target, [])
            if event == "reach" and f.started + 1.0 < sent.get(rid, 0.0) <= f.ended
        }
        f.decisions = len(ids)


def access_lines(stack: Stack) -> dict[str, list[dict[str, Any]]]:
    """The gateways' JSON access-log lines (in their log files, a restarted gateway's
    appended), by request id."""
    out: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for g in stack.gateways:
        with contextlib.suppress(FileNotFoundError), g.logfile.open("rb") as fh:
            for raw in fh:
                if not raw.startswith(b"{"):
                    continue
                with contextlib.suppress(orjson.JSONDecodeError):
                    line = orjson.loads(raw)
                    if isinstance(line, dict) and "id" in line and "outcome" in line:
                        out[str(line["id"])].append({**line, "gateway": g.name})
    return out


def _disagreement(r: Result, line: dict[str, Any]) -> str | None:
    """How the access line of ``r`` contradicts what its client saw, if it does: an
    answer is ``ok`` with 200; an error answer has the client's status; a failure without
    one (a stream that broke, no answer) is not ``ok``."""
    ok = line["outcome"] == "ok"
    if r.ok:
        return None if ok and line["status"] == 200 else "answered, logged failed"
    if ok:
        return "failed, logged ok"
    if r.status is not None and line["status"] != r.status:
        return f"status {r.status}, logged {line['status']}"
    return None


def access_log(results: list[Result], lines: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Each request's access-log lines against what its client saw: exactly one line per
    request (none missing, none twice, none for a request not sent), and the log's
    outcomes adding up to the client's (answered, and failed by status; ``-``: no status,
    a stream that broke or an answer that never came)."""
    sent = {r.rid: r for r in results}
    missing = [r for r in results if r.rid not in lines]
    twice = sorted(rid for rid, ls in lines.items() if len(ls) > 1)
    unknown = sorted(rid for rid in lines if rid not in sent)
    disagree = []
    client_failed: collections.Counter[str] = collections.Counter()
    log_failed: collections.Counter[str] = collections.Counter()
    for r in results:
        if not r.ok:
            client_failed["-" if r.status is None else str(r.status)] += 1
        for line in lines.get(r.rid, []):
            if line["outcome"] != "ok":
                log_failed[f"{line['status']} {line['outcome']}"] += 1
            why = _disagreement(r, line)
            if why is not None:
                keep = ("gateway", "status", "outcome", "error", "engine")
                seen = {k: line.get(k) for k in keep}
                disagree.append({"id": r.rid, "why": why, "client_error": r.error, "line": seen})
    logged_ok = sum(1 for r in results for ln in lines.get(r.rid, []) if ln["outcome"] == "ok")
    return {
        "lines": sum(len(ls) for ls in lines.values()),
        "missing": len(missing),
        "missing_examples": [
            {"id": r.rid, "gateway": r.gateway, "error": r.error} for r in missing[:10]
        ],
        "twice": len(twice),
        "twice_examples": twice[:10],
        "not_sent": len(unknown),
        "client_answered": sum(1 for r in results if r.ok),
        "logged_ok": logged_ok,
        "client_failed_by_status": dict(sorted(client_failed.items())),
        "logged_failed_by_status_outcome": dict(sorted(log_failed.items())),
        "disagree": len(disagree),
        "disagreements": disagree[:10],
    }


def served(
    results: list[Result],
    ledgers: dict[str, list[tuple[float, str, str]]],
    faults: list[Fault],
) -> dict[str, Any]:
    """Executions (an engine's model finished it, by its ledger) and requests executed
    twice; whole answers sent (finished, and the engine saw its client stay to the end)
    and requests sent whole by two engines, one of them to a front end that gave up on it
    as it was written (a race the engine cannot see: its write went into a socket being
    closed); and requests delivered twice, by the client: an answer joining two engines'
    answers (chunks of two answer ids), the one way a request's answer can come twice
    through one HTTP response."""
    finishes: collections.Counter[str] = collections.Counter()
    sent_whole: collections.Counter[str] = collections.Counter()
    probes = 0  # the gateways' probes the engines' models finished (copies: not requests)
    for rows in ledgers.values():
        finished: set[str] = set()
        aborted: set[str] = set()
        for _t, event, rid in rows:
            if event == "probe_finish":
                probes += 1
            elif event == "finish":
                finishes[rid] += 1
                finished.add(rid)
            elif event == "abort":
                aborted.add(rid)
        for rid in finished:
            sent_whole[rid] += 1 if rid not in aborted else 0
    answered = {r.rid for r in results if r.ok}
    # each request executed twice, by the fault of an engine that executed it but whose
    # answer did not go out (its client left) while that engine was faulty
    # (and when: how far into the fault it reached that engine, how soon its model
    # finished it there, and when its front end gave up on it)
    why: collections.Counter[str] = collections.Counter()
    when: list[dict[str, Any]] = []
    twice = {r for r, n in finishes.items() if n > 1}
    for eid, rows in ledgers.items():
        mine = collections.defaultdict(dict)  # rid -> event -> time (the first)
        for t, event, rid in rows:
            if rid in twice:
                mine[rid].setdefault(event, t)
        for rid, ev in mine.items():
            if "abort" not in ev:
                continue
            for f in faults:
                if f.target == eid and f.started <= ev["abort"] <= (f.ended or ev["abort"]) + 1.0:
                    arrived = ev.get("arrive", ev["abort"])
                    when.append({
                        "id": rid, "fault": f.kind, "engine": eid,
                        "reached_into_fault_s": round(arrived - f.started, 2),
                        "finished_after_s": round(ev.get("finish", arrived) - arrived, 2),
                        "given_up_after_s": round(ev["abort"] - arrived, 2),
                    })  # fmt: skip
    for rid in twice:
        kinds = {w["fault"] for w in when if w["id"] == rid}
        why[",".join(sorted(kinds)) or "no engine fault"] += 1
    return {
        "executions": sum(finishes.values()),
        "probe_executions": probes,
        "answered": len(answered),
        "executed_twice": sum(1 for n in finishes.values() if n > 1),
        "executed_twice_by_fault": dict(why.most_common()),
        "executed_twice_when": sorted(when, key=lambda w: (w["engine"], w["id"])),
        "sent_whole_twice": sum(1 for n in sent_whole.values() if n > 1),
        "delivered_twice": sum(1 for r in results if r.answers > 1),
        "answered_not_in_ledgers": len(answered - set(finishes)),
        "executed_not_answered": len(set(finishes) - answered),
    }


def leftovers(stack: Stack, settle_s: float) -> dict[str, Any]:
    """In flight anywhere, polled until nothing is left or ``settle_s`` passed."""
    end = time.monotonic() + settle_s
    while True:
        out: dict[str, Any] = {}
        for g in stack.gateways:
            with contextlib.suppress(OSError):
                out[g.name] = g.inflight()
        for eid, e in stack.engines.items():
            with contextlib.suppress(OSError):
                st = orjson.loads(get_text(e.url + "/sim/state"))
                out[eid] = st["inflight"] + st["running"] + st["queued"]
        if not any(out.values()) or time.monotonic() > end:
            return {"total": sum(out.values()), "by_process": {k: v for k, v in out.items() if v}}
        time.sleep(0.5)


def proc_summary(obs: Observer) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for g, rows in sorted(obs.procs.items()):
        out[g] = {
            "samples": len(rows),
            "rss_mb_first_max_last": [rows[0][2], max(r[2] for r in rows), rows[-1][2]],
            "fds_first_max_last": [rows[0][3], max(r[3] for r in rows), rows[-1][3]],
            "pids": sorted({r[1] for r in rows}),
            "series": rows,
        }
    return out


def _span(xs: list[float]) -> str:
    return f"{min(xs):g}-{max(xs):g}" if min(xs) != max(xs) else f"{xs[0]:g}"


def table(report: dict[str, Any]) -> str:
    q = report["requests"]
    s = report["served"]
    acc = report["access_log"]
    n = report["args"]["gateways"]
    front = report["front_end"]
    twice_by_fault: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for w in s["executed_twice_when"]:
        twice_by_fault[w["fault"]].append(w)
    lines = [
        f"front end: {front} ({n} {'gateways' if front == 'redisbal' else 'replicas'})",
        f"requests: sent {q['sent']}, answered {q['answered']}, failed {q['failed']} "
        f"(in flight at a fault {q['in_flight_at_fault']}, avoidable {q['avoidable']})",
        f"avoidable by cause: {q['avoidable_by_cause']}",
        f"answered after waiting over 2 s for a chunk: {q['answered_after_a_wait_over_2s']} "
        f"(longest {q['longest_wait_answered_s']} s)",
        f"errors: {q['errors']}",
        f"served: executions {s['executions']}, executed twice {s['executed_twice']} "
        f"{s['executed_twice_by_fault'] or ''}, "
        f"sent whole twice {s['sent_whole_twice']}, delivered twice (an answer of two "
        f"engines' answers) {s['delivered_twice']}, executed but not answered "
        f"{s['executed_not_answered']}; probes executed (copies) {s.get('probe_executions', 0)}",
        *(
            f"  executed twice by {kind}: {len(ws)}, reached it "
            f"{_span([w['reached_into_fault_s'] for w in ws])} s into the fault, finished "
            f"there {_span([w['finished_after_s'] for w in ws])} s after, given up "
            f"{_span([w['given_up_after_s'] for w in ws])} s after"
            for kind, ws in sorted(twice_by_fault.items())
        ),
        f"left in flight at the end: {report['left_in_flight']['total']}",
        "access log: n/a (the gateways' access log; a peer router is not checked)"
        if acc is None
        else f"access log: {acc['lines']} lines for {q['sent']} requests: missing "
        f"{acc['missing']}, twice {acc['twice']}, not sent {acc['not_sent']}; ok "
        f"{acc['logged_ok']} (client: answered {acc['client_answered']}); failed "
        f"{acc['logged_failed_by_status_outcome']} (client, by status: "
        f"{acc['client_failed_by_status']}); disagree {acc['disagree']}",
        "",
        "| fault | target | at s | ended s | decisions to it while faulty (its ledger) "
        "| (the front end's /metrics) | recovery s | bound s | note |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def cell(f: dict[str, Any], key: str) -> str:
        if f[key] is not None:
            return str(f[key])
        return "n/a" if f["kind"] in ENGINE_FAULTS else "-"  # (no engine: nothing to count)

    for f in report["faults"]:
        rec = "not recovered" if f["recovery_s"] is None else f["recovery_s"]
        lines.append(
            f"| {f['kind']} | {f['target']} | {f['start_s']} | {f['end_s']} | "
            f"{cell(f, 'decisions_while_faulty')} | {cell(f, 'front_decisions_while_faulty')} | "
            f"{rec if f['applies'] else 'n/a'} | {f['bound_s']} | {f['note']} |"
        )
    lines.append("")
    for g, p in report["gateways_proc"].items():
        lines.append(f"{g}: RSS MB first/max/last {p['rss_mb_first_max_last']}, "
                     f"fds {p['fds_first_max_last']}, pids {p['pids']}")  # fmt: skip
    lines.append(f"checks: {report['checks']}")
    return "\n".join(lines)


def commit() -> str:
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
            cwd=os.path.dirname(os.path.abspath(__file__)),
        ).stdout.strip()  # fmt: skip
    return "unknown"


def run(a: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="redisbal-chaos-"))
    stack = Stack(a, workdir)
    load_avg = [round(os.getloadavg()[0], 2)]
    at_commit = commit()  # (the checkout may move on during a long run)
    rng = random.Random(a.seed)
    faults = plan(a, rng)
    try:
        stack.start()
        obs = Observer(stack, a.proc_every_s).start()
        wait_for(lambda: obs.snapshot_after(0, lambda _e, _v, en: set(stack.engines) <= en),
                 60, "a snapshot with every engine")  # fmt: skip
        t0 = time.time()
        obs.t0 = t0
        load = Load(stack, a)
        chaos = Chaos(stack, obs, load, faults, t0, a.seed)
        chaos.start()
        stop_progress = threading.Event()

        def progress() -> None:
            while not stop_progress.wait(a.progress_s):
                rs = list(load.results)
                ok = sum(1 for r in rs if r.ok)
                done = sum(1 for r in rs if r.ended)
                log(f"{time.time() - t0:5.0f} s: sent {len(rs)}, answered {ok}, "
                    f"failed {done - ok}, in flight {len(rs) - done}; faults now: "
                    f"{', '.join(chaos.active()) or '-'}")  # fmt: skip

        threading.Thread(target=progress, daemon=True).start()
        asyncio.run(load.run(a.duration))
        stop_progress.set()
        log("load done; waiting for the faults to end and recover")
        chaos.join(timeout=max(BOUND_S.values()) + 90.0)
        left = leftovers(stack, a.settle_s)
        obs.stop()
        ledgers = read_ledgers(stack)
        requests = classify(load.results, faults, ledgers)
        srv = served(load.results, ledgers, faults)
        acc = None if stack.peer else access_log(load.results, access_lines(stack))
        reached_while_faulty(load.results, ledgers, faults)
        rows = [f.row(t0, obs) for f in faults]
        report = {
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)),
            "commit": at_commit,
            "command": " ".join(["scripts/chaos.py", *sys.argv[1:]]),
            "machine": {"cores": os.cpu_count(), "load_avg_start_end": load_avg},
            "args": {k: v for k, v in vars(a).items() if k != "cmd"},
            "front_end": a.router,
            "requests": requests,
            "served": srv,
            "faults": rows,
            "left_in_flight": left,
            "access_log": acc,
            "gateways_proc": proc_summary(obs),
            "snapshots_seen": len(obs.snapshots),
            "harness_errors": chaos.errors,
        }
        load_avg.append(round(os.getloadavg()[0], 2))
        report["checks"] = {
            "adds_up": requests["sent"] == requests["answered"] + requests["failed"],
            "none_delivered_twice": srv["delivered_twice"] == 0,
            "none_executed_twice": srv["executed_twice"] == 0,
            "nothing_left_in_flight": left["total"] == 0,
            # (a fault not applicable, None, is neither)
            "every_fault_recovered_in_bound": all(
                r["recovered_in_bound"] is not False for r in rows
            ),
            "no_harness_errors": not chaos.errors,
            # None: n/a (a peer router in front: no access log of ours)
            "one_access_line_each": None
            if acc is None
            else acc["missing"] == acc["twice"] == acc["not_sent"] == 0,
            "access_log_adds_up": None
            if acc is None
            else acc["disagree"] == 0 and acc["logged_ok"] == acc["client_answered"],
        }
        return report
    finally:
        stack.stop()
        if a.keep:
            log(f"logs and ledgers kept in {workdir}")
        else:
            import shutil

            shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "engine":
        ep = argparse.ArgumentParser(prog="chaos.py engine")
        for name in ("--id", "--redis-url", "--deployment", "--ledger"):
            ep.add_argument(name, required=True)
        ep.add_argument("--port", type=int, required=True)
        ep.add_argument("--seed", type=int, default=0)
        engine_main(ep.parse_args(sys.argv[2:]))
        return
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0].replace("\n", " "))
    ap.add_argument("--short", action="store_true",
                    help="about 60 s, every fault once, 2 gateways, a lower rate")  # fmt: skip
    ap.add_argument("--duration", type=float, default=None, help="seconds of load (600; short 60)")
    ap.add_argument("--rate", type=float, default=None, help="requests a second (15; short 8)")
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--gateways", type=int, default=None, help="2-4 (3; short 2)")
    ap.add_argument("--coordinators", type=int, default=2)
    ap.add_argument("--faults", default=",".join(FAULTS), help="comma list of fault kinds")
    ap.add_argument("--rounds", type=int, default=None, help="times each fault (3; short 1)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", default="chaos.json")
    ap.add_argument("--keep", action="store_true", help="keep the logs and ledgers")
    ap.add_argument("--progress-s", type=float, default=10.0)
    ap.add_argument("--proc-every-s", type=float, default=10.0)
    ap.add_argument("--request-timeout-s", type=float, default=120.0)
    ap.add_argument("--drain-s", type=float, default=150.0)
    ap.add_argument("--settle-s", type=float, default=20.0)
    ap.add_argument(
        "--router",
        default="redisbal",
        help="what stands in front of the engines: redisbal (gateways) or a real peer router, "
        "ROUTER:POLICY (vllm-router:power_of_two, sglang-router:cache_aware, ...)",
    )
    ap.add_argument(
        "--routers-venv", default=None, help="the peer routers' venv (installed on first use)"
    )
    ap.add_argument(
        "--gateway-args", default="", help="more flags for every gateway (or peer router replica)"
    )
    a = ap.parse_args()
    a.duration = a.duration or (60.0 if a.short else 600.0)
    a.rate = a.rate or (8.0 if a.short else 15.0)
    a.gateways = a.gateways or (2 if a.short else 3)
    a.rounds = a.rounds or (1 if a.short else 3)
    a.warmup_s, a.quiet_s = (5.0, 20.0) if a.short else (10.0, 60.0)
    a.gateway_args = a.gateway_args.split()
    for k in a.faults.split(","):
        if k not in FAULTS:
            ap.error(f"unknown fault {k!r}; known: {', '.join(FAULTS)}")
    if not 1 <= a.gateways <= 8 or a.engines < MAX_ENGINE_FAULTS + 1 or a.coordinators < 1:
        ap.error("need 1-8 gateways, at least 4 engines and a coordinator")
    if a.rate <= 0 or a.duration <= 0:
        ap.error("--rate and --duration must be positive")
    if a.router != "redisbal":
        from redisbal.bench import peer_routers

        if a.router not in peer_routers.NAMES:
            ap.error(f"--router {a.router!r}: redisbal or one of {', '.join(peer_routers.NAMES)}")
        try:  # (a policy on the engines' KV events: these engines publish none)
            peer_routers.split_name_without_events(a.router)
            venv = peer_routers.install(Path(a.routers_venv) if a.routers_venv else None, log)
        except (peer_routers.RouterError, OSError, subprocess.CalledProcessError) as exc:
            ap.error(f"--router: {exc}")
        a.routers_venv = str(venv)
    report = run(a)
    Path(a.json).write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    print(table(report))


if __name__ == "__main__":
    main()
