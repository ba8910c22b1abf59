"""``core``: the core micro-benchmarks: route() cost, Redis time per report,
report -> snapshot latency, and the router's cost to adopt one snapshot (off the
route() path).

Without --redis-url it starts its own redis-server. Each figure is repeated and
reported as median and best of the repeats, since timings on a shared host
wander; the targets: route() median <= 5 us at 32 engines and <= 15 us at 1024;
Redis server time per report <= 15 us at 64 engines (INFO commandstats,
publishes included; FCALL on Redis 7, EVALSHA on 6.2 or with --no-functions
users); last report -> snapshot at every router p50 <= 2 ms on loopback.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import platform
import random
import statistics
import time
from typing import Any

import redis

from redisbal.barrier.loader import script_source
from redisbal.barrier.operations import Scripts
from redisbal.barrier.snapshot import Rosters, Snapshot
from redisbal.bench.redis_cost.common import (
    add_server_option,
    report_fields,
    start_server,
    usec_per_call,
)
from redisbal.errors import SetupFailed
from redisbal.keys import DeploymentKeys
from redisbal.routing.policies import DEFAULT_POLICY
from redisbal.routing.router_core import RouterCore


def fake_snapshot(n: int, clients: int = 8) -> Snapshot:
    engines = {
        str(i): {
            "wave": 0,
            "step": 1,
            "waiting": i % 7,
            "running": 20 + i % 13,
            "kv": 0.3,
            "t": 1000,
            "adm": [0] * clients,
        }
        for i in range(n)
    }
    doc = {
        "deployment": "b",
        "epoch": "e",
        "version": 1,
        "wave": 0,
        "step": 1,
        "forced": False,
        "laggards": {},
        "gone": {},
        "joining": [],
        "time_ms": 1000,
        "engines": engines,
    }
    return Snapshot.from_json(json.dumps(doc))


def bench_route(
    n: int, policy: str = DEFAULT_POLICY, calls: int = 20000, repeats: int = 5
) -> dict[str, float]:
    """Median ns per route() over many single calls (finished() excluded)."""
    core = RouterCore(0, 8, policy)
    core.apply_snapshot(fake_snapshot(n))
    core.connected = True
    medians = []
    clock = time.perf_counter_ns
    for _ in range(repeats):
        samples = []
        route = core.route
        for _ in range(calls):
            t0 = clock()
            route()
            samples.append(clock() - t0)
        medians.append(statistics.median(samples))
        core.apply_snapshot(fake_snapshot(n))  # keep pending bounded, like a live feed
    return {"median_us": statistics.median(medians) / 1000, "best_us": min(medians) / 1000}


def fake_compact(n: int) -> dict[str, Any]:
    """fake_snapshot's counts in the compact form (docs/DESIGN.md), with its roster."""
    counts: list[Any] = []
    for i in range(n):
        counts += [i % 7, 20 + i % 13, 0.3, 0]
    doc: dict[str, Any] = json.loads(fake_snapshot(n, 0).raw)
    del doc["engines"]
    ids = [str(i) for i in range(n)]
    return doc | {"roster": 1, "ids": ids, "incs": ["-"] * n, "counts": counts}


def changing_counts(n: int, rng: random.Random) -> list[Any]:
    """A compact snapshot's counts as a running deployment's change from step to step:
    queues and running batches, KV usage (4 decimals, as reporters send it) and the
    age of each report at the cut (a few ms)."""
    counts: list[Any] = []
    for _ in range(n):
        waiting = rng.randint(0, 12) if rng.random() < 0.4 else 0
        counts += [waiting, rng.randint(16, 32), round(rng.random(), 4), rng.randint(0, 12)]
    return counts


