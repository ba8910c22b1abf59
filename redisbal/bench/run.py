"""``redisbal bench``: the balance benchmark of DESIGN.md ("How balance is measured").

One benchmark = for each scenario, for each seed, for each policy, one
real-time run on a real Redis (an embedded ``redis-server`` when no URL is
given; a fresh deployment name per run) with the real Lua scripts:

- simulated engines (``redisbal.sim``: continuous batching, running cap 64,
  step time growing with the batch, prefill cost, heavy-tailed output lengths,
  optional slow engines), each with its own ``AsyncEngineReporter`` reporting
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

Metrics are pure functions in ``redisbal.metrics_balance``. The harness
measures its own event-loop lag and says when a run cannot be trusted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import random
import secrets
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import click
import orjson
import redis.asyncio as aioredis
from click.core import ParameterSource

from redisbal.cli import common_options, settings
from redisbal.coordinator import Coordinator, CoordinatorConfig
from redisbal.engine import AsyncEngineReporter
from redisbal.keys import DeploymentKeys
from redisbal.metrics_balance import (
    METRICS,
    burst_max_over_mean,
    gap_closed,
    gap_within_noise,
    load_imbalance,
    lockstep_efficiency,
    makespan,
    percentile,
    spread,
)
from redisbal.policies import EngineView, Policy, RouterCore
from redisbal.router import AsyncRouter
from redisbal.sim import EngineParams, SimEngine, SimRequest, output_length

BENCH_POLICIES = (
    "random",
    "round-robin",
    "vllm-pre",
    "vllm-21617",
    "vllm-latest",
    "redisbal",
    "oracle",
)
VLLM_POLICIES = ("vllm-pre", "vllm-21617", "vllm-latest")
# Engines report their counts after every step and, as vLLM's engines do since PR
# 41626, again right after the input queue was taken into the scheduler, before the
# step ("publish request counts before and after GPU step to ensure freshness":
# vllm/v1/engine/core.py, EngineCoreProc.run_busy_loop and
# DPEngineCoreProc.run_busy_loop); redisbal's reporter has the same option. The
# baselines of vLLM before 41626 get only the after-step reports, as their engines
# sent (DPEngineCoreProc.run_busy_loop published once, after _process_engine_step).
AFTER_STEP_ONLY_POLICIES = ("vllm-pre", "vllm-21617")
SCENARIO_NAMES = ("burst", "skew", "straggler", "churn", "steady")
# output lengths of the benchmark's requests: lognormal, mean 40 tokens, capped
OUT_MEAN, OUT_SIGMA, OUT_CAP = 40.0, 1.0, 160
# event-loop lag (p99, s) above which a real-time run is flagged as untrustworthy
LAG_LIMIT_S = 0.020
# engines step back to back on their intended timeline while this far behind (s)
CATCH_UP_S = 0.010


# -- scenarios and schedules -------------------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    """One row of DESIGN.md's scenario table, plus how the benchmark drives it."""

    name: str
    engines: int = 32
    clients: int = 8
    mode: str = "lockstep"  # "lockstep" or "independent"
    traffic: str = "burst"  # "burst" or "poisson"
    burst_factor: float = 1.5  # burst size as a multiple of engines x running cap
    burst_window_s: float = 0.05
    burst_every_s: float = 3.0
    bursts: int = 4
    skew: float | None = None  # share of all traffic that API server 0 gets
    slow_engines: int = 0
    slow_factor: float = 2.0
    load: float = 0.9  # Poisson: fraction of the deployment's throughput
    duration_s: float = 8.0  # Poisson: length of the arrival process
    churn: bool = False  # one engine dies and one joins midway
    drain_s: float = 6.0  # after the last arrival, wait at most this for completion
    router_processes: bool = False  # routers in separate processes

    def describe(self) -> str:
        if self.traffic == "burst":
            t = (
                f"{self.bursts} bursts of {self.burst_factor:g}x capacity within "
                f"{self.burst_window_s * 1000:.0f} ms every {self.burst_every_s:g} s"
            )
        else:
            t = f"Poisson at {self.load:.0%} load for {self.duration_s:g} s"
        extra = []
        if self.skew:
            extra.append(f"API server 0 gets {self.skew:.0%} of traffic")
        if self.slow_engines:
            extra.append(f"{self.slow_engines} engines step {self.slow_factor:g}x slower")
        if self.churn:
            extra.append("one engine dies and one joins midway")
        if self.router_processes:
            extra.append("routers in separate processes")
        return (
            f"{self.engines} engines x {self.clients} API servers, {self.mode} engines; "
            + t
            + ("; " + "; ".join(extra) if extra else "")
        )


def default_scenarios(quick: bool = False) -> dict[str, Scenario]:
    """DESIGN.md's five scenarios. Full: 4 bursts (each followed by its 3 s period:
    the last one drains for at most 3 s), 6 s of Poisson. ``quick``: 2 bursts and
    1.5 s after the last, 2 s of Poisson and 0.5 s after; runs end there and what
    is unfinished is censored at the end (makespan in quick runs is a lower bound)."""
    bursts, drain = (2, 1.5) if quick else (4, 3.0)
    dur, pdrain = (2.0, 0.5) if quick else (6.0, 3.0)
    return {
        "burst": Scenario("burst", mode="lockstep", bursts=bursts, drain_s=drain),
        "skew": Scenario("skew", mode="lockstep", bursts=bursts, skew=0.5, drain_s=drain),
        "straggler": Scenario(
            "straggler", mode="independent", bursts=bursts, slow_engines=4, drain_s=drain
        ),
        "churn": Scenario(
            "churn",
            mode="independent",
            traffic="poisson",
            load=0.85,
            duration_s=dur,
            churn=True,
            drain_s=pdrain,
        ),
        "steady": Scenario(
            "steady",
            mode="independent",
            traffic="poisson",
            load=0.9,
            duration_s=dur,
            drain_s=pdrain,
        ),
    }


@dataclass(frozen=True, slots=True)
class Arrival:
    t: float  # seconds after the traffic start
    client: int  # API-server index
    output_len: int
    group: int  # burst index, or 0 for Poisson traffic


