"""``redisbal api``: the API-server role with simulated load.

One process runs one or more ``AsyncRouter`` instances (API-server indexes
``client_index .. client_index + routers - 1`` out of ``client_count``). Each
generates its share of the load, routes every request with its router, sends
it to the chosen engine through the simulation transport
(redisbal.sim.transport) and calls ``finished()`` when the engine says it is
done. Load shapes:

- bursts: ``burst`` requests in total over all API servers, sent within
  ``burst_window_ms``, every ``burst_every_s``; each API server sends an equal
  share, on the same wall-clock schedule (``start_at``) as the others;
- Poisson: ``rate`` requests/s in total over all API servers.

Per request it measures the end-to-end latency (sent to completion received) and the
time to first token: that latency minus the decode time the engine sends with the
completion (redisbal.sim.transport.DoneMsg), all on this process's clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any, TextIO

from redisbal.connection import make_client, redact
from redisbal.routing.policies import DEFAULT_POLICY, NoEngines
from redisbal.routing.router import AsyncRouter
from redisbal.routing.state import Decision
from redisbal.sim.model import output_length
from redisbal.sim.transport import (
    NO_BURST,
    POP_BATCH,
    DoneMsg,
    RequestMsg,
    SimKeys,
    popped,
    ttft_s,
)

log = logging.getLogger("redisbal.sim.api_sim")


@dataclass(frozen=True)
class LoadSpec:
    """What load to generate, over all API servers of the deployment."""

    duration_s: float = 6.0
    burst: int = 0
    burst_window_ms: float = 50.0
    burst_every_s: float = 2.0
    rate: float = 0.0
    mean_output: float = 40.0
    max_output: int = 2000
    sigma: float = 1.0  # lognormal sigma of output lengths (the tail)
    seed: int = 0


def schedule(spec: LoadSpec, client_index: int, client_count: int) -> list[tuple[float, int]]:
    """(offset from start in s, burst number or NO_BURST) of every request of one API server."""
    events: list[tuple[float, int]] = []
    if spec.burst > 0:
        share = spec.burst // client_count + (1 if client_index < spec.burst % client_count else 0)
        window = spec.burst_window_ms / 1000.0
        k = 0
        while k * spec.burst_every_s < spec.duration_s:
            t0 = k * spec.burst_every_s
            events += [(t0 + j * window / max(share, 1), k) for j in range(share)]
            k += 1
    if spec.rate > 0:
        rng = random.Random(spec.seed * 7919 + client_index)
        t = rng.expovariate(spec.rate / client_count)
        while t < spec.duration_s:
            events.append((t, NO_BURST))
            t += rng.expovariate(spec.rate / client_count)
    events.sort()
    return events


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def latency_figures(
    ttft_ms: list[float], e2e_ms: list[float], slo_ttft_ms: float | None, window_s: float
) -> dict[str, float | None]:
    """What a user of the service feels, from per-request TTFT and end-to-end latency
    (ms; the same keys as ``redisbal loadgen``'s): TTFT p50/p99, e2e p50/p99 and, with
    an objective, goodput: the requests whose first token came within it, per second
    of the load's window (the same for every policy given the same schedule, unlike
    the run's end, which one long answer moves), and their share of all requests."""

    def r(v: float | None) -> float | None:
        return None if v is None else round(v, 2)

    out = {
        "ttft_p50_ms": r(percentile(ttft_ms, 0.5)),
        "ttft_p99_ms": r(percentile(ttft_ms, 0.99)),
        "e2e_p50_ms": r(percentile(e2e_ms, 0.5)),
        "e2e_p99_ms": r(percentile(e2e_ms, 0.99)),
    }
    if slo_ttft_ms is not None:
        good = sum(t <= slo_ttft_ms for t in ttft_ms)
        out["goodput_rps"] = round(good / window_s, 2) if window_s > 0 else None
        out["slo_attainment"] = round(good / len(ttft_ms), 4) if ttft_ms else None
    return out


@dataclass
class RouterRun:
    """One router's load and bookkeeping."""

    router: AsyncRouter
    events: list[tuple[float, int]]
    rng: random.Random
    next_event: int = 0
    next_rid: int = 1
    pending: dict[int, tuple[Decision, float]] = field(default_factory=dict)
    sent: int = 0
    completed: int = 0
    degraded: int = 0
    unroutable: int = 0
    routed: dict[str, int] = field(default_factory=dict)
    latencies: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)

    @property
    def index(self) -> int:
        return self.router.client_index

    def summary(self) -> dict[str, Any]:
        ttft = [round(t * 1000, 2) for t in self.ttfts]
        e2e = [round(t * 1000, 2) for t in self.latencies]
        return {
            "client_index": self.index,
            "sent": self.sent,
            "completed": self.completed,
            "unfinished": len(self.pending),
            "degraded_routes": self.degraded,
            "unroutable": self.unroutable,
            "snapshots": self.router.core.counters["snapshots"],
            **latency_figures(ttft, e2e, None, 0.0),
            "routed": dict(sorted(self.routed.items())),
            # per request, so that a caller can merge API servers' percentiles
            "ttft_ms": ttft,
            "e2e_ms": e2e,
        }