def bench_adopt(
    n: int,
    policy: str = DEFAULT_POLICY,
    snapshots: int = 2000,
    repeats: int = 5,
    *,
    clients: int = 8,
    compact: bool = False,
    changing: bool = False,
) -> dict[str, float]:
    """Median us for one router to adopt one snapshot: Snapshot.from_json of the
    published bytes plus RouterCore.apply_snapshot (what each pub/sub message costs a
    router, off the route() path, on its feed's thread or event loop). ``clients``:
    the length of every engine's admitted list (full form); ``compact``: the compact
    form, its roster in the first message only, as the channel sends it;
    ``changing``: its counts drawn anew for every version (``changing_counts``), else
    the same in every version."""
    core = RouterCore(0, clients, policy)
    core.connected = True
    rosters = Rosters()
    doc = fake_compact(n) if compact else json.loads(fake_snapshot(n, clients).raw)
    rng = random.Random(1)
    medians = []
    for rep in range(repeats):
        raws = []
        for v in range(snapshots):
            doc["version"] = rep * snapshots + v + 1
            if changing:
                doc["counts"] = changing_counts(n, rng)
            raws.append(json.dumps(doc).encode())
            doc.pop("ids", None), doc.pop("incs", None)
        t0 = time.perf_counter()
        for raw in raws:
            core.apply_snapshot(Snapshot.from_json(raw, rosters))
        medians.append((time.perf_counter() - t0) / snapshots * 1e6)
    return {
        "median_us": statistics.median(medians),
        "best_us": min(medians),
        "bytes": len(raws[-1]),
    }


DELIVERIES = ("pipelined", "at-once", "concurrent", "sequential")


def _report_argv(i: int, step: int) -> tuple[Any, ...]:
    """Engine i's report for a step, as a reporter sends it (after the epoch candidate)."""
    return ("ep", *report_fields(str(i), i, step))


def _server_us(client: redis.Redis) -> float:
    """Server usec per report call (FCALL or EVALSHA) since the last reset."""
    return usec_per_call(client, "fcall", "evalsha")


def bench_report_server_time(
    client: redis.Redis,
    url: str,
    n: int = 64,
    steps: int = 100,
    repeats: int = 7,
    delivery: str = "pipelined",
    functions: bool = True,
) -> dict[str, Any]:
    """Redis server time per report (INFO commandstats, publishes included), with the
    reports of each step delivered four ways:

    - "pipelined": one client sends the step's 64 reports in one pipeline;
    - "at-once": 64 connections, one per engine, each with its report already
      encoded, written one after another in a tight loop before any reply is read
      (as 64 engines on their own hosts send after a lockstep step: the reports
      are in the server's socket buffers together);
    - "concurrent": 64 asyncio connections from one Python process send their
      report at once; this client makes each request in tens of microseconds, so
      the server mostly handles them one by one as they trickle in;
    - "sequential": one client, one report per round trip (the server's caches
      go cold between calls: the worst case).
    ``functions``: FCALL on Redis >= 7 (else EVALSHA, as on 6.2)."""
    per_call = []
    mode = ""
    for rep in range(repeats):
        keys = DeploymentKeys(f"bench{rep}{delivery[0]}{int(functions)}")
        client.delete(*keys.all_keys())
        client.hset(keys.config, "join_grace_ms", 0)
        sc = Scripts(client, keys, use_functions=functions)
        for i in range(n):
            sc.call("register", "ep", str(i))
        mode = sc.mode
        argv = _report_argv
        if delivery == "concurrent":
            per_call.append(asyncio.run(_concurrent(url, keys, n, steps, functions, argv)))
        elif delivery == "at-once":
            per_call.append(_at_once(client, sc, n, steps, argv))
        else:
            client.config_resetstat()
            for s in range(steps):
                if delivery == "pipelined":
                    pipe = client.pipeline(transaction=False)
                    for i in range(n):
                        sc.call("report", *argv(i, s), client=pipe)
                    pipe.execute()
                else:
                    for i in range(n):
                        sc.call("report", *argv(i, s))
            per_call.append(_server_us(client))
        client.delete(*keys.all_keys())
    return {"median_us": statistics.median(per_call), "best_us": min(per_call), "mode": mode}


def _resp(*args: Any) -> bytes:
    """One command in the Redis protocol (RESP2)."""
    parts = [f"*{len(args)}\r\n".encode()]
    for a in args:
        b = a if isinstance(a, bytes) else str(a).encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(parts)