def mean_output_len(samples: int = 20000) -> float:
    rng = random.Random(12345)
    return sum(output_length(rng, OUT_MEAN, OUT_SIGMA, OUT_CAP) for _ in range(samples)) / samples


def throughput_per_engine(params: EngineParams) -> float:
    """Requests per second one engine completes at a full batch."""
    m = mean_output_len()
    cap = params.running_cap
    return (cap / m) / params.step_time(cap, round(cap / m))


def _pick_client(rng: random.Random, clients: int, skew: float | None) -> int:
    if skew is None or clients == 1:
        return rng.randrange(clients)
    if rng.random() < skew:
        return 0
    return 1 + rng.randrange(clients - 1)


def make_schedule(sc: Scenario, seed: int, params: EngineParams | None = None) -> list[Arrival]:
    """Every arrival of one run, from the seed alone: the same for every policy."""
    params = params or EngineParams()
    rng = random.Random(f"schedule-{sc.name}-{seed}")
    out: list[Arrival] = []
    if sc.traffic == "burst":
        size = round(sc.burst_factor * sc.engines * params.running_cap)
        for b in range(sc.bursts):
            start = b * sc.burst_every_s
            times = sorted(rng.random() * sc.burst_window_s for _ in range(size))
            for t in times:
                c = _pick_client(rng, sc.clients, sc.skew)
                out.append(
                    Arrival(start + t, c, output_length(rng, OUT_MEAN, OUT_SIGMA, OUT_CAP), b)
                )
    else:
        rate = sc.load * sc.engines * throughput_per_engine(params)
        t = 0.0
        while True:
            t += rng.expovariate(rate)
            if t >= sc.duration_s:
                break
            c = _pick_client(rng, sc.clients, sc.skew)
            out.append(Arrival(t, c, output_length(rng, OUT_MEAN, OUT_SIGMA, OUT_CAP), 0))
    return out


# -- the vLLM DP coordinator, replayed ----------------------------------------------------------


@dataclass
class EngineStat:
    waiting: int
    running: int
    score: int  # (wave, step) as wave * 2**32 + step
    t_ms: float


class VllmCoordinatorModel:
    """vLLM's ``DPCoordinatorProc`` publish loop, driven by timed stats messages.

    The loop polls its sockets with timeout ``max(min_timeout, wait_for - elapsed)``
    where wait_for is 100 ms while stats changed and 5 s otherwise; it publishes
    only when a poll times out (no message arrived for that long). With
    ``buffered`` (PR 21617): when the first stats of a newer (wave, step) arrive
    and stats changed, it keeps a copy of all counts as of the previous step and
    publishes that copy next; while no copy is pending, ``min_wait_ms`` (50)
    is the least a poll waits. Without ``buffered`` (before 21617): the latest
    counts. Engines send stats only when their counts change; ``on_stats``
    expects only such messages (``VllmCoordinatorEmulation`` filters).

    Pure: time is whatever the caller passes (ms), so tests replay it exactly.
    """

    def __init__(
        self,
        *,
        buffered: bool,
        min_wait_ms: float = 50.0,
        interval_ms: float = 100.0,
        idle_ms: float = 5000.0,
    ) -> None:
        self.buffered = buffered
        self.min_wait_ms = min_wait_ms if buffered else 0.0
        self.interval_ms = interval_ms
        self.idle_ms = idle_ms
        self.counts: dict[str, EngineStat] = {}
        self.last_step_counts: dict[str, EngineStat] | None = None
        self.current = -1
        self.stats_changed = False
        self.last_publish = -1e18  # vLLM starts from 0 ms since the epoch: publish at once
        self.poll_start: float | None = None
        self.published = 0

    def _timeout(self, at: float) -> float:
        wait_for = self.interval_ms if self.stats_changed else self.idle_ms
        min_t = self.min_wait_ms if self.last_step_counts is None else 0.0
        return max(min_t, wait_for - (at - self.last_publish))

    def advance(self, now_ms: float) -> list[tuple[float, dict[str, EngineStat]]]:
        """Publishes whose poll timed out before ``now_ms``: [(time, counts)]."""
        out: list[tuple[float, dict[str, EngineStat]]] = []
        if self.poll_start is None:
            self.poll_start = now_ms
            return out
        for _ in range(10_000):  # bounded: each iteration moves time forward
            fire = self.poll_start + self._timeout(self.poll_start)
            if fire >= now_ms:
                break
            out.append((fire, self._publish(fire)))
            self.poll_start = fire
        return out

    def _publish(self, at: float) -> dict[str, EngineStat]:
        if self.last_step_counts is not None:
            counts, self.last_step_counts = self.last_step_counts, None
        else:
            counts = dict(self.counts)
            self.stats_changed = False
        self.last_publish = at
        self.published += 1
        return counts

    def on_stats(
        self, t_ms: float, engine: str, score: int, waiting: int, running: int
    ) -> list[tuple[float, dict[str, EngineStat]]]:
        """One engine's changed counts arrive at t_ms; returns publishes that fired
        before it."""
        pubs = self.advance(t_ms)
        if self.buffered and score > self.current:
            if self.stats_changed:
                self.last_step_counts = dict(self.counts)
            self.current = score
        elif score > self.current:
            self.current = score
        self.counts[engine] = EngineStat(waiting, running, score, t_ms)
        self.stats_changed = True
        self.poll_start = t_ms
        return pubs

    def remove(self, engine: str) -> None:
        """An engine left the deployment (expired / left)."""
        self.counts.pop(engine, None)


def compat_snapshot_json(
    deployment: str, epoch: str, version: int, at_ms: float, counts: dict[str, EngineStat]
) -> bytes:
    """A vLLM push as a redisbal Snapshot JSON (no admitted counts: vLLM has none)."""
    step = max((c.score for c in counts.values()), default=0)
    wave, st = divmod(step, 2**32)
    return orjson.dumps(
        {
            "deployment": deployment,
            "epoch": epoch,
            "version": version,
            "wave": wave,
            "step": st,
            "forced": False,
            "laggards": {},
            "gone": {},
            "joining": [],
            "time_ms": int(at_ms),
            "engines": {
                e: {
                    "wave": c.score // 2**32,
                    "step": c.score % 2**32,
                    "waiting": c.waiting,
                    "running": c.running,
                    "kv": None,
                    "t": int(c.t_ms),
                }
                for e, c in sorted(counts.items())
            },
        }
    )


