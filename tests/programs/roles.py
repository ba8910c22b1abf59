"""Three small processes built on redisbal's public API only, so that a test can
SIGKILL / SIGSTOP them like real ones (``support.procs.ProcGroup`` spawns them):

    python tests/programs/roles.py engine      --url U --deployment D --id e0 --t0 T
    python tests/programs/roles.py coordinator --url U --deployment D --id c1
    python tests/programs/roles.py router      --url U --deployment D --index 0 --count 1

Each prints one JSON object per line on stdout (a "ready" line, then its state
every ``--status-s``). Run by path, it imports nothing from the tests' helpers.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import signal
import sys
import threading
import time
from typing import Any

from redisbal import Counts


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _on_term(stop: threading.Event) -> None:
    def handler(_sig: int, _frame: Any) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def run_engine(a: argparse.Namespace) -> None:
    """A lockstep engine whose step is the shared clock (t0 + step * period): all engine
    processes step together. Reports every step (never waiting: the reporter's sender
    delivers); counts come from --waiting/--running. Status lines carry the reporter's
    own counters (accepted, stale, unavailable, coalesced) and "error": sends Redis
    refused for another reason, plus anything a report() call raised."""
    import redis.exceptions

    stop = threading.Event()
    _on_term(stop)
    counts = collections.Counter()
    last_error = ""
    pad = [10**12 + i for i in range(a.pad)] if a.pad else None

    def account(status: str) -> None:
        counts[status] += 1

    def status_line(rep: Any, last: int) -> dict[str, Any]:
        st = rep.stats()
        return {
            "id": a.id,
            "step": last,
            "accepted": st.accepted,
            "stale": st.stale,
            "unavailable": st.unavailable,
            "coalesced": st.coalesced,
            "error": counts["error"] + st.errors,
            "last_error": last_error,
        }

    def step_now() -> int:
        return max(0, int((time.time() - a.t0) / a.period))

    if a.use_async:

        async def main() -> None:
            nonlocal last_error
            from redisbal import AsyncReporter

            rep = AsyncReporter(a.url, a.deployment, a.id)
            await rep.register()
            _emit({"ready": True, "id": a.id})
            last, next_status = -1, 0.0
            while not stop.is_set():
                s = step_now()
                if s > last:
                    last = s
                    try:
                        await rep.report(
                            Counts(s, a.waiting, a.running, 0, kv_usage=0.25, admitted=pad)
                        )
                    except redis.exceptions.RedisError as exc:
                        account("error")
                        last_error = str(exc)
                if time.monotonic() >= next_status:
                    next_status = time.monotonic() + a.status_s
                    _emit(status_line(rep, last))
                await asyncio.sleep(max(0.001, a.t0 + (last + 1) * a.period - time.time()))
            await rep.aclose(leave=not a.no_leave)

        asyncio.run(main())
        return

    from redisbal import Reporter

    # SIGUSR1: the engine's loop hangs (no more reports) while the process and its
    # reporter's heartbeat live on: a hung engine, not a dead one; again: it steps again
    hung = threading.Event()
    signal.signal(signal.SIGUSR1, lambda *_: hung.clear() if hung.is_set() else hung.set())
    rep = Reporter(a.url, a.deployment, a.id, mode="tick" if a.tick else "lockstep")
    rep.register()
    _emit({"ready": True, "id": a.id, "incarnation": rep.incarnation})
    last, next_status = -1, 0.0
    while not stop.is_set():
        s = step_now()
        if s > last and not hung.is_set():
            last = s
            try:
                if a.tick:
                    rep.report(Counts(waiting=a.waiting, running=a.running, kv_usage=0.25))
                else:
                    rep.report(Counts(s, a.waiting, a.running, 0, kv_usage=0.25, admitted=pad))
            except redis.exceptions.RedisError as exc:
                account("error")
                last_error = str(exc)
        if time.monotonic() >= next_status:
            next_status = time.monotonic() + a.status_s
            _emit(status_line(rep, last))
        stop.wait(max(0.001, a.t0 + (last + 1) * a.period - time.time()))
    rep.close(leave=not a.no_leave)


def run_coordinator(a: argparse.Namespace) -> None:
    from redisbal.ops.coordinator import Coordinator, CoordinatorConfig

    cfg = CoordinatorConfig(
        dead_after_ms=a.dead_after_ms,
        stall_ms=a.stall_ms,
        join_grace_ms=a.join_grace_ms,
        idle_publish_ms=a.idle_publish_ms,
        stall_after_ms=a.stall_after_ms,
        expected=[e for e in a.expected.split(",") if e],
    )
    coord = Coordinator(a.url, a.deployment, cfg, coordinator_id=a.id, lease_ttl_ms=a.lease_ttl_ms)
    stop = threading.Event()

    def handler(_sig: int, _frame: Any) -> None:
        stop.set()
        coord.stop()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)

    def status() -> None:
        _emit({"ready": True, "id": a.id})
        while not stop.wait(a.status_s):
            st = coord.stats
            _emit(
                {
                    "id": a.id,
                    "leader": st.leader,
                    "fence": st.fence,
                    "ticks": st.ticks,
                    "expired": st.expired,
                    "forced": st.forced,
                    "epochs_started": st.epochs_started,
                    "errors": st.errors,
                    "last_error": st.last_error,
                }
            )

    threading.Thread(target=status, daemon=True).start()
    coord.run()
    stop.set()


def run_router(a: argparse.Namespace) -> None:
    from redisbal import Router

    router = Router(
        a.url, a.deployment, a.index, a.count, poll_s=a.poll_s, stale_after_s=a.stale_after_s
    )
    stop = threading.Event()
    _on_term(stop)
    router.start(wait=5.0)
    _emit({"ready": True, "index": a.index})
    routes = errors = degraded = 0
    last_error = ""
    next_status = 0.0
    interval = 1.0 / a.route_hz
    while not stop.is_set():
        try:
            d = router.route()
            router.finished(d)
            routes += 1
            degraded += d.degraded
        except Exception as exc:
            errors += 1
            last_error = f"{type(exc).__name__}: {exc}"
        if time.monotonic() >= next_status:
            next_status = time.monotonic() + a.status_s
            snap = router.snapshot
            _emit(
                {
                    "index": a.index,
                    "epoch": snap.epoch if snap else None,
                    "version": snap.version if snap else 0,
                    "engines": sorted(snap.engines) if snap else [],
                    "degraded": router.degraded,
                    "routes": routes,
                    "degraded_routes": degraded,
                    "errors": errors,
                    "last_error": last_error,
                }
            )
        stop.wait(interval)
    router.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="role", required=True)
    for role in ("engine", "coordinator", "router"):
        s = sub.add_parser(role)
        s.add_argument("--url", required=True)
        s.add_argument("--deployment", required=True)
        s.add_argument("--status-s", type=float, default=0.1)
    e = sub.choices["engine"]
    e.add_argument("--id", required=True)
    e.add_argument("--t0", type=float, required=True, help="shared clock origin (time.time())")
    e.add_argument("--period", type=float, default=0.05, help="seconds per step")
    e.add_argument("--waiting", type=int, default=1)
    e.add_argument("--running", type=int, default=4)
    e.add_argument("--pad", type=int, default=0, help="admitted list length (bigger snapshots)")
    e.add_argument("--use-async", action="store_true", help="AsyncReporter")
    e.add_argument("--no-leave", action="store_true")
    e.add_argument("--tick", action="store_true", help="an independent engine (tick mode)")
    c = sub.choices["coordinator"]
    c.add_argument("--id", required=True)
    c.add_argument("--dead-after-ms", type=int, default=1500)
    c.add_argument("--stall-ms", type=int, default=100)
    c.add_argument("--join-grace-ms", type=int, default=300)
    c.add_argument("--idle-publish-ms", type=int, default=200)
    c.add_argument("--lease-ttl-ms", type=int, default=1000)
    c.add_argument("--expected", default="")
    c.add_argument("--stall-after-ms", type=int, default=2000)
    r = sub.choices["router"]
    r.add_argument("--index", type=int, default=0)
    r.add_argument("--count", type=int, default=1)
    r.add_argument("--route-hz", type=float, default=200.0)
    r.add_argument("--poll-s", type=float, default=1.0)
    r.add_argument("--stale-after-s", type=float, default=5.0)
    a = p.parse_args(argv)
    import logging

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    {"engine": run_engine, "coordinator": run_coordinator, "router": run_router}[a.role](a)


if __name__ == "__main__":
    main()