def _at_once(client: redis.Redis, sc: Scripts, n: int, steps: int, argv: Any) -> float:
    """Each step, n sockets (one per engine) write their pre-encoded report back to
    back, then every reply is read; returns the server's usec per report call."""
    import socket

    kw = client.connection_pool.connection_kwargs
    if kw.get("path"):
        conns = [socket.socket(socket.AF_UNIX) for _ in range(n)]
        for c in conns:
            c.connect(kw["path"])
    else:
        conns = [socket.create_connection((kw["host"], kw["port"])) for _ in range(n)]
        for c in conns:
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if kw.get("password"):
        for c in conns:
            c.sendall(
                _resp("AUTH", *([kw["username"]] if kw.get("username") else []), kw["password"])
            )
            c.recv(64)
    keys = sc.keys.script_keys()
    head: tuple[Any, ...]
    if sc.mode == "functions":
        head = ("FCALL", sc.function_name("report"), len(keys), *keys)
    else:
        sha = hashlib.sha1(script_source("report").encode()).hexdigest()
        head = ("EVALSHA", sha, len(keys), *keys)
    base = (sc.keys.deployment, sc.pubcmd)
    sc.call("report", *argv(0, 0))  # loads the script or library if needed
    reqs = [[_resp(*head, *base, *argv(i, s)) for i in range(n)] for s in range(1, steps + 1)]
    client.config_resetstat()
    for step_reqs in reqs:
        for c, req in zip(conns, step_reqs, strict=True):
            c.sendall(req)
        for c in conns:
            buf = b""
            while not buf.endswith(b"\r\n"):
                chunk = c.recv(4096)
                if not chunk:
                    raise SetupFailed("the server closed a connection")
                buf += chunk
            if buf.startswith(b"-"):
                raise SetupFailed(f"report failed: {buf.decode(errors='replace').strip()}")
    us = _server_us(client)
    for c in conns:
        c.close()
    return us


async def _concurrent(
    url: str, keys: DeploymentKeys, n: int, steps: int, functions: bool, argv: Any
) -> float:
    import redis.asyncio as aredis

    conns = [aredis.Redis.from_url(url) for _ in range(n)]
    scripts = [Scripts(c, keys, use_functions=functions) for c in conns]
    await asyncio.gather(*(sc.call("report", *argv(i, 0)) for i, sc in enumerate(scripts)))
    admin = redis.Redis.from_url(url)
    admin.config_resetstat()
    for s in range(1, steps + 1):
        await asyncio.gather(*(sc.call("report", *argv(i, s)) for i, sc in enumerate(scripts)))
    us = _server_us(admin)
    admin.close()
    for c in conns:
        await c.aclose()
    return us


def _router_process(
    url: str, deployment: str, index: int, count: int, ready: Any, out: Any, stop: Any
) -> None:
    """One API-server process: an AsyncRouter that timestamps every snapshot it adopts."""
    from redisbal.routing.router import AsyncRouter

    class TimedRouter(AsyncRouter):
        def _apply(self, data: bytes | str | None) -> bool:
            before = self.core.snapshot
            unknown_roster = super()._apply(data)
            snap = self.core.snapshot
            if snap is not None and snap is not before:
                seen[snap.version] = time.time()
            return unknown_roster

    seen: dict[int, float] = {}

    async def run() -> None:
        router = TimedRouter(url, deployment, index, count, poll_s=5.0)
        await router.start()
        ready.set()
        while not stop.is_set():
            await asyncio.sleep(0.05)
        await router.aclose()

    asyncio.run(run())
    out.put((index, seen))