class ApiSimRunner:
    """Routers of one API-server process, generating load and collecting completions."""

    def __init__(
        self,
        redis_url: str,
        deployment: str,
        indices: list[int],
        client_count: int,
        spec: LoadSpec,
        *,
        policy: str = DEFAULT_POLICY,
        start_at: float | None = None,
        drain_timeout_s: float = 10.0,
        wait_engines_s: float = 10.0,
        poll_s: float = 0.005,
        progress: TextIO | None = sys.stdout,
    ) -> None:
        self.url = redis_url
        self.deployment = deployment
        self.indices = indices
        self.client_count = client_count
        self.spec = spec
        self.policy = policy
        self.start_at = start_at
        self.drain_timeout_s = drain_timeout_s
        self.wait_engines_s = wait_engines_s
        self.poll_s = poll_s
        self.progress = progress
        self.keys = SimKeys(deployment)
        self.runs: list[RouterRun] = []
        self._stop = asyncio.Event()
        self.client: Any = None

    def stop(self) -> None:
        self._stop.set()

    async def _start_routers(self) -> None:
        for ci in self.indices:
            router = AsyncRouter(
                deployment=self.deployment,
                client_index=ci,
                client_count=self.client_count,
                policy=self.policy,
                client=self.client,
                poll_s=0.5,
            )
            rng = random.Random(self.spec.seed * 1_000_003 + ci)
            self.runs.append(RouterRun(router, schedule(self.spec, ci, self.client_count), rng))
        await asyncio.gather(*(r.router.start() for r in self.runs))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait_engines_s
        while any(r.router.snapshot is None for r in self.runs):
            if loop.time() >= deadline or self._stop.is_set():
                raise NoEngines(
                    f"no snapshot for deployment {self.deployment!r} after "
                    f"{self.wait_engines_s:g}s: are engines (redisbal engine-sim) reporting to it?"
                )
            await asyncio.sleep(0.05)

    def _send_due(self, now: float, start: float, pipe: Any) -> int:
        n = 0
        for run in self.runs:
            sent_before = run.sent
            while run.next_event < len(run.events) and start + run.events[run.next_event][0] <= now:
                burst = run.events[run.next_event][1]
                run.next_event += 1
                try:
                    decision = run.router.route()
                except NoEngines:
                    run.unroutable += 1  # every engine is gone: the request is refused
                    continue
                rid = run.next_rid
                run.next_rid += 1
                out = output_length(
                    run.rng, self.spec.mean_output, self.spec.sigma, cap=self.spec.max_output
                )
                msg = RequestMsg(run.index, rid, burst, out)
                pipe.rpush(self.keys.requests(decision.engine_id), msg.encode())
                run.pending[rid] = (decision, now)
                run.sent += 1
                run.routed[decision.engine_id] = run.routed.get(decision.engine_id, 0) + 1
                if decision.degraded:
                    run.degraded += 1
            if run.sent > sent_before:
                pipe.hincrby(self.keys.progress, f"sent:{run.index}", run.sent - sent_before)
                n += run.sent - sent_before
        return n

    def _complete(self, run: RouterRun, items: list[bytes], now: float) -> int:
        n = 0
        for raw in items:
            try:
                msg = DoneMsg.decode(raw)
            except ValueError:
                continue
            entry = run.pending.pop(msg.rid, None)
            if entry is None:
                continue  # a completion of an earlier run: not ours
            decision, sent_at = entry
            run.router.finished(decision)
            run.latencies.append(now - sent_at)
            if msg.decode_ms is not None:
                run.ttfts.append(ttft_s(now - sent_at, msg.decode_ms))
            run.completed += 1
            n += 1
        return n

    def _print_progress(self, now: float, start: float) -> None:
        if self.progress is None:
            return
        sent = sum(r.sent for r in self.runs)
        done = sum(r.completed for r in self.runs)
        snap = self.runs[0].router.snapshot
        ver = snap.version if snap else 0
        ids = (
            f"{self.indices[0]}"
            if len(self.indices) == 1
            else (f"{self.indices[0]}-{self.indices[-1]}")
        )
        print(
            f"api {ids}: t={now - start:5.1f}s sent {sent} done {done} "
            f"in flight {sent - done} snapshot v{ver}",
            file=self.progress,
            flush=True,
        )

    async def run(self) -> list[dict[str, Any]]:
        """Generate the load, wait for completions (up to drain_timeout_s), return summaries."""
        self.client = make_client(self.url, asyncio=True, socket_timeout=5.0)
        loop = asyncio.get_running_loop()
        try:
            await self.client.delete(*(self.keys.done(ci) for ci in self.indices))
            await self._start_routers()
            start = loop.time()
            if self.start_at is not None:
                start += max(0.0, self.start_at - time.time())
            send_end = start + self.spec.duration_s
            log.info(
                "api: routers %s of %d (%s policy) on %s",
                self.indices,
                self.client_count,
                self.policy,
                redact(self.url),
            )
            next_progress = start + 1.0
            done_delta = dict.fromkeys(self.indices, 0)
            while True:
                now = loop.time()
                pipe = self.client.pipeline(transaction=False)
                if not self._stop.is_set():
                    self._send_due(now, start, pipe)
                for ci, d in done_delta.items():
                    if d:
                        pipe.hincrby(self.keys.progress, f"done:{ci}", d)
                        done_delta[ci] = 0
                for run in self.runs:
                    pipe.lpop(self.keys.done(run.index), POP_BATCH)
                replies = await pipe.execute()
                now = loop.time()
                for run, reply in zip(self.runs, replies[-len(self.runs) :], strict=True):
                    done_delta[run.index] += self._complete(run, popped(reply), now)
                if now >= next_progress:
                    self._print_progress(now, start)
                    next_progress += 1.0
                if self._stop.is_set():
                    break
                all_sent = all(r.next_event >= len(r.events) for r in self.runs)
                unfinished = any(r.pending for r in self.runs)
                if all_sent and (not unfinished or now >= send_end + self.drain_timeout_s):
                    break
                nexts = [
                    start + r.events[r.next_event][0]
                    for r in self.runs
                    if r.next_event < len(r.events)
                ]
                delay = min([*nexts, now + self.poll_s]) - loop.time()
                if delay > 0:
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._stop.wait(), delay)
            pipe = self.client.pipeline(transaction=False)
            for ci, d in done_delta.items():
                if d:
                    pipe.hincrby(self.keys.progress, f"done:{ci}", d)
            await pipe.execute()
            self._print_progress(loop.time(), start)
        finally:
            for run in self.runs:
                with contextlib.suppress(Exception):
                    await run.router.aclose()
            with contextlib.suppress(Exception):
                await self.client.aclose()
        return [r.summary() for r in self.runs]
