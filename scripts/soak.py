#!/usr/bin/env python
"""Soak: many engines and routers on one Redis for a long time; nothing may drift or fail.

    python scripts/soak.py                       # 256 engines x 50 reports/s, 16 routers, 10 min
    python scripts/soak.py --duration 60 --engines 64 --rate 20 --routers 4

Engines are lockstep reporters (AsyncReporter, public API) spread over
``--engine-procs`` processes, all stepping on a shared clock (``--rate`` steps a
second: every engine reports every step); routers are AsyncRouter objects spread
over ``--router-procs`` processes, each routing ``--route-hz`` requests a second;
one coordinator process runs the stall guard and the expiry; an observer in this
process subscribes to the channel and keeps every published version.

It checks, and prints at the end as JSON (also to ``--out``):
- every version accounted for: the observer saw versions 1..N contiguous within the
  epoch (forced publishes have versions of their own; a gap is a lost message);
- Redis flat: the deployment's key count and INFO memory used_memory at the start
  (after warm-up) and at the end, and their maximum;
- snapshot latency at the routers, p50/p99: receive time minus the publishing
  report's Redis time (``time_ms``; same host, same clock), and minus the step's
  nominal start (all engines report within the step);
- route() errors (must be 0), degraded decisions, achieved reports/s (the rate this
  machine sustained: steps an engine could not keep up with are skipped, not queued).

Progress goes to stderr every ``--progress-s``. Not part of CI.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import multiprocessing as mp
import os
import random
import signal
import sys
import threading
import time
from typing import Any

import redis

from redisbal import AsyncReporter, AsyncRouter, Counts
from redisbal.barrier.snapshot import Snapshot
from redisbal.connection import make_client
from redisbal.keys import DeploymentKeys
from redisbal.ops.coordinator import Coordinator, CoordinatorConfig
from redisbal.sim.embedded import RedisServer


def log(msg: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


# -- engine worker ----------------------------------------------------------------------------


def engine_worker(
    url: str, deployment: str, ids: list[str], rate: float, t0: float, t_end: float, q: Any
) -> None:
    """Report for ``ids`` every step (1/rate s) until t_end; send counters to q."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    async def main() -> dict[str, Any]:
        client = make_client(url, asyncio=True, socket_timeout=5.0, max_connections=64)
        reps = [
            AsyncReporter(deployment=deployment, engines=e, client=client, heartbeat=False)
            for e in ids
        ]
        rng = random.Random(ids[0])
        for rep in reps:
            await rep.register(wait=True)
        await asyncio.sleep(max(0.0, t0 - time.time()))  # step together from t0
        counts: dict[str, int] = {}
        errors: list[str] = []
        steps_done = steps_skipped = 0
        last = int((time.time() - t0) * rate) - 1
        sem = asyncio.Semaphore(64)

        async def one(rep: AsyncReporter, step: int) -> None:
            async with sem:
                try:
                    res = await rep.report(
                        Counts(step, rng.randint(0, 8), rng.randint(0, 64), 0), wait=True
                    )
                    counts[res.status] = counts.get(res.status, 0) + 1
                except Exception as exc:  # counted: the soak must show zero
                    counts["error"] = counts.get("error", 0) + 1
                    if len(errors) < 5:
                        errors.append(f"{type(exc).__name__}: {exc}")

        while time.time() < t_end:
            step = int((time.time() - t0) * rate)
            if step <= last:
                await asyncio.sleep(max(0.0005, t0 + (last + 1) / rate - time.time()))
                continue
            steps_skipped += step - last - 1
            last = step
            await asyncio.gather(*(one(rep, step) for rep in reps))
            steps_done += 1
        for rep in reps:
            await rep.aclose(leave=True)
        await client.aclose()
        return {"counts": counts, "errors": errors, "steps": steps_done, "skipped": steps_skipped}

    q.put(("engine", asyncio.run(main())))


# -- router worker ----------------------------------------------------------------------------


