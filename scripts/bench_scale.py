#!/usr/bin/env python3
"""What one Redis and one router pay at scale, measured on a real redis-server.

    python scripts/bench_scale.py                          # 64/256/1024 engines x 8/64 routers
    python scripts/bench_scale.py --engines 1024 --subscribers 64 --duration 30
    python scripts/bench_scale.py --redis-url redis://host:6379/0
    python scripts/bench_scale.py --cluster 3 --engines 256 --subscribers 8

For every (engines N, API servers K) it registers N lockstep engines in a fresh
deployment, drives them from ``--drivers`` processes at ``--rate`` steps/s
(scripts/bench_scale_procs.py: every engine reports every step; a driver that
falls behind sends at once), and runs K subscriber processes, each the real
router feed (``AsyncRouter``). After ``--warmup`` s it measures for
``--duration`` s:

- Redis: CPU (INFO cpu, user+sys) per step and per engine-step, server time of
  the report calls (INFO commandstats fcall/evalsha), bytes sent per second
  (INFO stats total_net_output_bytes), pub/sub clients dropped for their output
  buffer;
- each router: report-to-snapshot latency, i.e. from the wall time just before
  the last driver wrote its reports of step S to the time the router's feed got
  the snapshot of step S (one host, one clock: ``time.time()``); with
  ``--independent``, from the wall time just before the call that published a
  snapshot was written to the time the router got it; CPU to parse
  and adopt one snapshot (thread time around ``Snapshot.from_json`` +
  ``apply_snapshot``) and the process's CPU per snapshot (socket reads and RESP
  parsing included), as ms and as % of a core at the snapshot rate it got.

``--nodes`` sends each node's reports (``--batch`` engines) on a connection of its
own, one call per step, as a Reporter per node does, instead of one pipeline
per driver: Redis then pays a read and a write per call. ``--independent`` drives
engines that step on their own (tick mode, the deployment's tick_ms = one period):
nodes each report once per period at a phase of their own, spread over the period,
instead of every engine at the same instant.

No coordinator runs (no forced snapshots; the config sets a long dead_after_ms so
that a starved driver does not expire engines). On a shared host the server it
starts runs at niceness ``--redis-nice`` and the drivers at ``--driver-nice``
(when permitted), as if Redis had its own core: commandstats time is wall time,
inflated whenever redis-server waits for a CPU. Routers get what is left, so on
a small host their latency at large K measures the host, not redisbal.
``--batch N`` sends N engines' reports per lua/report_many.lua call (what
``Reporter`` sends), in ``StepSender`` (scripts/bench_scale_procs.py), the
one place a step is sent.
Routers poll the stored snapshot every ``--poll-s`` (the feed's default 1 s),
which Redis pays as GETs.

At the end it prints a table, fits a cost model over the points (Redis CPU per
step = a + b*N + e*N*K; bytes per snapshot = c + d*N + f*N*K; router adoption
per snapshot likewise), states what one Redis core carries at 50 steps/s, and
writes JSON (``--json``, default docs/plots/bench_scale_real.json).
``--cluster S`` starts a local cluster of S primaries and runs ``--deployments``
deployments of N x K at once, one per primary where possible, with INFO per node.
"""

from __future__ import annotations

import argparse
import itertools
import math
import multiprocessing as mp
import os
import platform
import re
import secrets
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import redis
from bench_scale_model import fit_model, print_model
from bench_scale_procs import DriverJob, Target, driver_main, sink_main, subscriber_main

from redisbal.barrier.operations import Scripts
from redisbal.keys import DeploymentKeys
from redisbal.sim.cluster import ClusterTopology, system_binary
from redisbal.sim.embedded import RedisServer

ROOT = Path(__file__).resolve().parent.parent
CMDS = ("fcall", "evalsha", "publish", "spublish", "get")
# the servers node drivers can reach: their own connections speak plain RESP, no AUTH
NODE_URL = re.compile(r"^redis://[^@/:]+(:\d+)?(/0?)?$")


def percentile(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))]


