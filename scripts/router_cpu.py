#!/usr/bin/env python3
"""Router CPU per request with prefix matching on: one redisbal gateway matching prompts
with the engines' cache view against vllm-router's kv_aware, in one interleaved run.

One redis-server, a coordinator and ``--engines`` fast HTTP engine simulators (1 ms
steps, a prefix cache of ``--cache-blocks``), every engine publishing its KV events
(engine-sim ``--kv-events``, vLLM's wire format). In front of the same engines, both
at once:

- **gateway**: one ``redisbal gateway --prefix-tokens sim --access-log off`` (the
  default policy; the cache view kept in Redis by one ``redisbal kv-events`` following
  every engine's publisher);
- **vllm-router**: one vllm-router ``--policy kv_aware`` (redisbal.bench.peer_routers,
  pinned, in its own venv: ``--routers-venv``) subscribing to the same publishers itself.

For each rate the same trace (``session_trace.py prefixes`` or ``agentic``, made here
from the seed: redisbal.bench.prefix_traces) is sent open loop, streamed, through one
target and then the other, ``--reps`` times, the order alternating; a short warm-up
through each first is not counted. Before and after each phase the CPU seconds
(utime + stime, /proc/PID/stat, of the process and its descendants) of every process of
the run are read. A phase's CPU per request is the router's (the gateway's process, or
vllm-router's) over the requests of the phase; ``redisbal kv-events`` is reported apart,
because vllm-router subscribes inside its own process: the fair comparison is gateway +
subscriber against vllm-router, and the gateway alone is given too. Ratios are paired
per repetition (both phases of one repetition run back to back, so that host noise hits
both alike): median and range over repetitions.

Each phase checks that its router routed by cache: some of the gateway's requests
counted in ``redisbal_gateway_cache_routes_total``; vllm-router at full strength, at
least ``FULL_STRENGTH`` of its requests decided by prefix cost, with index lookups that
hit (``vllm_router_kv_placement_lookups_total``). A phase with a failed request or
without cache routing is left out of the tables and fails the run. The whole run's
kv_aware path is also said as scripts/gateway_policies.py says it
(peer_routers.check_paths, which wants every request decided by prefix).

    python scripts/router_cpu.py --rates 20,60 --reps 3 --duration 20 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import orjson

from redisbal import endpoints
from redisbal.bench import peer_routers
from redisbal.bench.gateway_scenarios import (
    kv_event_endpoints,
    kv_events_engine_args,
    kv_sources,
    kv_subscriber_args,
)
from redisbal.bench.loadgen import run
from redisbal.bench.prefix_traces import agentic_lines, prefix_lines
from redisbal.errors import InvalidArgument
from redisbal.keys import DeploymentKeys
from redisbal.sim.demo import Child, DemoError, DemoOptions
from redisbal.sim.demo_http import HttpDemo, _get
from redisbal.sim.load_plan import Planned, read_trace, session_prompts

PEER = "vllm-router:kv_aware"
TARGETS = ("gateway", "vllm-router")
MODEL = "redisbal-sim"  # the engines' model (kv_aware's static event sources name it)
# fast engines: the router is the bottleneck of nothing
ENGINE_ARGS = "--base-step-ms 1 --per-seq-ms 0.01 --prefill-token-us 0.1 --kv-tokens 1048576"
# every process of the run whose CPU each phase reads (the routers' and the others')
# vllm-router's share of a phase's requests decided by prefix cost for the phase to
# count: a render it gives up on (a busy host delays the engines' answers) sends that
# request by load ("missing_tokens"); a few such do not change its CPU per request
FULL_STRENGTH = 0.95
PROCESSES = ("gateway", "kv-events", "vllm-router", "engine-sim", "coordinator", "redis")


def parse_rates(text: str) -> list[float]:
    """``"20,60"`` -> [20.0, 60.0]: each rate in (0, 10000], at least one, no repeats."""
    try:
        rates = [float(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise InvalidArgument(f"--rates {text!r}: give numbers separated by commas") from None
    if not rates or any(not 0 < r <= 10_000 for r in rates) or len(set(rates)) < len(rates):
        raise InvalidArgument(f"--rates {text!r}: distinct rates in (0, 10000] req/s, one or more")
    return rates


def check_args(a: argparse.Namespace) -> None:
    """One-line errors for what the run cannot use."""
    if not 1 <= a.reps <= 100:
        raise InvalidArgument(f"--reps {a.reps}: use 1..100 (3 or more for a spread)")
    if not 1 <= a.engines <= 64:
        raise InvalidArgument(f"--engines {a.engines}: use 1..64")
    if not 1 <= a.duration <= 3600:
        raise InvalidArgument(f"--duration {a.duration:g}: use 1..3600 s")
    if not 0 <= a.warmup_s <= a.duration:
        raise InvalidArgument(f"--warmup-s {a.warmup_s:g}: use 0..--duration")
    if not 16 <= a.cache_blocks <= 1 << 20:
        raise InvalidArgument(f"--cache-blocks {a.cache_blocks}: use 16..1048576")


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (utime + stime, and those of waited-for children) of ``pid`` and its
    descendants, from /proc; 0 for a process gone."""
    tick = os.sysconf("SC_CLK_TCK")
    stats: dict[int, list[str]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    # after "pid (comm) ": state ppid ... utime(11) stime cutime cstime
                    stats[int(entry)] = fh.read().rpartition(")")[2].split()
            except OSError:  # gone since the listing
                continue
    tree, todo = set(), [pid]
    while todo:
        p = todo.pop()
        if p in stats and p not in tree:
            tree.add(p)
            todo += [c for c, f in stats.items() if int(f[1]) == p]
    return sum(sum(int(x) for x in stats[p][11:15]) for p in tree) / tick


def per_request_ms(cpu_s: float, requests: int) -> float | None:
    return 1000 * cpu_s / requests if requests > 0 else None


def valid(row: dict[str, Any]) -> bool:
    """A phase that counts: every request answered, its router routing by cache."""
    return bool(row["requests"] > 0 and row["ok"] == row["requests"] and row["cache"]["ok"])


def paired_ratios(rows: list[dict[str, Any]], rate: float) -> dict[str, list[float]]:
    """At ``rate``, per repetition whose two phases are both valid: the gateway's CPU
    per request over vllm-router's (``gateway``), and the gateway's plus the
    subscriber's over it (``gateway+kv-events``); in repetition order."""
    by_rep: dict[int, dict[str, dict[str, Any]]] = {}
    for r in rows:
        if r["rate"] == rate and valid(r):
            by_rep.setdefault(r["rep"], {})[r["target"]] = r
    out: dict[str, list[float]] = {"gateway": [], "gateway+kv-events": []}
    for rep in sorted(by_rep):
        pair = by_rep[rep]
        if set(pair) != set(TARGETS):
            continue
        g, v = pair["gateway"]["ms_per_request"], pair["vllm-router"]["ms_per_request"]
        base = v["vllm-router"]
        if not base:
            continue
        out["gateway"].append(g["gateway"] / base)
        out["gateway+kv-events"].append((g["gateway"] + g["kv-events"]) / base)
    return out


def spread(values: list[float]) -> str:
    """``median (min-max)`` of ratios, or ``-`` for none."""
    if not values:
        return "-"
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def cache_share(row: dict[str, Any]) -> float:
    """Of the phase's requests, the share its router sent by cache: to a holder the
    gateway matched, or vllm-router's index lookups that hit."""
    c = row["cache"]
    hits = c["gateway_cache_routes"] if row["target"] == "gateway" else c["vllm_hits"]
    return float(hits / row["requests"]) if row["requests"] else 0.0


def cpu_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: per rate and phase, the median over the valid phases of each process's
    CPU ms per request of the phase, and the share its router sent by cache (range)."""
    heads = ["rate", "phase", "valid phases", "requests ok / sent"]
    heads += [f"{p} ms/req" for p in PROCESSES] + ["sent by cache"]
    out = ["| " + " | ".join(heads) + " |", "|---" * len(heads) + "|"]
    for rate in sorted({r["rate"] for r in rows}):
        for target in TARGETS:
            mine = [r for r in rows if r["rate"] == rate and r["target"] == target]
            good = [r for r in mine if valid(r)]
            if not mine:
                continue
            cells = [f"{rate:g}", target, f"{len(good)} / {len(mine)}"]
            cells.append(f"{sum(r['ok'] for r in mine)} / {sum(r['requests'] for r in mine)}")
            for p in PROCESSES:
                v = [r["ms_per_request"][p] for r in good if r["ms_per_request"][p] is not None]
                cells.append(f"{statistics.median(v):.3f}" if v else "-")
            share = [cache_share(r) for r in mine]
            cells.append(f"{min(share):.2f}-{max(share):.2f}")
            out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def ratio_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: per rate, the paired ratios' median (range) over repetitions."""
    out = [
        "| rate (req/s) | gateway / vllm-router kv_aware | gateway + kv-events / vllm-router "
        "kv_aware | repetitions |",
        "|---|---|---|---|",
    ]
    for rate in sorted({r["rate"] for r in rows}):
        x = paired_ratios(rows, rate)
        out.append(
            f"| {rate:g} | {spread(x['gateway'])} | {spread(x['gateway+kv-events'])} "
            f"| {len(x['gateway'])} |"
        )
    return "\n".join(out)


def make_trace(kind: str, rate: float, duration: float, seed: int, path: Path) -> list[Planned]:
    """The trace's requests with their prompt texts (as ``loadgen --trace
    --session-prompts`` sends them), its lines written to ``path`` on the way."""
    make = prefix_lines if kind == "prefixes" else agentic_lines
    lines = make(rate, duration, seed)
    path.write_bytes(b"".join(orjson.dumps(d) + b"\n" for d in lines))
    planned = read_trace(str(path))
    session_prompts(planned, seed)
    return planned


class Rig(HttpDemo):
    """The run's processes: the HTTP demo's Redis, coordinator and engines (every engine
    publishing its KV events), ``redisbal kv-events``, one gateway with the cache view,
    and one vllm-router kv_aware on the same events."""

    gateway_args = ("--prefix-tokens", "sim", "--access-log", "off")

    def __init__(self, opts: DemoOptions, engine_args: list[str], venv: Path) -> None:
        super().__init__(opts, lambda msg="", **kw: print(msg, flush=True))
        self.extra = engine_args
        self.venv = venv
        n = opts.engines
        self.kv_endpoints = kv_event_endpoints(peer_routers.free_port_block(n), n)
        self.router: peer_routers.RouterProcess | None = None
        self.subscriber: Child | None = None

    def engine_args(self) -> list[str]:
        return super().engine_args() + self.extra + kv_events_engine_args(self.kv_endpoints)

    def start(self) -> None:
        self.start_redis()
        self.start_processes()
        assert self.children is not None
        self.subscriber = self.children.start(
            "kv-events", "kv-events", *kv_subscriber_args(self.kv_endpoints)
        )
        self.start_gateways()
        self.start_router()

    def start_router(self) -> None:
        exe = peer_routers.binary("vllm-router", self.venv)
        if exe is None:
            raise DemoError(f"vllm-router is not installed in {self.venv}")
        urls = endpoints.fetch_sync(self.client, DeploymentKeys(self.opts.deployment))
        try:
            args = peer_routers.kv_event_args(kv_sources(urls, self.kv_endpoints), MODEL)
        except (InvalidArgument, peer_routers.RouterError) as exc:
            raise DemoError(str(exc)) from None
        port, metrics_port = peer_routers.free_ports(2)
        workers = sorted(urls.values())
        log = self.logdir / "vllm-router.log"
        self.router = peer_routers.RouterProcess(
            PEER, exe, port, metrics_port, workers, log, args=args
        )
        self.router.start()
        try:
            self.router.wait_ready(self.opts.startup_timeout)
        except peer_routers.RouterError as exc:
            raise DemoError(str(exc)) from None

    def target_url(self, target: str) -> str:
        assert self.router is not None
        return self.gateways[0][1] if target == "gateway" else self.router.url

    def pids(self) -> dict[str, int]:
        assert self.children is not None and self.router is not None
        assert self.router.proc is not None and self.server is not None
        by_name = {c.name: c.proc.pid for c in self.children.children}
        return {
            "gateway": self.gateways[0][0].proc.pid,
            "kv-events": by_name["kv-events"],
            "vllm-router": self.router.proc.pid,
            "engine-sim": by_name["engine-sim"],
            "coordinator": by_name["coordinator"],
            "redis": self.server.proc.pid,
        }

    def counters(self) -> dict[str, float]:
        """The cache-routing counters of both routers, from their /metrics now."""
        assert self.router is not None
        gw = peer_routers.parse_metrics(_get(self.gateways[0][1] + "/metrics").decode())
        self.router.scrape()
        vr = peer_routers.parse_metrics(self.router.metrics)
        t = peer_routers.total
        decisions = "vllm_router_prefix_routing_decisions_total"
        return {
            "gateway_cache_routes": t(gw, "redisbal_gateway_cache_routes_total"),
            "vllm_prefix_cost": t(vr, decisions, outcome="prefix_cost"),
            "vllm_sticky_hit": t(vr, decisions, outcome="sticky_hit"),
            "vllm_hits": t(vr, "vllm_router_kv_placement_lookups_total", result="hit"),
            "vllm_rendered": t(vr, "vllm_router_kv_routing_inputs_total", result="render"),
        }

    def engine_calls(self) -> dict[str, int]:
        """The engines' /sim/peer_calls, summed (vllm-router's renders among them)."""
        calls: dict[str, int] = {}
        for url in endpoints.fetch_sync(self.client, DeploymentKeys(self.opts.deployment)).values():
            for path, n in orjson.loads(_get(url + "/sim/peer_calls")).items():
                calls[path] = calls.get(path, 0) + n
        return calls

    def cleanup(self) -> None:
        if self.router is not None:
            self.router.stop()
        super().cleanup()


def cache_note(target: str, d: dict[str, float], requests: int) -> dict[str, Any]:
    """Did the phase's router route by cache? From its counters' change in the phase
    (``d``): the gateway sent some requests to a cache holder; vllm-router decided at
    least ``FULL_STRENGTH`` of them by prefix cost (or its session's stickiness, as
    peer_routers.check_paths counts it), some of its index lookups hitting."""
    if target == "gateway":
        n = d["gateway_cache_routes"]
        return {"ok": n > 0, "note": f"{n:.0f} of {requests} to a cache holder", **d}
    by_prefix = d["vllm_prefix_cost"] + d["vllm_sticky_hit"]
    ok = by_prefix >= FULL_STRENGTH * requests > 0 and d["vllm_hits"] > 0
    note = (
        f"{by_prefix:.0f} of {requests} by prefix cost, {d['vllm_hits']:.0f} index hits, "
        f"{d['vllm_rendered']:.0f} renders"
    )
    return {"ok": ok, "note": note, **d}


def phase(
    rig: Rig, target: str, planned: list[Planned], rate: float, rep: int, timeout: float
) -> dict[str, Any]:
    """One pass of the trace through ``target``: every process's CPU and the routers'
    counters before and after (the counters read outside the CPU window)."""
    pids = rig.pids()
    m0 = rig.counters()
    c0 = {name: tree_cpu_s(pid) for name, pid in pids.items()}
    t0 = time.monotonic()
    opts = {
        "model": MODEL,
        "stream": True,
        "chat": False,
        "ignore_eos": True,
        "headers": {"Content-Type": "application/json"},
        "timeout": timeout,
        "progress": False,
    }
    res = asyncio.run(run(rig.target_url(target), planned, opts))
    took = time.monotonic() - t0
    c1 = {name: tree_cpu_s(pid) for name, pid in pids.items()}
    m1 = rig.counters()
    n = int(res["requests"])
    cpu = {name: round(c1[name] - c0[name], 3) for name in pids}
    return {
        "target": target,
        "rate": rate,
        "rep": rep,
        "requests": n,
        "ok": int(res["ok"]),
        "errors": res["errors"],
        "seconds": round(took, 2),
        "ttft_p50_ms": res["ttft_p50_ms"],
        "ttft_p99_ms": res["ttft_p99_ms"],
        "cpu_s": cpu,
        "ms_per_request": {name: per_request_ms(s, n) for name, s in cpu.items()},
        "cache": cache_note(target, {k: m1[k] - m0[k] for k in m0}, n),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", default="20,60", help="req/s (agentic: agents/s), comma-separated")
    ap.add_argument("--reps", type=int, default=3, help="phases through each router per rate")
    ap.add_argument("--duration", type=float, default=20.0, help="s of the trace's arrivals")
    ap.add_argument(
        "--warmup-s", type=float, default=3.0, help="s of the trace sent first, uncounted"
    )
    ap.add_argument("--traffic", choices=("prefixes", "agentic"), default="prefixes")
    ap.add_argument("--seed", type=int, default=1, help="the trace's seed (every phase's)")
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--cache-blocks", type=int, default=1280, help="each engine's prefix cache")
    ap.add_argument("--engine-args", default=ENGINE_ARGS, help="engine-sim's step model")
    ap.add_argument("--running-cap", type=int, default=64)
    ap.add_argument(
        "--routers-venv",
        default=str(peer_routers.default_venv()),
        help="venv the pinned peer routers are installed into (made on first use)",
    )
    ap.add_argument("--keep-logs", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    try:
        rates = parse_rates(a.rates)
        check_args(a)
        venv = peer_routers.install(Path(a.routers_venv))
    except (InvalidArgument, peer_routers.RouterError) as exc:
        ap.error(str(exc))
    extra = [*shlex.split(a.engine_args), "--cache-blocks", str(a.cache_blocks)]
    opts = DemoOptions(
        deployment="routercpu",
        log_level="warning",
        engines=a.engines,
        api_servers=1,
        mode="tick",
        running_cap=a.running_cap,
        keep_logs=a.keep_logs,
    )
    rig = Rig(opts, extra, venv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # so that the cleanup runs
    rows: list[dict[str, Any]] = []
    warm_sent = 0  # the warm-up's requests through vllm-router (its counters hold them)
    load0 = os.getloadavg()
    try:
        rig.start()
        for rate in rates:
            planned = make_trace(
                a.traffic, rate, a.duration, a.seed, rig.logdir / f"trace-{rate:g}.jsonl"
            )
            warm = [p for p in planned if p.t < a.warmup_s]
            warm_sent += len(warm)
            timeout = a.duration + 60
            for target in TARGETS:  # connections, caches and indexes warm: not counted
                phase(rig, target, warm, rate, -1, timeout)
            for rep in range(a.reps):
                order = TARGETS if rep % 2 == 0 else TARGETS[::-1]
                for target in order:
                    rows.append(phase(rig, target, planned, rate, rep, timeout))
                    r = rows[-1]
                    print(
                        f"rate {rate:g} rep {rep} {target:11s} {r['ok']}/{r['requests']} ok in "
                        f"{r['seconds']:.1f} s; CPU ms/req "
                        + ", ".join(f"{k} {v:.3f}" for k, v in r["ms_per_request"].items() if v)
                        + f"; cache: {r['cache']['note']}",
                        flush=True,
                    )
        sent = sum(r["requests"] for r in rows if r["target"] == "vllm-router")
        assert rig.router is not None
        rig.router.scrape()
        # the whole run's kv_aware path, as gateway_policies.py checks it
        path = peer_routers.check_paths(PEER, [rig.router], rig.engine_calls(), sent + warm_sent)
        rig.failed = not all(valid(r) for r in rows)  # keep the logs
    except DemoError as exc:
        rig.failed = True
        sys.exit(f"router_cpu: {exc}")
    finally:
        rig.cleanup()
    load1 = os.getloadavg()
    print(f"\nload average (1 min) {load0[0]:.2f} -> {load1[0]:.2f}; {PEER}: {path['note']}\n")
    print(cpu_table(rows) + "\n")
    print(ratio_table(rows))
    if a.json:
        doc = {
            "args": {k: v for k, v in vars(a).items() if k != "routers_venv"},
            "load_average": [load0, load1],
            "kv_aware_path": path,
            "rows": rows,
        }
        Path(a.json).write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    bad = [r for r in rows if not valid(r)]
    if bad:  # left out of the ratios; the tables above say which
        sys.exit(f"router_cpu: {len(bad)} phases failed a request or did not route by cache")


if __name__ == "__main__":
    main()
