"""One real-time run of the balance benchmark (``redisbal bench``).

One benchmark = for each scenario, for each seed, for each policy, one
real-time run on a real Redis (an embedded ``redis-server`` when no URL is
given; a fresh deployment name per run) with the real Lua scripts:

- simulated engines (``redisbal.sim.model``: continuous batching, running cap 64,
  step time growing with the batch, prefill cost, heavy-tailed output lengths,
  optional slow engines), each with its own ``AsyncReporter`` reporting
  after every step with ``admitted`` counts per API-server index. Lockstep mode:
  all engines step together, a step lasts as long as the slowest engine's,
  reporter mode "lockstep" with the shared step counter. Independent mode:
  one loop per engine, reporter mode "tick";
- one ``AsyncRouter`` per API server, each with its own connection and pub/sub;
- the ``Coordinator`` ticking on a thread (stall guard, expiry, idle publish);
- for the vLLM baselines, ``VllmCoordinatorEmulation``: a task that reads the
  engines' reports from Redis and replays vLLM's DP-coordinator publish loop
  (``VllmCoordinatorModel``) onto a compat key/channel in the same Snapshot
  format; the baseline routers subscribe to that instead of the barrier.

Same seed => same arrival times, output lengths, API-server assignment and
burst composition for every policy (``make_schedule``). The oracle
(``OraclePolicy``) routes with exact, instantaneous global state.

Metrics are pure functions in ``redisbal.bench.balance``. The harness
measures its own event-loop lag and says when a run cannot be trusted.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import secrets
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import redis.asyncio as aioredis

from redisbal.bench.balance import (
    burst_max_over_mean,
    load_imbalance,
    lockstep_efficiency,
    makespan,
    percentile,
)
from redisbal.bench.oracle import OraclePolicy, World
from redisbal.bench.scenarios import Arrival, Scenario, make_schedule
from redisbal.bench.vllm import (
    VLLM_POLICIES,
    CompatKeys,
    VllmCoordinatorEmulation,
    baseline_router,
    reports_before_step,
    vllm_model_for,
)
from redisbal.config import CoordinatorConfig
from redisbal.errors import SetupFailed
from redisbal.keys import DeploymentKeys
from redisbal.ops.coordinator import Coordinator
from redisbal.reporting.reporter import AsyncReporter, Counts
from redisbal.routing.policies import Policy
from redisbal.routing.router import AsyncRouter
from redisbal.sim.model import EngineParams, SimEngine, SimRequest

# event-loop lag (p99, s) above which a real-time run is flagged as untrustworthy
LAG_LIMIT_S = 0.020
# engines step back to back on their intended timeline while this far behind (s)
CATCH_UP_S = 0.010


# -- one real-time run ---------------------------------------------------------------------------


@dataclass
class RunResult:
    scenario: str
    policy: str
    seed: int
    metrics: dict[str, float]
    health: dict[str, Any]
    times: list[float] = field(default_factory=list)
    loads: list[list[float]] = field(default_factory=list)
    engine_ids: list[str] = field(default_factory=list)


class Run:
    """One scenario x policy x seed on a real Redis, in real time."""

    def __init__(
        self,
        sc: Scenario,
        policy: str,
        seed: int,
        url: str,
        *,
        params: EngineParams | None = None,
        keep_series: bool = True,
        prefix: str = "bench",
    ) -> None:
        self.sc = sc
        self.policy = policy
        self.seed = seed
        self.url = url
        self.params = params or EngineParams()
        self.keep_series = keep_series
        self.deployment = f"{prefix}-{sc.name}-{policy}-{seed}-{secrets.token_hex(3)}"
        self.keys = DeploymentKeys(self.deployment)
        self.world = World()
        self.reporters: dict[str, AsyncReporter] = {}
        self.wake: dict[str, asyncio.Event] = {}
        self.engine_order: list[str] = []
        self.routers: list[AsyncRouter] = []
        self.requests: list[SimRequest] = []
        self.done = 0
        self.total = 0
        self.stop = False
        self.tasks: list[asyncio.Task[Any]] = []
        self.lag: list[float] = []
        self.step_rows: list[list[float]] = []
        self.times: list[float] = []
        self.loads: list[list[float]] = []
        self.running_rows: list[list[float]] = []
        self.route_ns = 0
        self.t_base = 0.0
        self.work = asyncio.Event()
        self.compat: VllmCoordinatorEmulation | None = None
        self.coordinator: Coordinator | None = None
        self.coord_thread: threading.Thread | None = None
        self.proc_snapshots: list[int] = []  # per router process (ProcRun)
        self.before_step = reports_before_step(policy)

    # ---- engines ----

    def now(self) -> float:
        return time.monotonic() - self.t_base

    def _finish(self, req: SimRequest) -> None:
        self.routers[req.client_index].finished(req.decision)  # type: ignore[arg-type]
        self.done += 1

    async def add_engine(self, eid: str, slow: float = 1.0) -> None:
        p = replace(self.params, slow=slow)
        eng = SimEngine(eid, p, num_clients=self.sc.clients, on_finish=self._finish)
        mode = "lockstep" if self.sc.mode == "lockstep" else "tick"
        rep = AsyncReporter(self.url, self.deployment, eid, mode=mode)
        self.world.engines[eid] = eng
        self.world.transit.setdefault(eid, 0)
        self.reporters[eid] = rep
        self.wake[eid] = asyncio.Event()
        self.engine_order.append(eid)
        await rep.register()
        if mode == "lockstep":
            await rep.report(Counts(step=0, waiting=0, running=0, admitted=eng.admitted))
        else:
            await rep.report(Counts(waiting=0, running=0, admitted=eng.admitted))

    def _report(self, eid: str, step: int | None) -> None:
        e = self.world.engines[eid]
        self.reporters[eid].report_nowait(
            Counts(step, len(e.waiting), len(e.running), admitted=list(e.admitted))
        )

    def _step_start(self, intended: float) -> float:
        """When the next step starts: back to back with the previous one (its intended
        end) while the event loop keeps up within CATCH_UP_S, so that the loop's timer
        overshoot does not slow the simulated engines down; else now."""
        now = self.now()
        return intended if 0.0 <= now - intended <= CATCH_UP_S else now

    @staticmethod
    async def _let_reports_go() -> None:
        """Give the reporters' sender tasks a few loop turns to take the after-step
        report before the before-step one is queued (a reporter sends only its latest
        pending report), so the vLLM coordinator emulation gets both messages, as vLLM's
        does."""
        for _ in range(4):
            await asyncio.sleep(0)

    async def lockstep_loop(self) -> None:
        step = 0
        t_end = -1.0
        while not self.stop:
            live = [self.world.engines[i] for i in self.engine_order if i not in self.world.dead]
            if not any(e.busy() for e in live):
                self.work.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.work.wait(), 0.05)
                t_end = -1.0
                continue
            t0 = self._step_start(t_end)
            if self.before_step:  # vLLM >= PR 41626: counts again before the step
                for e in live:
                    e.take_inbox()
                    self._report(e.engine_id, step + 1)
            dur = max(e.begin_step(t0) for e in live)
            self.step_rows.append([float(len(e.running)) for e in live])
            t_end = t0 + dur
            await asyncio.sleep(max(0.0, t_end - self.now()))
            for e in live:
                e.end_step(t_end)
            step += 1
            for e in live:
                self._report(e.engine_id, step)
            if self.before_step:
                await self._let_reports_go()

    async def engine_loop(self, eid: str) -> None:
        e = self.world.engines[eid]
        wake = self.wake[eid]
        t_end = -1.0
        while not self.stop and eid not in self.world.dead:
            if not e.busy():
                wake.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(wake.wait(), 0.05)
                t_end = -1.0
                continue
            t0 = self._step_start(t_end)
            if self.before_step:  # vLLM >= PR 41626: counts again before the step
                e.take_inbox()
                self._report(eid, None)
            t_end = t0 + e.begin_step(t0)
            await asyncio.sleep(max(0.0, t_end - self.now()))
            if eid in self.world.dead:
                break
            e.end_step(t_end)
            self._report(eid, None)
            if self.before_step:
                await self._let_reports_go()

    async def kill_engine(self, eid: str) -> None:
        """A crash: the engine stops stepping and reporting; its requests are lost."""
        self.world.dead.add(eid)
        e = self.world.engines[eid]
        for req in [*e.inbox, *e.waiting, *e.running]:
            req.lost = True
            self._finish(req)
        e.inbox.clear()
        e.waiting.clear()
        e.running = []
        await self.reporters[eid].aclose(leave=False)

    # ---- harness health ----

    async def lag_monitor(self) -> None:
        period = 0.005
        while not self.stop:
            t = time.monotonic()
            await asyncio.sleep(period)
            self.lag.append(max(0.0, time.monotonic() - t - period))

    async def sampler(self) -> None:
        while not self.stop:
            row = []
            run_row = []
            for eid in self.engine_order:
                if eid in self.world.dead:
                    row.append(math.nan)
                    run_row.append(math.nan)
                else:
                    e = self.world.engines[eid]
                    row.append(float(e.load))
                    run_row.append(float(len(e.running)))
            self.times.append(self.now())
            self.loads.append(row)
            self.running_rows.append(run_row)
            await asyncio.sleep(0.01)

    # ---- traffic ----

    def _deliver(self, req: SimRequest) -> None:
        eid = req.engine_id
        self.world.transit[eid] -= 1
        if eid in self.world.dead or eid not in self.world.engines:
            req.lost = True
            self._finish(req)
            return
        self.world.engines[eid].arrive(req, self.now())
        self.wake[eid].set()
        self.work.set()

    async def traffic(self, schedule: Sequence[Arrival], start: float) -> None:
        loop = asyncio.get_running_loop()
        transit_s = 0.001
        i, n = 0, len(schedule)
        churn_at = start + (schedule[-1].t / 2 if schedule else 0.0)
        churned = not self.sc.churn
        while i < n and not self.stop:
            now = self.now()
            if not churned and now >= churn_at:
                churned = True
                await self.churn()
                continue
            while i < n and start + schedule[i].t <= now:
                a = schedule[i]
                router = self.routers[a.client]
                t = time.perf_counter_ns()
                d = router.route()
                self.route_ns += time.perf_counter_ns() - t
                req = SimRequest(
                    len(self.requests),
                    a.client,
                    a.output_len,
                    now,
                    decision=d,
                    engine_id=d.engine_id,
                    group=a.group,
                )
                self.requests.append(req)
                self.world.transit[d.engine_id] = self.world.transit.get(d.engine_id, 0) + 1
                loop.call_later(transit_s, self._deliver, req)
                i += 1
            if i < n:
                nxt = start + schedule[i].t
                if not churned:
                    nxt = min(nxt, churn_at)
                await asyncio.sleep(max(0.0, nxt - self.now()))

    async def churn(self) -> None:
        victim = self.engine_order[-1]
        await self.kill_engine(victim)
        eid = f"e{len(self.engine_order):02d}"
        await self.add_engine(eid)
        if self.sc.mode != "lockstep":
            self.tasks.append(asyncio.create_task(self.engine_loop(eid)))

    # ---- setup / teardown ----

    def _make_router(self, i: int) -> AsyncRouter:
        pol: str | Policy = OraclePolicy(self.world) if self.policy == "oracle" else self.policy
        return baseline_router(
            self.url,
            self.deployment,
            i,
            self.sc.clients,
            pol,
            random.Random(f"router-{self.seed}-{i}"),
            compat=self.policy in VLLM_POLICIES,
        )

    async def setup(self) -> None:
        ids = [f"e{i:02d}" for i in range(self.sc.engines)]
        cfg = CoordinatorConfig(
            dead_after_ms=1000, stall_ms=250, tick_ms=20, join_grace_ms=150, expected=ids
        )
        self.coordinator = Coordinator(self.url, self.deployment, cfg)
        await asyncio.to_thread(self.coordinator.tick)
        slow_from = self.sc.engines - self.sc.slow_engines
        for k, eid in enumerate(ids):
            await self.add_engine(eid, self.sc.slow_factor if k >= slow_from else 1.0)
        self.coord_thread = threading.Thread(
            target=self.coordinator.run, daemon=True, name="bench-coordinator"
        )
        self.coord_thread.start()
        if self.policy in VLLM_POLICIES:
            client = aioredis.Redis.from_url(self.url)
            self.compat = VllmCoordinatorEmulation(
                client, self.keys, vllm_model_for(self.policy, self.sc.mode)
            )
            self.tasks.append(asyncio.create_task(self.compat.run()))
        await self.start_routers(len(ids))

    async def start_routers(self, n_engines: int) -> None:
        """One AsyncRouter per API server in this process; wait for complete snapshots."""
        self.routers = [self._make_router(i) for i in range(self.sc.clients)]
        ids = range(n_engines)
        for r in self.routers:
            await r.start()
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            if all(
                r.snapshot is not None and len(r.core.engines) == len(ids) for r in self.routers
            ):
                break
            await asyncio.sleep(0.01)
        else:
            raise SetupFailed(f"{self.deployment}: routers got no complete snapshot within 10 s")

    async def finish_traffic(self) -> None:
        """Hook: called after the drain, before the metrics are computed."""

    async def teardown(self) -> None:
        self.stop = True
        if self.compat is not None:
            self.compat.stop()
        for t in self.tasks:
            t.cancel()
        for t in self.tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        for r in self.routers:
            await r.aclose()
        for eid, rep in self.reporters.items():
            if eid not in self.world.dead:
                with contextlib.suppress(Exception):
                    await rep.aclose(leave=False)
        if self.coordinator is not None:
            self.coordinator.stop()
        if self.coord_thread is not None:
            await asyncio.to_thread(self.coord_thread.join, 5)
        if self.compat is not None:
            with contextlib.suppress(Exception):
                await self.compat.client.aclose()
        client = aioredis.Redis.from_url(self.url)
        try:
            await client.delete(*self.keys.all_keys(), CompatKeys(self.deployment).snapshot)
        finally:
            await client.aclose()

    async def execute(self) -> RunResult:
        schedule = make_schedule(self.sc, self.seed, self.params)
        self.total = len(schedule)
        self.t_base = time.monotonic()
        try:
            await self.setup()
            self.tasks.append(asyncio.create_task(self.lag_monitor()))
            self.tasks.append(asyncio.create_task(self.sampler()))
            if self.sc.mode == "lockstep":
                self.tasks.append(asyncio.create_task(self.lockstep_loop()))
            else:
                for eid in list(self.engine_order):
                    self.tasks.append(asyncio.create_task(self.engine_loop(eid)))
            start = self.now() + 0.1
            lag_from = len(self.lag)
            await self.traffic(schedule, start)
            last = start + (schedule[-1].t if schedule else 0.0)
            deadline = time.monotonic() + self.sc.drain_s
            while self.done < self.total and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            end = self.now()
            await self.finish_traffic()
            return self.result(start, last, end, lag_from)
        finally:
            await self.teardown()

    # ---- metrics ----

    def result(self, start: float, last: float, end: float, lag_from: int) -> RunResult:
        reqs = self.requests
        started = [r for r in reqs if not r.lost]
        # a step that starts back to back (catch-up) may admit a request that arrived up
        # to CATCH_UP_S after the step's nominal start: count that as no delay
        delays = [
            max(0.0, (r.started_at if r.started_at >= 0 else end) - r.routed_at) for r in started
        ]
        groups: dict[int, list[SimRequest]] = {}
        for r in reqs:
            groups.setdefault(r.group, []).append(r)
        spans = []
        per_burst: list[list[int]] = []
        for _g, rs in sorted(groups.items()):
            ok = [r for r in rs if not r.lost]
            if ok:
                spans.append(
                    (
                        min(r.routed_at for r in ok),
                        max((r.finished_at if r.finished_at >= 0 else end) for r in ok),
                    )
                )
            counts = {eid: 0 for eid in self.engine_order if eid not in self.world.dead}
            for r in rs:
                if r.engine_id in counts:
                    counts[r.engine_id] += 1
            per_burst.append(list(counts.values()))
        win = [i for i, t in enumerate(self.times) if start <= t <= end]
        times = [self.times[i] for i in win]
        loads = [self.loads[i] for i in win]
        if self.sc.mode == "lockstep":
            eff = lockstep_efficiency(self.step_rows)
        else:
            eff = lockstep_efficiency([self.running_rows[i] for i in win])
        metrics = {
            "burst_max_over_mean": burst_max_over_mean(per_burst)
            if self.sc.traffic == "burst"
            else math.nan,
            "load_imbalance": load_imbalance(times, loads),
            "lockstep_efficiency": eff,
            "p99_queue_delay_s": percentile(delays, 99),
            "makespan_s": makespan(spans),
        }
        lag = self.lag[lag_from:]
        snaps = [r.core.counters["snapshots"] for r in self.routers] or self.proc_snapshots
        health = {
            "lag_p99_s": percentile(lag, 99),
            "lag_max_s": max(lag) if lag else 0.0,
            "requests": len(reqs),
            "unfinished": self.total - self.done,
            "lost": sum(1 for r in reqs if r.lost),
            "route_us": self.route_ns / max(1, len(reqs)) / 1000.0,
            "snapshots_per_router": sum(snaps) / max(1, len(snaps)),
            "degraded_routes": sum(r.core.counters["degraded_routes"] for r in self.routers),
            "coordinator_forced": self.coordinator.stats.forced if self.coordinator else 0,
            "duration_s": end - start,
        }
        return RunResult(
            self.sc.name,
            self.policy,
            self.seed,
            metrics,
            health,
            times if self.keep_series else [],
            loads if self.keep_series else [],
            list(self.engine_order),
        )