class VllmCoordinatorEmulation:
    """Feeds ``VllmCoordinatorModel`` from the engines' reports in Redis (the reports
    hash, polled every ``poll_s``) and publishes its pushes on the compat key/channel.

    Messages are the report entries in server-time order, kept only when an engine's
    (waiting, running) changed, as vLLM engines send stats only on change.
    """

    def __init__(
        self,
        client: Any,
        keys: DeploymentKeys,
        model: VllmCoordinatorModel,
        *,
        poll_s: float = 0.005,
    ) -> None:
        self.client = client
        self.keys = keys
        self.model = model
        self.poll_s = poll_s
        self.newest: dict[str, str] = {}  # engine -> newest line seen
        self.last_counts: dict[str, tuple[int, int]] = {}
        self.epoch = ""
        self.version = 0
        self._stop = False

    def extract(self, raw: dict[Any, Any]) -> list[tuple[float, str, int, int, int]]:
        """New (t_ms, engine, score, waiting, running) messages, oldest first."""
        msgs: list[tuple[float, str, int, int, int]] = []
        seen = set()
        for k, v in raw.items():
            eng = k.decode() if isinstance(k, bytes) else k
            rec = v.decode() if isinstance(v, bytes) else v
            seen.add(eng)
            # report lines are "<score>\t[<ms>\t]<json>", newest first; other lines
            # (a record's head line with flags / heartbeat time) are skipped
            lines = [ln for ln in rec.split("\n") if "\t" in ln]
            if not lines:
                continue
            if self.newest.get(eng) == lines[0]:
                continue
            prev = self.newest.get(eng)
            fresh = []
            for line in lines:
                if line == prev:
                    break
                fresh.append(line)
            self.newest[eng] = lines[0]
            for line in reversed(fresh):
                score_s, _, rest = line.partition("\t")
                d = orjson.loads(rest[rest.index("{") :])
                wr = (d["waiting"], d["running"])
                if self.last_counts.get(eng) == wr:
                    continue
                self.last_counts[eng] = wr
                msgs.append((float(d["t"]), eng, int(float(score_s)), wr[0], wr[1]))
        for eng in list(self.newest):
            if eng not in seen:
                del self.newest[eng]
                self.last_counts.pop(eng, None)
                self.model.remove(eng)
        msgs.sort()
        return msgs

    async def publish(self, at: float, counts: dict[str, EngineStat]) -> None:
        self.version += 1
        data = compat_snapshot_json(self.keys.deployment, self.epoch, self.version, at, counts)
        pipe = self.client.pipeline(transaction=False)
        pipe.set(self.keys.compat, data)
        pipe.publish(self.keys.compat_channel, data)
        await pipe.execute()

    async def run(self) -> None:
        ep = await self.client.get(self.keys.epoch)
        self.epoch = (ep.decode() if isinstance(ep, bytes) else ep) or "compat"
        while not self._stop:
            now = time.time() * 1000.0
            raw = await self.client.hgetall(self.keys.reports)
            pubs = []
            for t, eng, score, w, r in self.extract(raw):
                pubs += self.model.on_stats(t, eng, score, w, r)
            pubs += self.model.advance(now)
            for at, counts in pubs:
                await self.publish(at, counts)
            await asyncio.sleep(self.poll_s)

    def stop(self) -> None:
        self._stop = True


def reports_before_step(policy: str) -> bool:
    """Whether the engines of this policy's system also report right before each step
    (after taking their input queue into the scheduler): every policy but the
    baselines of vLLM before PR 41626."""
    return policy not in AFTER_STEP_ONLY_POLICIES


def vllm_model_for(policy: str, mode: str) -> VllmCoordinatorModel:
    """vllm-pre: latest counts. vllm-21617: step-buffered, 50 ms least wait. vllm-latest:
    21617's buffering; its 50 ms least wait applies only with wave coordination (lockstep)."""
    if policy == "vllm-pre":
        return VllmCoordinatorModel(buffered=False)
    if policy == "vllm-21617":
        return VllmCoordinatorModel(buffered=True, min_wait_ms=50.0)
    if policy == "vllm-latest":
        return VllmCoordinatorModel(buffered=True, min_wait_ms=50.0 if mode == "lockstep" else 0.0)
    raise ValueError(f"not a vLLM policy: {policy}")


# -- the oracle -----------------------------------------------------------------------------------


@dataclass
class World:
    """What the oracle may see: every live engine's exact state, and requests in transit."""

    engines: dict[str, SimEngine] = field(default_factory=dict)
    dead: set[str] = field(default_factory=set)
    transit: dict[str, int] = field(default_factory=dict)

    def load(self, engine_id: str) -> float:
        e = self.engines.get(engine_id)
        if e is None or engine_id in self.dead:
            return math.inf
        return e.load + self.transit.get(engine_id, 0)