def bench_latency(url: str, n: int = 32, routers: int = 8, steps: int = 200) -> dict[str, float]:
    """From just before the last engine's report of a step is sent to the moment each
    router process adopts the snapshot it completes (wall clock, one host). Every
    router is its own process, as API servers are."""
    import multiprocessing as mp

    from redisbal.reporting.reporter import Counts, Reporter

    dep = "lat"
    keys = DeploymentKeys(dep)
    admin = redis.Redis.from_url(url)
    admin.delete(*keys.all_keys())
    reps = [Reporter(url, dep, str(i), heartbeat=False) for i in range(n)]
    ctx = mp.get_context("spawn")
    out, stop = ctx.Queue(), ctx.Event()
    readies = [ctx.Event() for _ in range(routers)]
    procs = [
        ctx.Process(target=_router_process, args=(url, dep, i, routers, readies[i], out, stop))
        for i in range(routers)
    ]
    for p in procs:
        p.start()
    for ev in readies:
        ev.wait(30)
    sent: dict[int, float] = {}
    for step in range(steps):
        for rep in reps[:-1]:
            rep.report(Counts(step=step, waiting=1, running=2), wait=True)
        t0 = time.time()
        res = reps[-1].report(Counts(step=step, waiting=1, running=2), wait=True)
        assert res.version, "the last report must publish"
        sent[res.version] = t0
        time.sleep(0.005)
    time.sleep(0.5)
    stop.set()
    seen = dict(out.get(timeout=30) for _ in procs)
    for p in procs:
        p.join(10)
    for rep in reps:
        rep.close(leave=False)
    admin.delete(*keys.all_keys())
    lat = sorted(t - sent[v] for s in seen.values() for v, t in s.items() if v in sent)
    missing = steps * routers - len(lat)
    return {
        "p50_ms": 1000 * lat[len(lat) // 2],
        "p99_ms": 1000 * lat[int(len(lat) * 0.99)],
        "samples": len(lat),
        "missed": missing,
    }


def adopt_only(json_path: str | None) -> int:
    """The default policy adopting full snapshots (8 and 64 admitted counts per
    engine) and compact ones (counts that change per version, and the same counts
    every version), at 32 and 1,024 engines."""
    out: dict[str, Any] = {
        "machine": {"python": platform.python_version(), "platform": platform.platform()}
    }
    for n in (32, 1024):
        snapshots = 2000 if n == 32 else 200
        for form, clients, compact, changing in (
            ("full-8", 8, False, False),
            ("full-64", 64, False, False),
            ("compact", 64, True, True),
            ("compact-same", 64, True, False),  # the same counts every version
        ):
            r = bench_adopt(
                n, snapshots=snapshots, clients=clients, compact=compact, changing=changing
            )
            out[f"adopt_{form}_{n}"] = r
            print(
                f"snapshot adoption, {n:5d} engines, {form:12s}: median {r['median_us']:8.1f} us "
                f"(best repeat {r['best_us']:.1f}), {r['bytes']} bytes; at 50 snapshots/s "
                f"{r['median_us'] * 50 / 1e4:.2f} % of a core",
                flush=True,
            )
    if json_path:
        with open(json_path, "w") as f:
            json.dump(out, f, indent=2)
    return 0


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--redis-url", help="default: start a redis-server")
    ap.add_argument("--json", help="write every figure here")
    add_server_option(ap)
    ap.add_argument(
        "--adopt-only",
        action="store_true",
        help="only snapshot adoption, at 32 and 1,024 engines, full and compact forms",
    )


def run(args: argparse.Namespace) -> int:
    if args.adopt_only:
        return adopt_only(args.json)
    server = None
    url = args.redis_url
    if not url:
        server = start_server(args.redis_server)
        url = server.url
    out: dict[str, Any] = {
        "machine": {"python": platform.python_version(), "platform": platform.platform()}
    }
    try:
        client = redis.Redis.from_url(url)
        out["redis_version"] = client.info("server")["redis_version"]
        for n in (32, 1024):
            for policy in ("redisbal", "vllm-21617"):
                r = bench_route(n, policy)
                out[f"route_{policy}_{n}"] = r
                print(
                    f"route() {policy:11s} {n:5d} engines: median {r['median_us']:.2f} us "
                    f"(best repeat {r['best_us']:.2f})",
                    flush=True,
                )
        for policy in ("redisbal", "vllm-21617", "vllm-latest"):
            r = bench_adopt(32, policy)
            out[f"adopt_{policy}_32"] = r
            print(
                f"snapshot adoption, {policy:11s} 32 engines: median {r['median_us']:.1f} us "
                f"(best repeat {r['best_us']:.1f})",
                flush=True,
            )
        for functions in (True, False):
            for delivery in DELIVERIES:
                rs = bench_report_server_time(client, url, delivery=delivery, functions=functions)
                cmd = "FCALL" if rs["mode"] == "functions" else "EVALSHA"
                out[f"report_server_us_{cmd.lower()}_{delivery}"] = rs
                print(
                    f"report server time, 64 engines, {cmd:7s} {delivery:10s}: "
                    f"median {rs['median_us']:.1f} us (best {rs['best_us']:.1f})",
                    flush=True,
                )
            if rs["mode"] == "scripts":
                break  # Redis 6.2: EVALSHA only
        lat = bench_latency(url)
        out["report_to_snapshot"] = lat
        print(
            f"last report -> snapshot at every router (32 engines, 8 router processes): "
            f"p50 {lat['p50_ms']:.2f} ms, p99 {lat['p99_ms']:.2f} ms ({lat['samples']} samples, "
            f"{lat['missed']} not seen within the run)"
        )
    finally:
        if server is not None:
            server.cleanup()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0