def nan_median(xs: list[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return statistics.median(xs) if xs else math.nan


def sample(nodes: list[redis.Redis], targets: list[Target]) -> dict[str, Any]:
    """INFO cpu/stats/commandstats of every node and the published version of every
    deployment, at one instant."""
    out: dict[str, Any] = {"t": time.time(), "nodes": [], "versions": {}}
    for c in nodes:
        info = {**c.info("cpu"), **c.info("stats"), **c.info("commandstats")}
        out["nodes"].append(info)
    for tg in targets:
        c = nodes[tg.node]
        out["versions"][tg.deployment] = int(
            c.hget(DeploymentKeys(tg.deployment).meta, "version") or 0
        )
    return out


def node_delta(a: dict[str, Any], b: dict[str, Any], dt: float, steps: int) -> dict[str, Any]:
    cpu = (b["used_cpu_user"] + b["used_cpu_sys"]) - (a["used_cpu_user"] + a["used_cpu_sys"])
    out: dict[str, Any] = {
        "cpu_core": cpu / dt,
        "cpu_ms_per_step": 1000 * cpu / steps if steps else None,
        "net_out_MBps": (b["total_net_output_bytes"] - a["total_net_output_bytes"]) / dt / 1e6,
        "net_in_MBps": (b["total_net_input_bytes"] - a["total_net_input_bytes"]) / dt / 1e6,
        "steps": steps,
        "pubsub_buffer_drops": b.get("client_output_buffer_limit_disconnections", 0)
        - a.get("client_output_buffer_limit_disconnections", 0),
        "commands": {},
    }
    for cmd in CMDS:
        ka = a.get(f"cmdstat_{cmd}", {"calls": 0, "usec": 0})
        kb = b.get(f"cmdstat_{cmd}", {"calls": 0, "usec": 0})
        calls, usec = kb["calls"] - ka["calls"], kb["usec"] - ka["usec"]
        if calls:
            out["commands"][cmd] = {
                "calls_per_s": calls / dt,
                "usec_per_call": usec / calls,
                "ms_per_step": usec / 1000 / steps if steps else None,
            }
    # where a step's Redis CPU goes: the report calls without the publish inside the one
    # that completes the barrier (records, barrier, snapshot JSON), the PUBLISH (fan-out
    # into the subscribers' buffers), and the rest (socket writes, GETs, event loop)
    cmds = out["commands"]
    call = cmds.get("fcall") or cmds.get("evalsha")
    pub = cmds.get("publish") or cmds.get("spublish") or {}
    if call and steps:
        pub_ms = pub.get("ms_per_step") or 0.0
        out["step_ms"] = {
            "reports_ms": call["ms_per_step"] - pub_ms,
            "publish_ms": pub_ms,
            "other_ms": out["cpu_ms_per_step"] - call["ms_per_step"],
        }
    return out


def setup_target(
    c: redis.Redis,
    tg: Target,
    engines: list[str],
    compact_from: int | None = None,
    tick_ms: int | None = None,
) -> None:
    scripts = Scripts(c, DeploymentKeys(tg.deployment), tg.pubcmd)
    cand = secrets.token_hex(8)
    fields = ["dead_after_ms", "120000", "stall_ms", "60000"]
    if compact_from is not None:
        fields += ["compact_from", str(compact_from)]
    if tick_ms is not None:
        fields += ["tick_ms", str(tick_ms)]
    scripts.call("configure", cand, *fields)
    for i in range(0, len(engines), 512):
        scripts.call("register", cand, *engines[i : i + 512])


def router_stats(
    recs: list[tuple[float, float, int, int, float, int]],
    last_send: dict[int, float],
    w0: float,
    w1: float,
    by_version: bool = False,
) -> dict[str, Any]:
    """One router's figures in the window; ``last_send``: the send time of what completed
    each snapshot, by its step (lockstep) or, ``by_version``, by its version."""
    inwin = [r for r in recs if w0 <= r[0] <= w1]
    if by_version:
        sent = [(r[0], r[5]) for r in inwin]
    else:
        sent = [(r[0], r[3] if r[3] >= 0 else -r[3] - 1) for r in inwin]
    lat = [1000 * (t - last_send[s]) for t, s in sent if s in last_send]
    adopted = [r for r in inwin if r[3] >= 0]
    n = len(inwin)
    rate = n / (w1 - w0)
    adopt_ms = 1000 * statistics.fmean(r[1] for r in inwin) if inwin else float("nan")
    proc_ms = 1000 * (inwin[-1][4] - inwin[0][4]) / (n - 1) if n > 1 else float("nan")
    return {
        "snapshots": n,
        "adopted": len(adopted),
        "rate": rate,
        "p50_ms": percentile(lat, 50),
        "p99_ms": percentile(lat, 99),
        "adopt_ms": adopt_ms,
        "adopt_core": adopt_ms * rate / 1000,
        "proc_ms": proc_ms,
        "proc_core": proc_ms * rate / 1000,
        "bytes": statistics.median(r[2] for r in inwin) if inwin else 0,
    }


def driver_jobs(
    tg: Target,
    engines: list[str],
    parts: int,
    adm: int,
    t0: float,
    stop_at: float,
    args: argparse.Namespace,
) -> list[DriverJob]:
    """The drivers' shares of the engines: every parts-th engine (one pipeline), or
    with ``--nodes`` or ``--independent`` every parts-th node of ``--batch`` engines,
    each node with its phase in the period (independent: node i of M at i / M of it;
    lockstep: 0)."""
    if not (args.nodes or args.independent):
        return [
            DriverJob(tg, engines[j::parts], adm, t0, args.rate, stop_at, args.batch, j)
            for j in range(parts)
        ]
    size = args.batch or 1
    nodes = [engines[i : i + size] for i in range(0, len(engines), size)]
    period = 1 / args.rate
    jobs = []
    for j in range(parts):
        mine = range(j, len(nodes), parts)
        job = DriverJob(tg, [e for i in mine for e in nodes[i]], adm, t0, args.rate, stop_at)
        job.batch, job.seed, job.tick = args.batch, j, args.independent
        job.node_phases = [i / len(nodes) * period if args.independent else 0.0 for i in mine]
        jobs.append(job)
    return jobs


def run_point(
    targets: list[Target], node_urls: list[str], n: int, k: int, args: argparse.Namespace
) -> dict[str, Any]:
    ctx = mp.get_context("fork")
    nodes = [redis.Redis.from_url(u, decode_responses=True, socket_timeout=30) for u in node_urls]
    engines = [f"e{i:04d}" for i in range(n)]
    tick_ms = int(1000 / args.rate) if args.independent else None
    for tg in targets:
        setup_target(nodes[tg.node], tg, engines, args.compact_from, tick_ms)
    out, ready, stop = ctx.Queue(), ctx.Queue(), ctx.Event()
    n_routers = k if args.routers is None else min(k, args.routers)
    subs = [
        ctx.Process(target=subscriber_main, args=(tg, i, k, args.poll_s, ready, stop, out))
        for tg in targets
        for i in range(n_routers)
    ]
    sinks = [
        ctx.Process(target=sink_main, args=(tg, k - n_routers, ready, stop, out))
        for tg in targets
        if n_routers < k
    ]
    for p in [*subs, *sinks]:
        p.start()
    for _ in [*subs, *sinks]:
        ready.get(timeout=120)
    t0 = time.time() + 1.0
    w0 = t0 + args.warmup
    w1 = w0 + args.duration
    parts = max(1, min(args.drivers, n))
    adm = 0 if args.no_admitted else k  # the length of every report's admitted list
    drivers = [
        ctx.Process(target=driver_main, args=(job, out))
        for tg in targets
        for job in driver_jobs(tg, engines, parts, adm, t0, w1 + 0.5, args)
    ]
    load0 = os.getloadavg()
    for p in drivers:
        p.start()
        if p.pid is not None:
            renice(p.pid, args.driver_nice)
    time.sleep(max(0.0, w0 - time.time()))
    a = sample(nodes, targets)
    prev = a
    while time.time() < w1 - 0.1:
        time.sleep(min(args.progress_s, max(0.0, w1 - time.time())))
        cur = sample(nodes, targets)
        dt = cur["t"] - prev["t"]
        steps = sum(cur["versions"][d] - prev["versions"][d] for d in cur["versions"])
        nd = [node_delta(x, y, dt, 1) for x, y in zip(prev["nodes"], cur["nodes"], strict=True)]
        print(
            f"  {n:>5} x {k:<3} t={cur['t'] - w0:5.1f}s"
            f"  snapshots/s {steps / dt / len(targets):6.1f}"
            f"  redis cpu {max(x['cpu_core'] for x in nd) * 100:5.1f}%"
            f"  out {sum(x['net_out_MBps'] for x in nd):7.1f} MB/s  load {os.getloadavg()[0]:.1f}",
            file=sys.stderr,
            flush=True,
        )
        prev = cur
    b = sample(nodes, targets)
    load1 = os.getloadavg()
    dt = b["t"] - a["t"]
    results: dict[str, list[dict[str, Any]]] = {"driver": [], "sub": [], "sink": []}
    want = len(drivers)
    while len(results["driver"]) < want:
        kind, dep, payload = out.get(timeout=120)
        results[kind].append({"deployment": dep, **payload})
    time.sleep(0.5)
    stop.set()
    while len(results["sub"]) < len(subs) or len(results["sink"]) < len(sinks):
        kind, dep, payload = out.get(timeout=120)
        results[kind].append({"deployment": dep, **payload})
    for p in [*drivers, *subs, *sinks]:
        p.join(10)
    errors = [r["error"] for rs in results.values() for r in rs if "error" in r]
    if errors:
        raise SystemExit(f"bench_scale: a process failed: {errors[0]}")
    steps_by = {
        tg.deployment: b["versions"][tg.deployment] - a["versions"][tg.deployment] for tg in targets
    }
    per_node = []
    for i, (x, y) in enumerate(zip(a["nodes"], b["nodes"], strict=True)):
        on = sum(steps_by[tg.deployment] for tg in targets if tg.node == i)
        per_node.append(node_delta(x, y, dt, on))
    routers = []
    sends = "publish_times" if args.independent else "send_times"
    for tg in targets:
        last: dict[int, float] = {}
        for d in results["driver"]:
            if d["deployment"] != tg.deployment:
                continue
            for s, t in d[sends].items():
                last[s] = max(last.get(s, 0.0), t)
        for s in results["sub"]:
            if s["deployment"] == tg.deployment:
                routers.append(
                    router_stats(s["records"], last, a["t"], b["t"], by_version=args.independent)
                )
    steps = sum(steps_by.values())
    drv_cpu = sum(d["cpu_s"] for d in results["driver"])
    drv_steps = sum(d["steps"] for d in results["driver"]) / len(drivers) * len(targets)
    point = {
        "engines": n,
        "subscribers": k,
        "real_routers": n_routers,
        "deployments": len(targets),
        "window_s": dt,
        "load_avg": [round(load0[0], 2), round(load1[0], 2)],
        "target_rate": args.rate,
        "snapshots_per_s": steps / dt / len(targets),
        "redis": per_node[0] if len(per_node) == 1 else None,
        "nodes": per_node,
        "redis_cpu_ms_per_engine_step": 1000
        * sum(x["cpu_core"] * dt for x in per_node)
        / max(1, steps * n),
        "snapshot_bytes": statistics.median(r["bytes"] for r in routers),
        "latency_p50_ms": nan_median([r["p50_ms"] for r in routers]),
        "latency_p99_ms_worst_router": max(
            (r["p99_ms"] for r in routers if not math.isnan(r["p99_ms"])), default=math.nan
        ),
        "latency_p99_ms_median_router": nan_median([r["p99_ms"] for r in routers]),
        "routers_without_latency": sum(math.isnan(r["p50_ms"]) for r in routers),
        "router_adopt_ms": statistics.median(r["adopt_ms"] for r in routers),
        "router_adopt_core": statistics.median(r["adopt_core"] for r in routers),
        "router_proc_ms": statistics.median(r["proc_ms"] for r in routers),
        "router_proc_core": statistics.median(r["proc_core"] for r in routers),
        "router_snapshots_per_s_min": min(r["rate"] for r in routers),
        "drivers": len(drivers),
        "driver_cpu_ms_per_engine_step": 1000 * drv_cpu / max(1, drv_steps * n),
        "driver_late_steps": sum(d["late"] for d in results["driver"]),
        "routers": routers,
    }
    for tg in targets:
        nodes[tg.node].delete(*DeploymentKeys(tg.deployment).all_keys())
    for c in nodes:
        c.close()
    return point


def table(points: list[dict[str, Any]]) -> str:
    head = (
        f"{'N x K':>10} {'snap/s':>7} {'redis%':>7} {'ms/step':>8} {'us/eng-st':>9} "
        f"{'fcall us':>8} {'MB/s out':>9} {'KB/snap':>8} {'p50 ms':>7} {'p99 max':>8} "
        f"{'adopt ms':>8} {'adopt%':>7} {'proc%':>6} {'load':>9}"
    )
    lines = [head]
    for p in points:
        for node_i, r in enumerate(p["nodes"]):
            fc = r["commands"].get("fcall") or r["commands"].get("evalsha") or {}
            label = f"{p['engines']} x {p['subscribers']}" + (
                f" n{node_i}" if len(p["nodes"]) > 1 else ""
            )
            lines.append(
                f"{label:>10} {p['snapshots_per_s']:>7.1f} {100 * r['cpu_core']:>7.1f} "
                f"{r['cpu_ms_per_step'] or float('nan'):>8.2f} "
                f"{1000 * p['redis_cpu_ms_per_engine_step']:>9.2f} "
                f"{fc.get('usec_per_call', 0):>8.1f} "
                f"{r['net_out_MBps']:>9.2f} {p['snapshot_bytes'] / 1000:>8.1f} "
                f"{p['latency_p50_ms']:>7.2f} {p['latency_p99_ms_worst_router']:>8.2f} "
                f"{p['router_adopt_ms']:>8.3f} {100 * p['router_adopt_core']:>7.2f} "
                f"{100 * p['router_proc_core']:>6.1f} "
                f"{p['load_avg'][0]:>4.1f}>{p['load_avg'][1]:<4.1f}"
            )
    return "\n".join(lines)


def machine() -> dict[str, Any]:
    model = ""
    with open("/proc/cpuinfo") as f:  # Linux only, like the rest of the tooling
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "kernel": platform.release(),
        "load_avg_start": list(os.getloadavg()),
    }


def renice(pid: int, value: int) -> int | None:
    """Set a process's niceness; None (and a note) when not permitted."""
    try:
        os.setpriority(os.PRIO_PROCESS, pid, value)
    except OSError as exc:
        print(f"bench_scale: could not renice {pid} to {value}: {exc}", file=sys.stderr)
        return None
    return value


def commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def ints(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated whole numbers, got {text!r}"
        ) from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected numbers >= 1, got {text!r}")
    return vals


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--engines", type=ints, default=[64, 256, 1024], help="N values (comma-separated)"
    )
    ap.add_argument(
        "--subscribers", type=ints, default=[8, 64], help="K values: routers per deployment"
    )
    ap.add_argument("--rate", type=float, default=50.0, help="target steps per second")
    ap.add_argument("--duration", type=float, default=15.0, help="measured seconds per point")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds before measuring")
    ap.add_argument("--drivers", type=int, default=2, help="engine driver processes per deployment")
    ap.add_argument("--poll-s", type=float, default=1.0, help="routers' GET of the stored snapshot")
    ap.add_argument("--progress-s", type=float, default=2.0, help="seconds between progress lines")
    ap.add_argument(
        "--redis-nice",
        type=int,
        default=-10,
        help="niceness of the server(s) this script starts: on a shared host Redis runs "
        "first, as it would on its own core (commandstats time is wall time)",
    )
    ap.add_argument("--driver-nice", type=int, default=-5, help="niceness of the driver processes")
    ap.add_argument("--batch", type=int, default=0, help="engines per batched report call")
    ap.add_argument(
        "--nodes",
        action="store_true",
        help="each node of --batch engines on a connection of its own, one call per step "
        "(a Reporter per node), not one pipeline per driver",
    )
    ap.add_argument(
        "--independent",
        action="store_true",
        help="engines that step on their own (tick mode): nodes of --batch engines report "
        "at phases spread over the period, not all at once",
    )
    ap.add_argument(
        "--routers",
        type=int,
        default=None,
        help="of the K subscribers, run this many as real routers (measured) and the rest "
        "as byte sinks (raw subscriptions that read and drop): Redis pays for every one, "
        "this host only for the routers (default: all K are routers)",
    )
    ap.add_argument(
        "--no-admitted",
        action="store_true",
        help="engines send no admitted counts (as the vLLM and SGLang integrations do; "
        "compact snapshots do not carry them)",
    )
    ap.add_argument(
        "--compact-from",
        type=int,
        default=None,
        help="the deployments' compact_from setting (0: compact snapshots at every size; "
        "default: the setting's default)",
    )
    ap.add_argument("--redis-url", default=None, help="use this server (default: start one)")
    ap.add_argument("--cluster", type=int, default=0, help="start a local cluster of S primaries")
    ap.add_argument("--deployments", type=int, default=0, help="deployments at once (cluster)")
    ap.add_argument("--json", default=str(ROOT / "docs/plots/bench_scale_real.json"))
    args = ap.parse_args(argv)
    if args.rate <= 0 or args.duration <= 0 or args.warmup < 0 or args.drivers < 1:
        ap.error("--rate and --duration must be > 0, --warmup >= 0, --drivers >= 1")
    if args.batch < 0 or args.batch > 1024:
        ap.error("--batch must be 0 (one report call per engine) to 1024")
    if args.independent and 1000 % args.rate:
        ap.error("--independent needs a --rate that divides 1000 (the tick is 1000 / rate ms)")
    if (args.nodes or args.independent) and args.redis_url and not NODE_URL.match(args.redis_url):
        ap.error("--nodes and --independent need --redis-url redis://host:port (or /0)")
    if args.cluster and args.redis_url:
        ap.error("--cluster starts its own cluster: give --cluster or --redis-url, not both")
    server: RedisServer | None = None
    cluster: ClusterTopology | None = None
    doc: dict[str, Any] = {
        "benchmark": "bench_scale (real Redis, real router feed)",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": commit(),
        "machine": machine(),
        "args": {k: v for k, v in vars(args).items() if k not in ("json", "redis_url")},
        "points": [],
    }
    try:
        if args.cluster:
            binary = system_binary()
            if not binary:
                ap.error("--cluster needs redis-server and redis-cli (apt-get install redis-tools)")
            cluster = ClusterTopology(binary, n=args.cluster).start()
            doc["redis_nice"] = [
                renice(nd.proc.pid, args.redis_nice) for nd in cluster.nodes if nd.proc
            ]
            node_urls = [f"redis://127.0.0.1:{p}/0" for p in cluster.ports]
            doc["redis_version"] = ".".join(map(str, cluster.version))
        elif args.redis_url:
            node_urls = [args.redis_url]
            with redis.Redis.from_url(args.redis_url, decode_responses=True) as c:
                doc["redis_version"] = c.info("server")["redis_version"]
        else:
            server = RedisServer(tcp=True).start()
            assert server.proc is not None
            doc["redis_nice"] = renice(server.proc.pid, args.redis_nice)
            node_urls = [server.url]
            doc["redis_version"] = ".".join(map(str, server.version))
        for n, k in itertools.product(args.engines, args.subscribers):
            tag = f"scale{n}x{k}-{secrets.token_hex(2)}"
            if cluster is not None:
                count = args.deployments or args.cluster
                names = cluster.deployments_on_distinct_primaries(min(count, args.cluster), tag)
                names += [f"{tag}-x{i}" for i in range(count - len(names))]
                targets = []
                for name in names:
                    node = cluster.node_for_key(DeploymentKeys(name).snapshot)
                    i = cluster.nodes.index(node)
                    targets.append(Target(name, node_urls[i], cluster.url, "SPUBLISH", i))
            else:
                targets = [Target(tag, node_urls[0], node_urls[0], "PUBLISH")]
            print(
                f"point {n} engines x {k} routers ({len(targets)} deployment(s))", file=sys.stderr
            )
            doc["points"].append(run_point(targets, node_urls, n, k, args))
            print(table(doc["points"][-1:]).splitlines()[1], file=sys.stderr, flush=True)
    finally:
        if server is not None:
            server.cleanup()
        if cluster is not None:
            cluster.cleanup()
    doc["model"] = fit_model(doc["points"])
    print(table(doc["points"]))
    print_model(doc["model"])
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json_dump(doc))
    print(f"wrote {args.json}", file=sys.stderr)
    return 0


def json_dump(doc: dict[str, Any]) -> str:
    import json

    return json.dumps(doc, indent=1, default=str) + "\n"


if __name__ == "__main__":
    sys.exit(main())