class OraclePolicy(Policy):
    """Join-the-shortest-queue on exact, instantaneous global state (waiting + running
    + in transit, over all API servers), uniform random tie-break. Greedy: a reference
    point, not an upper bound."""

    name = "oracle"

    def __init__(self, world: World) -> None:
        self.world = world

    def pick(self, core: RouterCore) -> EngineView:
        best: EngineView | None = None
        best_load = math.inf
        ties = 0
        rnd = core.rng.random
        for e in core.engines:
            load = self.world.load(e.engine_id)
            if load < best_load:
                best, best_load, ties = e, load, 1
            elif load == best_load and load < math.inf:
                ties += 1
                if rnd() * ties < 1.0:
                    best = e
        return best if best is not None else core.engines[0]


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
        self.reporters: dict[str, AsyncEngineReporter] = {}
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
        rep = AsyncEngineReporter(self.url, self.deployment, eid, mode=mode)
        self.world.engines[eid] = eng
        self.world.transit.setdefault(eid, 0)
        self.reporters[eid] = rep
        self.wake[eid] = asyncio.Event()
        self.engine_order.append(eid)
        await rep.register()
        if mode == "lockstep":
            await rep.report(step=0, waiting=0, running=0, admitted=eng.admitted)
        else:
            await rep.report(waiting=0, running=0, admitted=eng.admitted)

    def _report(self, eid: str, step: int | None) -> None:
        e = self.world.engines[eid]
        self.reporters[eid].report_nowait(
            step, len(e.waiting), len(e.running), admitted=list(e.admitted)
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
        kw: dict[str, Any] = {}
        if self.policy in VLLM_POLICIES:
            kw = {"channel": self.keys.compat_channel, "snapshot_key": self.keys.compat}
        return AsyncRouter(
            self.url,
            self.deployment,
            i,
            self.sc.clients,
            policy=pol,
            rng=random.Random(f"router-{self.seed}-{i}"),
            **kw,
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
            raise RuntimeError(f"{self.deployment}: routers got no complete snapshot within 10 s")

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
            await client.delete(*self.keys.all_keys(), self.keys.compat)
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


# -- routers in separate processes ----------------------------------------------------------------


def _router_process(
    url: str, deployment: str, policy: str, index: int, sc: Scenario, seed: int, t_base: float
) -> None:
    """Entry point of one API-server process (spawned): see ProcRun."""
    asyncio.run(_router_main(url, deployment, policy, index, sc, seed, t_base))


async def _router_main(
    url: str, deployment: str, policy: str, index: int, sc: Scenario, seed: int, t_base: float
) -> None:
    keys = DeploymentKeys(deployment)
    kw: dict[str, Any] = {}
    if policy in VLLM_POLICIES:
        kw = {"channel": keys.compat_channel, "snapshot_key": keys.compat}
    router = AsyncRouter(
        url,
        deployment,
        index,
        sc.clients,
        policy=policy,
        rng=random.Random(f"router-{seed}-{index}"),
        **kw,
    )
    client = aioredis.Redis.from_url(url)
    try:
        await router.start(wait=10.0)
        await client.sadd(keys.key("bench:ready"), index)
        start = None
        deadline = time.monotonic() + 60.0
        while start is None and time.monotonic() < deadline:
            v = await client.get(keys.key("bench:start"))
            if v is not None:
                start = float(v)
            else:
                await asyncio.sleep(0.005)
        if start is None:
            return
        sched = [(k, a) for k, a in enumerate(make_schedule(sc, seed)) if a.client == index]
        decisions: dict[int, Any] = {}
        routed_key, done_key = keys.key("bench:routed"), keys.key(f"bench:done:{index}")
        i, n = 0, len(sched)
        next_stop_check = 0.0
        route_ns = 0
        while time.monotonic() < deadline + 120.0:
            now = time.monotonic() - t_base
            buf = []
            while i < n and start + sched[i][1].t <= now:
                k = sched[i][0]
                t = time.perf_counter_ns()
                d = router.route()
                route_ns += time.perf_counter_ns() - t
                decisions[k] = d
                buf.append(f"{k} {d.engine_id} {now:.6f}")
                i += 1
            pipe = client.pipeline(transaction=False)
            if buf:
                pipe.rpush(routed_key, *buf)
            pipe.lpop(done_key, 1024)
            res = await pipe.execute()
            for rid in res[-1] or []:
                dec = decisions.pop(int(rid), None)
                if dec is not None:
                    router.finished(dec)
            if i >= n and now >= next_stop_check:
                next_stop_check = now + 0.05
                if await client.exists(keys.key("bench:stop")):
                    break
            wait = 0.01 if i >= n else min(0.005, max(0.0, start + sched[i][1].t - now))
            await asyncio.sleep(wait)
        c = router.core.counters
        await client.hset(
            keys.key(f"bench:stats:{index}"),
            mapping={"snapshots": c["snapshots"], "route_ns": route_ns, "routes": c["routes"]},
        )
    finally:
        await router.aclose()
        await client.aclose()


class ProcRun(Run):
    """As Run, but each API server's router runs in its own process (spawned), with its
    own Redis connections; requests travel router -> engines over a Redis list and
    completions back over one list per router (the "RPC" of this simulation)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.procs: list[Any] = []
        self.done_buf: dict[int, list[int]] = {}
        self.routed = 0
        self.aio: Any = None
        self.schedule: list[Arrival] = []

    def _finish(self, req: SimRequest) -> None:
        self.done_buf.setdefault(req.client_index, []).append(req.rid)
        self.done += 1

    async def start_routers(self, n_engines: int) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self.aio = aioredis.Redis.from_url(self.url)
        for i in range(self.sc.clients):
            p = ctx.Process(
                target=_router_process,
                args=(self.url, self.deployment, self.policy, i, self.sc, self.seed, self.t_base),
                daemon=True,
            )
            p.start()
            self.procs.append(p)
        deadline = time.monotonic() + 60.0
        while time.monotonic() < deadline:
            if await self.aio.scard(self.keys.key("bench:ready")) >= self.sc.clients:
                return
            if any(p.exitcode not in (None, 0) for p in self.procs):
                break
            await asyncio.sleep(0.05)
        raise RuntimeError(f"{self.deployment}: router processes did not get ready")

    async def pump(self) -> None:
        """Deliver routed requests to the engines; send completions back."""
        routed_key = self.keys.key("bench:routed")
        while not self.stop:
            pipe = self.aio.pipeline(transaction=False)
            pipe.lpop(routed_key, 4096)
            for ci, rids in self.done_buf.items():
                if rids:
                    pipe.rpush(self.keys.key(f"bench:done:{ci}"), *rids)
            self.done_buf = {}
            res = await pipe.execute()
            for item in res[0] or []:
                k_s, eid, t_s = item.decode().split(" ")
                a = self.schedule[int(k_s)]
                req = SimRequest(
                    int(k_s), a.client, a.output_len, float(t_s), engine_id=eid, group=a.group
                )
                self.requests.append(req)
                self.routed += 1
                self.world.transit[eid] = self.world.transit.get(eid, 0) + 1
                self._deliver(req)
            await asyncio.sleep(0.001)

    async def traffic(self, schedule: Sequence[Arrival], start: float) -> None:
        self.schedule = list(schedule)
        self.tasks.append(asyncio.create_task(self.pump()))
        await self.aio.set(self.keys.key("bench:start"), repr(start))
        last = start + (schedule[-1].t if schedule else 0.0)
        churned = not self.sc.churn
        churn_at = start + (schedule[-1].t / 2 if schedule else 0.0)
        deadline = time.monotonic() + (last - self.now()) + 10.0
        while self.routed < len(schedule) and time.monotonic() < deadline:
            if not churned and self.now() >= churn_at:
                churned = True
                await self.churn()
            await asyncio.sleep(0.005)

    async def finish_traffic(self) -> None:
        """Stop the router processes and collect their counters."""
        if self.aio is None:
            return
        with contextlib.suppress(Exception):
            await self.aio.set(self.keys.key("bench:stop"), "1")
        for p in self.procs:
            await asyncio.to_thread(p.join, 5)
        with contextlib.suppress(Exception):
            for i in range(self.sc.clients):
                st = await self.aio.hgetall(self.keys.key(f"bench:stats:{i}"))
                if st:
                    self.proc_snapshots.append(int(st[b"snapshots"]))
                    self.route_ns += int(st[b"route_ns"])

    async def teardown(self) -> None:
        if self.aio is not None:
            with contextlib.suppress(Exception):
                await self.aio.set(self.keys.key("bench:stop"), "1")
            for p in self.procs:
                await asyncio.to_thread(p.join, 5)
                if p.is_alive():
                    p.terminate()
            with contextlib.suppress(Exception):
                extra = ["routed", "start", "stop", "ready"]
                extra += [f"done:{i}" for i in range(self.sc.clients)]
                extra += [f"stats:{i}" for i in range(self.sc.clients)]
                await self.aio.delete(*(self.keys.key(f"bench:{x}") for x in extra))
            await self.aio.aclose()
        await super().teardown()


# -- the whole benchmark --------------------------------------------------------------------------


@dataclass
class BenchConfig:
    scenarios: list[str]
    policies: list[str]
    seeds: list[int]
    quick: bool = False
    redis_url: str | None = None
    router_processes: list[str] = field(default_factory=list)
    prefix: str = "bench"  # each run's deployment is <prefix>-<scenario>-<policy>-<seed>-<hex>


class Progress:
    """One line on stderr: run i/N, scenario, policy, seed, ETA."""

    def __init__(self, total: int, stream: Any = None) -> None:
        self.total = total
        self.i = 0
        self.t0 = time.monotonic()
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()

    def show(self, label: str) -> None:
        self.i += 1
        el = time.monotonic() - self.t0
        eta = el / (self.i - 1) * (self.total - self.i + 1) if self.i > 1 else float("nan")
        width = 24
        done = int(width * (self.i - 1) / max(1, self.total))
        bar = "#" * done + "-" * (width - done)
        eta_s = "--:--" if math.isnan(eta) else f"{int(eta) // 60:02d}:{int(eta) % 60:02d}"
        line = f"[{bar}] run {self.i}/{self.total} {label} ETA {eta_s}"
        if self.tty:
            self.stream.write("\r\033[K" + line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        el = time.monotonic() - self.t0
        msg = f"{self.total} runs in {el:.0f} s"
        self.stream.write(("\r\033[K" if self.tty else "") + msg + "\n")
        self.stream.flush()


def bench_scenarios(cfg: BenchConfig) -> dict[str, Scenario]:
    """The scenarios of a benchmark, in order: the chosen ones, plus "<name>-procs"
    (the same scenario with routers in separate processes) for --router-processes."""
    base = default_scenarios(cfg.quick)
    out = {s: base[s] for s in cfg.scenarios}
    for s in cfg.router_processes:
        out[f"{s}-procs"] = replace(base[s], name=f"{s}-procs", router_processes=True)
    return out


async def run_all(
    cfg: BenchConfig, on_result: Callable[[RunResult], None] | None = None
) -> list[RunResult]:
    scenarios = bench_scenarios(cfg)
    server = None
    url = cfg.redis_url
    if not url:
        from redisbal.embedded import RedisServer

        server = RedisServer().start()
        url = server.url
    results: list[RunResult] = []
    runs = [(s, seed, p) for s in scenarios for seed in cfg.seeds for p in cfg.policies]
    prog = Progress(len(runs))
    try:
        for s, seed, p in runs:
            sc = scenarios[s]
            prog.show(f"{s:<11} {p:<11} seed {seed}")
            if sc.router_processes and p != "oracle":
                res = await ProcRun(
                    sc, p, seed, url, keep_series=seed == cfg.seeds[0], prefix=cfg.prefix
                ).execute()
            else:
                res = await Run(
                    sc, p, seed, url, keep_series=seed == cfg.seeds[0], prefix=cfg.prefix
                ).execute()
            results.append(res)
            if on_result:
                on_result(res)
    finally:
        prog.close()
        if server is not None:
            server.cleanup()
    return results


def run_all_simulated(cfg: BenchConfig) -> list[RunResult]:
    """The same runs on the discrete-event simulator (``bench_scale.simulate``)."""
    from redisbal.bench_scale import simulate

    scenarios = bench_scenarios(cfg)
    runs = [(s, seed, p) for s in scenarios for seed in cfg.seeds for p in cfg.policies]
    prog = Progress(len(runs))
    out = []
    try:
        for s, seed, p in runs:
            sc = scenarios[s]
            if sc.churn:
                raise click.ClickException("--sim-clock cannot run churn (no membership model)")
            prog.show(f"{s:<11} {p:<11} seed {seed} (simulated clock)")
            m = simulate(p, seed, sc)
            metrics = {k: m[k] for k in METRICS if k in m}
            if sc.traffic != "burst":
                metrics["burst_max_over_mean"] = math.nan
            health = {
                "lag_p99_s": 0.0,
                "lost": 0,
                "unfinished": 0,
                "route_us": 0.0,
                "snapshots_per_router": 0,
            }
            out.append(RunResult(s, p, seed, metrics, health))
    finally:
        prog.close()
    return out


def summarize(results: list[RunResult], policies: Sequence[str]) -> dict[str, Any]:
    """The JSON document: scenarios/policy/metric means, gap closed, spread, noise flags."""
    by: dict[str, dict[str, dict[str, list[float]]]] = {}
    health: dict[str, dict[str, dict[str, float]]] = {}
    for r in results:
        for m, v in r.metrics.items():
            by.setdefault(r.scenario, {}).setdefault(r.policy, {}).setdefault(m, []).append(v)
        h = health.setdefault(r.scenario, {}).setdefault(r.policy, {"lag_p99_s": 0.0})
        h["lag_p99_s"] = max(h["lag_p99_s"], r.health["lag_p99_s"])
        h["lost"] = h.get("lost", 0) + r.health["lost"]
        h["unfinished"] = h.get("unfinished", 0) + r.health["unfinished"]
        h["route_us"] = max(h.get("route_us", 0.0), r.health["route_us"])
        h["snapshots_per_router"] = r.health["snapshots_per_router"]
    out: dict[str, Any] = {
        "scenarios": {},
        "gap_closed": {},
        "spread": {},
        "gap_closed_spread": {},
        "gap_within_noise": {},
        "health": health,
    }
    for sc, pols in by.items():
        out["scenarios"][sc] = {}
        out["spread"][sc] = {}
        for p in policies:
            if p not in pols:
                continue
            out["scenarios"][sc][p] = {}
            out["spread"][sc][p] = {}
            for m, vs in pols[p].items():
                if any(math.isnan(v) for v in vs):
                    continue
                s = spread(vs)
                out["scenarios"][sc][p][m] = s.mean
                out["spread"][sc][p][m] = {"min": s.lo, "max": s.hi, "std": s.std, "n": s.n}
        if all(p in pols for p in ("vllm-21617", "redisbal", "oracle")):
            gc: dict[str, float | None] = {}
            gcs: dict[str, Any] = {}
            noise: dict[str, bool | None] = {}
            for m in METRICS:
                a, b, c = (pols[p].get(m, []) for p in ("vllm-21617", "redisbal", "oracle"))
                if not a or any(math.isnan(v) for v in a):
                    continue
                gc[m] = gap_closed(*(sum(x) / len(x) for x in (a, b, c)))
                per_seed = [gap_closed(x, y, z) for x, y, z in zip(a, b, c, strict=True)]
                vals = [v for v in per_seed if v is not None]
                gcs[m] = {"min": min(vals), "max": max(vals)} if vals else None
                noise[m] = gap_within_noise(a, c)
            out["gap_closed"][sc] = gc
            out["gap_closed_spread"][sc] = gcs
            out["gap_within_noise"][sc] = noise
    return out


def _fmt(v: float | None, m: str = "") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if m.endswith("_s"):
        return f"{v:.3f}"
    return f"{v:.3f}"


def tables(doc: dict[str, Any], scenarios: dict[str, Scenario]) -> str:
    """A plain-text table per scenario (policy x metric, mean [min-max] over seeds)."""
    lines = []
    for sc, pols in doc["scenarios"].items():
        desc = scenarios[sc].describe() if sc in scenarios else ""
        lines.append(f"\n== {sc}: {desc}")
        hdr = f"{'policy':<12}" + "".join(f"{m:>26}" for m in METRICS) + f"{'lag p99 ms':>12}"
        lines.append(hdr)
        for p, ms in pols.items():
            cells = []
            for m in METRICS:
                if m not in ms:
                    cells.append(f"{'-':>26}")
                    continue
                sp = doc["spread"][sc][p][m]
                txt = _fmt(ms[m], m)
                if sp["n"] > 1:
                    txt += f" [{_fmt(sp['min'], m)}-{_fmt(sp['max'], m)}]"
                cells.append(f"{txt:>26}")
            lag = doc["health"][sc][p]["lag_p99_s"] * 1000
            flag = " !" if lag > LAG_LIMIT_S * 1000 else ""
            lines.append(f"{p:<12}" + "".join(cells) + f"{lag:>10.1f}{flag}")
        if sc in doc["gap_closed"]:
            gc = doc["gap_closed"][sc]
            parts = []
            for m, v in gc.items():
                noise = doc["gap_within_noise"][sc].get(m)
                tag = " (gap within noise)" if noise else (" (1 seed)" if noise is None else "")
                parts.append(f"{m}={_fmt(v)}{tag}")
            lines.append("gap closed: " + ", ".join(parts))
    return "\n".join(lines)


def markdown(doc: dict[str, Any]) -> str:
    """The results as Markdown tables (for docs/BENCHMARKS.md): per scenario, policy x
    metric as mean [min-max] over seeds, lag p99 per policy; then gap closed."""
    out = []
    descs = {s: d for s, d in doc.get("meta", {}).get("scenarios", {}).items()}
    for sc, pols in doc["scenarios"].items():
        d = descs.get(sc)
        title = f"#### {sc}"
        if d:
            title += f" ({Scenario(**d).describe()})"
        out += [title, ""]
        ms = [m for m in METRICS if any(m in v for v in pols.values())]
        out.append("| policy | " + " | ".join(ms) + " | lag p99 ms |")
        out.append("|---" * (len(ms) + 2) + "|")
        for p, vals in pols.items():
            cells = []
            for m in ms:
                if m not in vals:
                    cells.append("-")
                    continue
                sp = doc["spread"][sc][p][m]
                txt = f"{vals[m]:.3f}"
                if sp["n"] > 1:
                    txt += f" [{sp['min']:.3f}-{sp['max']:.3f}]"
                cells.append(f"**{txt}**" if p == "redisbal" else txt)
            lag = doc["health"][sc][p]["lag_p99_s"] * 1000
            flag = " !" if lag > LAG_LIMIT_S * 1000 else ""
            out.append(f"| {p} | " + " | ".join(cells) + f" | {lag:.1f}{flag} |")
        out.append("")
    gc = doc.get("gap_closed", {})
    if gc:
        ms = [m for m in METRICS if any(m in v for v in gc.values())]
        out += ["#### gap closed = (vllm-21617 - redisbal) / (vllm-21617 - oracle)", ""]
        out.append("| scenario | " + " | ".join(ms) + " |")
        out.append("|---" * (len(ms) + 1) + "|")
        for sc, vals in gc.items():
            cells = []
            for m in ms:
                v = vals.get(m)
                if v is None:
                    cells.append("-" if m not in vals else "no gap")
                    continue
                txt = f"{v:.2f}"
                sp = doc.get("gap_closed_spread", {}).get(sc, {}).get(m)
                if sp and doc["spread"][sc]["redisbal"][m]["n"] > 1:
                    txt += f" [{sp['min']:.2f}..{sp['max']:.2f}]"
                noise = doc.get("gap_within_noise", {}).get(sc, {}).get(m)
                if noise:
                    txt += " (gap within noise)"
                elif noise is None:
                    txt += " (1 seed)"
                cells.append(txt)
            out.append(f"| {sc} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


# -- plots --------------------------------------------------------------------------------


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise click.ClickException("--plot needs matplotlib: pip install 'redisbal[plot]'") from exc
    return plt


def write_plots(results: list[RunResult], doc: dict[str, Any], out_dir: str) -> list[str]:
    """One PNG per scenario (per-engine load over time, one panel per policy, first seed)
    and one bar chart of gap closed."""
    plt = _pyplot()
    os.makedirs(out_dir, exist_ok=True)
    written = []
    scen: dict[str, dict[str, RunResult]] = {}
    for r in results:
        if r.times:
            scen.setdefault(r.scenario, {}).setdefault(r.policy, r)
    for sc, pols in scen.items():
        n = len(pols)
        cols = min(4, n)
        rows = (n + cols - 1) // cols
        fig, axes = plt.subplots(
            rows, cols, figsize=(3.2 * cols, 2.3 * rows), sharey=True, squeeze=False
        )
        for ax, (p, r) in zip(axes.flat, pols.items(), strict=False):
            t0 = r.times[0] if r.times else 0.0
            ts = [t - t0 for t in r.times]
            for j in range(len(r.engine_ids)):
                ys = [row[j] if j < len(row) else math.nan for row in r.loads]
                ax.plot(ts, ys, lw=0.5, alpha=0.6)
            li = r.metrics["load_imbalance"]
            ax.set_title(f"{p} (imb {li:.2f})", fontsize=8)
            ax.tick_params(labelsize=6)
        for ax in list(axes.flat)[n:]:
            ax.axis("off")
        fig.suptitle(f"{sc}: per-engine load (waiting + running) over time [s]", fontsize=9)
        fig.tight_layout()
        path = os.path.join(out_dir, f"load_{sc}.png")
        fig.savefig(path, dpi=72)
        plt.close(fig)
        written.append(path)
    gap_path = plot_gap_closed(doc, os.path.join(out_dir, "gap_closed.png"))
    if gap_path:
        written.append(gap_path)
    return written


def plot_gap_closed(doc: dict[str, Any], path: str) -> str | None:
    """Bar chart of gap closed per scenario and metric; hatched and faded where the gap
    between vllm-21617 and the oracle is within the seed spread (or one seed only)."""
    gc = doc.get("gap_closed", {})
    if not gc:
        return None
    plt = _pyplot()
    metrics = ("burst_max_over_mean", "load_imbalance", "p99_queue_delay_s", "makespan_s")
    colors = ("tab:blue", "tab:orange", "tab:green", "tab:red")
    noise = doc.get("gap_within_noise", {})
    fig, ax = plt.subplots(figsize=(8, 3.2))
    names = list(gc)
    w = 0.8 / len(metrics)
    for k, m in enumerate(metrics):
        for i, sc in enumerate(names):
            v = gc[sc].get(m)
            if v is None:
                continue
            shaky = noise.get(sc, {}).get(m) is not False
            ax.bar(
                i + k * w,
                max(-1.0, min(2.0, v)),
                w,
                color=colors[k],
                alpha=0.35 if shaky else 1.0,
                hatch="//" if shaky else None,
                label=m if i == 0 else None,
            )
    ax.axhline(1.0, color="k", lw=0.6, ls="--")
    ax.axhline(0.8, color="g", lw=0.6, ls=":")
    ax.set_xticks([i + w * (len(metrics) - 1) / 2 for i in range(len(names))])
    ax.set_xticklabels(names, fontsize=8)
    ax.set_ylabel("gap closed", fontsize=8)
    ax.set_ylim(-1.0, 2.0)
    ax.legend(fontsize=6, ncol=2)
    ax.set_title(
        "(vllm-21617 - redisbal) / (vllm-21617 - oracle), clipped to [-1, 2]; "
        "hatched: gap within seed noise",
        fontsize=8,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)
    return path


# -- CLI ----------------------------------------------------------------------------------


def _csv(value: str | None, allowed: Sequence[str], what: str) -> list[str]:
    if not value:
        return list(allowed)
    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in allowed]
    if bad:
        raise click.BadParameter(
            f"unknown {what}: {', '.join(bad)}; choose from {', '.join(allowed)}"
        )
    return items


def _seeds(value: str | None, quick: bool) -> list[int]:
    if not value:
        return [1] if quick else [1, 2, 3]
    if value.isdigit() and "," not in value:
        return list(range(1, int(value) + 1))
    try:
        return [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter("--seeds takes a count (3) or a list (1,2,5)") from None


@click.command("bench")
@common_options
@click.option(
    "--quick",
    is_flag=True,
    help="1 seed, shorter runs (2 bursts, 2 s of Poisson): under 3 minutes.",
)
@click.option("--seeds", default=None, help="Seed count (3) or list (1,2,3). Default 3 (quick: 1).")
@click.option("--scenarios", default=None, help=f"Comma list from {','.join(SCENARIO_NAMES)}.")
@click.option("--policies", default=None, help=f"Comma list from {','.join(BENCH_POLICIES)}.")
@click.option(
    "--router-processes",
    default="",
    help="Scenarios whose routers run in separate processes (e.g. skew).",
)
@click.option(
    "--scale/--no-scale",
    default=None,
    help="Also run the 1024 x 64 projection on a simulated clock (default: on unless --quick).",
)
@click.option(
    "--scale-only", is_flag=True, help="Run only the 1024 x 64 projection (simulated clock)."
)
@click.option(
    "--sim-clock",
    is_flag=True,
    help="Run the scenarios on the discrete-event simulator instead of real time on Redis "
    "(deterministic; no churn). For policy experiments, not for the record.",
)
@click.option("--json", "json_path", default=None, help="Write results as JSON here.")
@click.option("--markdown", "md_path", default=None, help="Write the tables as Markdown here.")
@click.option("--plot", "plot_dir", default=None, help="Write PNG plots into this directory.")
def bench_command(
    quick: bool,
    seeds: str | None,
    scenarios: str | None,
    policies: str | None,
    router_processes: str,
    scale: bool | None,
    scale_only: bool,
    sim_clock: bool,
    json_path: str | None,
    md_path: str | None,
    plot_dir: str | None,
) -> None:
    """Balance benchmark: every policy on the same seeds, on a real Redis, in real time.

    Without --redis-url it starts its own redis-server. Each run gets a fresh
    deployment named <prefix>-<scenario>-<policy>-<seed>-<hex>, where the prefix is
    --deployment ("bench" when left at "default").
    """
    ctx = click.get_current_context()
    level_given = any(
        c.get_parameter_source("log_level") not in (None, ParameterSource.DEFAULT)
        for c in (ctx, ctx.parent)
        if c is not None
    )
    opts = settings()
    if not level_given:  # dozens of coordinators start and stop: only warnings by default
        logging.getLogger().setLevel(logging.WARNING)
    redis_url = opts.redis_url
    prefix = "bench" if opts.deployment == "default" else opts.deployment
    if len(prefix) > 24:
        raise click.BadParameter(
            f"bench uses it as a prefix of its runs' deployment names: at most 24 characters, "
            f"got {len(prefix)}",
            param_hint="--deployment",
        )
    if plot_dir:
        _pyplot()  # fail early with the install hint
    cfg = BenchConfig(
        scenarios=_csv(scenarios, SCENARIO_NAMES, "scenario"),
        policies=_csv(policies, BENCH_POLICIES, "policy"),
        seeds=_seeds(seeds, quick),
        quick=quick,
        redis_url=redis_url,
        prefix=prefix,
        router_processes=_csv(router_processes, SCENARIO_NAMES, "scenario")
        if router_processes
        else [],
    )
    t0 = time.monotonic()
    load0 = os.getloadavg()[0]
    if scale_only:
        results: list[RunResult] = []
    elif sim_clock:
        results = run_all_simulated(cfg)
    else:
        results = asyncio.run(run_all(cfg))
    elapsed = time.monotonic() - t0
    doc = summarize(results, cfg.policies)
    scen = bench_scenarios(cfg)
    lags = [r.health["lag_p99_s"] for r in results]
    bad = [r for r in results if r.health["lag_p99_s"] > LAG_LIMIT_S]
    doc["meta"] = {
        "argv": sys.argv,
        "clock": "simulated (discrete-event), no Redis" if sim_clock else "real time on Redis",
        "quick": quick,
        "seeds": cfg.seeds,
        "elapsed_s": round(elapsed, 1),
        "nproc": os.cpu_count(),
        "loadavg_start": load0,
        "loadavg_end": os.getloadavg()[0],
        "lag_p99_s_median": percentile(lags, 50),
        "lag_p99_s_max": max(lags) if lags else 0.0,
        "runs_over_lag_limit": len(bad),
        "lag_limit_s": LAG_LIMIT_S,
        "scenarios": {s: asdict(sc) for s, sc in scen.items()},
        "output_len": {"mean": OUT_MEAN, "sigma": OUT_SIGMA, "cap": OUT_CAP},
        "engine": asdict(EngineParams()),
    }
    do_scale = scale_only or ((not quick) if scale is None else scale)
    if do_scale:
        from redisbal.bench_scale import run_scale

        click.echo("scale projection: 1024 engines x 64 routers on a SIMULATED clock", err=True)
        doc["scale"] = run_scale(cfg.policies, cfg.seeds[:1])
    click.echo(tables(doc, scen))
    if "scale" in doc:
        from redisbal.bench_scale import scale_table

        click.echo(scale_table(doc["scale"]))
    click.echo(
        f"\nharness: {len(results)} runs in {elapsed:.0f} s; event-loop lag p99 median "
        f"{doc['meta']['lag_p99_s_median'] * 1000:.1f} ms, "
        f"max {doc['meta']['lag_p99_s_max'] * 1000:.1f} ms; "
        f"load average {load0:.2f} -> {doc['meta']['loadavg_end']:.2f} on {os.cpu_count()} cores"
    )
    if bad:
        click.echo(
            f"WARNING: {len(bad)} of {len(results)} runs had event-loop lag p99 above "
            f"{LAG_LIMIT_S * 1000:.0f} ms (marked '!'): the machine was too loaded for those "
            "real-time runs to be fully trusted."
        )
    if json_path:
        with open(json_path, "w") as f:
            json.dump(_finite(doc), f, indent=1, allow_nan=False)
        click.echo(f"wrote {json_path}")
    if md_path:
        with open(md_path, "w") as f:
            f.write(markdown(doc))
        click.echo(f"wrote {md_path}")
    if plot_dir:
        for p in write_plots(results, doc, plot_dir):
            click.echo(f"wrote {p}")


def _finite(x: Any) -> Any:
    """JSON has no NaN / infinity: write them as null."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    return x


def main() -> None:
    bench_command(prog_name="redisbal bench")


if __name__ == "__main__":
    main()