def router_worker(
    url: str,
    deployment: str,
    indexes: list[int],
    count: int,
    route_hz: float,
    rate: float,
    t0: float,
    t_end: float,
    q: Any,
) -> None:
    """Run AsyncRouters for ``indexes``; each routes route_hz requests a second."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    async def main() -> dict[str, Any]:
        routers = [AsyncRouter(url, deployment, i, count) for i in indexes]
        lat_pub: list[float] = []  # receive - publish (server time of the completing report)
        lat_step: list[float] = []  # receive - nominal step start
        seen: dict[int, list[int]] = {i: [] for i in indexes}
        epochs: dict[int, set[str]] = {i: set() for i in indexes}

        for router in routers:
            core = router.core
            orig = core.apply_snapshot

            def apply(snap: Snapshot, orig: Any = orig, idx: int = core.client_index) -> bool:
                now_ms = time.time() * 1000
                ok = orig(snap)
                if ok:
                    seen[idx].append(snap.version)
                    epochs[idx].add(snap.epoch)
                    if not snap.forced:
                        lat_pub.append(now_ms - snap.time_ms)
                        lat_step.append(now_ms - (t0 + snap.step / rate) * 1000)
                return ok

            core.apply_snapshot = apply  # type: ignore[method-assign]
        for router in routers:
            await router.start(wait=30)
        stats = {i: {"routes": 0, "errors": 0, "degraded": 0} for i in indexes}
        err_samples: list[str] = []

        async def route(router: AsyncRouter) -> None:
            st = stats[router.client_index]
            inflight: list[Any] = []
            interval = 1.0 / route_hz
            nxt = time.monotonic()
            while time.time() < t_end:
                try:
                    d = router.route()
                    st["routes"] += 1
                    st["degraded"] += d.degraded
                    inflight.append(d)
                    if len(inflight) > 32:
                        router.finished(inflight.pop(0))
                except Exception as exc:
                    st["errors"] += 1
                    if len(err_samples) < 5:
                        err_samples.append(f"{type(exc).__name__}: {exc}")
                nxt += interval
                await asyncio.sleep(max(0.0, nxt - time.monotonic()))

        await asyncio.gather(*(route(r) for r in routers))
        for router in routers:
            await router.aclose()
        gaps = 0
        for vs in seen.values():
            gaps += sum(1 for a, b in itertools.pairwise(vs) if b != a + 1)
        # latencies: keep a bounded sample for the parent
        rng = random.Random(0)
        if len(lat_pub) > 200_000:
            lat_pub = rng.sample(lat_pub, 200_000)
        if len(lat_step) > 200_000:
            lat_step = rng.sample(lat_step, 200_000)
        return {
            "stats": stats,
            "errors": err_samples,
            "adopted": {i: len(v) for i, v in seen.items()},
            "adopted_gaps": gaps,
            "epochs": {i: sorted(e) for i, e in epochs.items()},
            "lat_pub_ms": lat_pub,
            "lat_step_ms": lat_step,
        }

    q.put(("router", asyncio.run(main())))


# -- coordinator ------------------------------------------------------------------------------


def coordinator_worker(url: str, deployment: str, stall_ms: int, t_end: float, q: Any) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    cfg = CoordinatorConfig(dead_after_ms=5000, stall_ms=stall_ms, join_grace_ms=1000)
    coord = Coordinator(url, deployment, cfg, coordinator_id="soak-coordinator")
    coord.run(duration_s=max(0.0, t_end - time.time()))
    st = coord.stats
    q.put(
        (
            "coordinator",
            {
                "forced": st.forced,
                "expired": st.expired,
                "errors": st.errors,
                "last_error": st.last_error,
                "epochs_started": st.epochs_started,
            },
        )
    )


# -- observer ---------------------------------------------------------------------------------


class Observer:
    """Every snapshot published on the channel: version, forced, time (in this process)."""

    def __init__(self, url: str, channel: str) -> None:
        self.client = make_client(url, socket_timeout=5.0)
        self.pubsub = self.client.pubsub()
        self.pubsub.subscribe(channel)
        self.versions: list[tuple[str, int, bool]] = []
        self.lost_connection = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Observer:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                msg = self.pubsub.get_message(timeout=0.2)
            except redis.ConnectionError:
                self.lost_connection += 1
                time.sleep(0.1)
                continue
            if msg and msg["type"] == "message":
                d = json.loads(msg["data"])
                self.versions.append((d["epoch"], d["version"], d["forced"]))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.pubsub.close()
        self.client.close()


# -- main -------------------------------------------------------------------------------------


def deployment_keys(c: redis.Redis, keys: DeploymentKeys) -> int:
    return sum(1 for _ in c.scan_iter(match=f"redisbal:{{{keys.deployment}}}:*", count=1000))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--redis-url",
        default=os.environ.get("REDISBAL_REDIS_URL"),
        help="Redis to use (default: start a private redis-server)",
    )
    p.add_argument("--deployment", default=f"soak{os.getpid()}")
    p.add_argument("--engines", type=int, default=256)
    p.add_argument("--rate", type=float, default=50.0, help="reports per second per engine")
    p.add_argument("--routers", type=int, default=16)
    p.add_argument("--route-hz", type=float, default=100.0, help="routes per second per router")
    p.add_argument("--duration", type=float, default=600.0, help="seconds")
    p.add_argument("--warmup", type=float, default=10.0, help="seconds before the start sample")
    p.add_argument("--engine-procs", type=int, default=2)
    p.add_argument("--router-procs", type=int, default=2)
    p.add_argument("--stall-ms", type=int, default=250)
    p.add_argument("--progress-s", type=float, default=10.0)
    p.add_argument("--out", help="write the result JSON here too")
    a = p.parse_args(argv)

    server = None
    url = a.redis_url
    if not url:
        server = RedisServer().start()
        url = server.url
    keys = DeploymentKeys(a.deployment)
    c = make_client(url, socket_timeout=5.0)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    t0 = time.time() + 3.0  # engines start stepping together
    t_end = t0 + a.warmup + a.duration
    ids = [f"e{i}" for i in range(a.engines)]
    procs = [ctx.Process(target=coordinator_worker, args=(url, a.deployment, a.stall_ms, t_end, q))]
    for k in range(a.engine_procs):
        chunk = ids[k :: a.engine_procs]
        if chunk:
            procs.append(
                ctx.Process(
                    target=engine_worker, args=(url, a.deployment, chunk, a.rate, t0, t_end, q)
                )
            )
    r_idx = list(range(a.routers))
    for k in range(a.router_procs):
        chunk = r_idx[k :: a.router_procs]
        if chunk:
            procs.append(
                ctx.Process(
                    target=router_worker,
                    args=(url, a.deployment, chunk, a.routers, a.route_hz, a.rate, t0, t_end, q),
                )
            )
    observer = Observer(url, keys.channel).start()
    log(
        f"{a.engines} engines x {a.rate:g} reports/s, {a.routers} routers x {a.route_hz:g} "
        f"routes/s, {a.duration:g} s (+{a.warmup:g} s warm-up) on {url}; load {os.getloadavg()}"
    )
    for proc in procs:
        proc.start()
    samples: list[dict[str, Any]] = []
    start_sample: dict[str, Any] | None = None
    end_sample: dict[str, Any] | None = None
    results: list[tuple[str, dict[str, Any]]] = []
    next_progress = time.time() + a.progress_s
    last_reports, last_t = 0, time.time()
    try:
        while time.time() < t_end + 30 and len(results) < len(procs):
            with contextlib.suppress(Exception):
                results.append(q.get(timeout=0.5))
            now = time.time()
            if start_sample is None and now >= t0 + a.warmup:
                start_sample = sample(c, keys)
                start_sample["t"] = now - t0
                log(f"start sample: {start_sample}")
            if end_sample is None and now >= t_end - 1.0:  # before the engines leave
                end_sample = sample(c, keys)
                end_sample["t"] = now - t0
                log(f"end sample: {end_sample}")
            if now >= next_progress and now < t_end - 1.0:
                next_progress = now + a.progress_s
                s = sample(c, keys)
                s["t"] = round(now - t0, 1)
                reports = int(s.pop("evalsha_calls"))
                s["reports_per_s"] = round((reports - last_reports) / (now - last_t))
                last_reports, last_t = reports, now
                s["observed"] = len(observer.versions)
                s["load"] = os.getloadavg()[0]
                samples.append(s)
                log(json.dumps(s))
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
        if end_sample is None:
            end_sample = sample(c, keys)
        observer.stop()
    result = summarize(a, results, observer, start_sample, end_sample, samples, url)
    print(json.dumps(result, indent=2))
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    c.close()
    if server is not None:
        server.cleanup()
    return 0 if result["ok"] else 1


def sample(c: redis.Redis, keys: DeploymentKeys) -> dict[str, Any]:
    mem = c.info("memory")
    meta = {k.decode(): v.decode() for k, v in c.hgetall(keys.meta).items()}
    return {
        "keys": deployment_keys(c, keys),
        "dbsize": c.dbsize(),
        "used_memory": int(mem["used_memory"]),
        "version": int(meta.get("version", 0)),
        "forced": int(meta.get("forced", 0)),
        "published": int(meta.get("published", 0)),
        "stale": int(meta.get("stale", 0)),
        # every EVALSHA is a report but for the coordinator's few per tick
        "evalsha_calls": int(c.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)),
    }


def summarize(
    a: argparse.Namespace,
    results: list[tuple[str, dict[str, Any]]],
    observer: Observer,
    start: dict[str, Any] | None,
    end: dict[str, Any],
    samples: list[dict[str, Any]],
    url: str,
) -> dict[str, Any]:
    eng = [r for kind, r in results if kind == "engine"]
    rts = [r for kind, r in results if kind == "router"]
    coord = next((r for kind, r in results if kind == "coordinator"), {})
    statuses: dict[str, int] = {}
    for r in eng:
        for k, v in r["counts"].items():
            statuses[k] = statuses.get(k, 0) + v
    total_reports = sum(statuses.values())
    wall = a.warmup + a.duration
    route_stats = [s for r in rts for s in r["stats"].values()]
    lat_pub = [x for r in rts for x in r["lat_pub_ms"]]
    lat_step = [x for r in rts for x in r["lat_step_ms"]]
    # versions on the channel: contiguous within each epoch
    gaps, by_epoch = [], {}
    for epoch, version, _forced in observer.versions:
        prev = by_epoch.get(epoch)
        if prev is not None and version != prev + 1:
            gaps.append((epoch, prev, version))
        by_epoch[epoch] = version
    forced_seen = sum(1 for _, _, f in observer.versions if f)
    route_errors = sum(s["errors"] for s in route_stats)
    mem_series = [s["used_memory"] for s in samples]
    key_series = [s["keys"] for s in samples]
    result = {
        "command": " ".join([sys.executable, *sys.argv]),
        "redis": url,
        "engines": a.engines,
        "rate_per_engine": a.rate,
        "routers": a.routers,
        "duration_s": a.duration,
        "reports_total": total_reports,
        "reports_per_s_achieved": round(total_reports / wall),
        "reports_per_s_target": a.engines * a.rate,
        "report_statuses": statuses,
        "engine_errors": [e for r in eng for e in r["errors"]],
        "engine_steps_skipped": sum(r["skipped"] for r in eng),
        "snapshots_observed": len(observer.versions),
        "snapshots_forced": forced_seen,
        "version_gaps_on_channel": gaps[:20],
        "version_gap_count": len(gaps),
        "epochs": sorted(by_epoch),
        "router_adopted": sum(sum(r["adopted"].values()) for r in rts),
        "router_adopted_gaps": sum(r["adopted_gaps"] for r in rts),
        "routes": sum(s["routes"] for s in route_stats),
        "route_errors": route_errors,
        "route_error_samples": [e for r in rts for e in r["errors"]],
        "degraded_routes": sum(s["degraded"] for s in route_stats),
        "latency_publish_to_router_ms": {
            "p50": percentile(lat_pub, 0.5),
            "p99": percentile(lat_pub, 0.99),
            "max": max(lat_pub) if lat_pub else None,
            "n": len(lat_pub),
        },
        "latency_step_start_to_router_ms": {
            "p50": percentile(lat_step, 0.5),
            "p99": percentile(lat_step, 0.99),
            "n": len(lat_step),
        },
        "redis_start": start,
        "redis_end": end,
        "used_memory_max": max(mem_series) if mem_series else None,
        "deployment_keys_max": max(key_series) if key_series else None,
        "coordinator": coord,
        "load_avg_end": os.getloadavg(),
        "workers_reported": len(results),
    }
    ok = (
        route_errors == 0
        and not gaps
        and statuses.get("error", 0) == 0
        and start is not None
        and end["keys"] == start["keys"]
        # flat: a leak of even a few bytes per report would add megabytes over a run
        and end["used_memory"] <= start["used_memory"] * 1.25
        and len(results) == 1 + len(eng) + len(rts)
    )
    result["ok"] = ok
    return result


if __name__ == "__main__":
    sys.exit(main())
