"""Scale projection of the balance benchmark: 1024 engines x 64 API servers on a
SIMULATED clock (discrete-event), not in real time and not on Redis.

What is real: the routing code (``RouterCore`` with the same policy objects as
the real-time benchmark, the oracle included), the engine model
(``redisbal.sim.model``), the vLLM coordinator's publish loop
(``VllmCoordinatorModel``), the scenario's traffic (``make_schedule``).
What is modelled: time, and the transport. Engines step in lockstep; after
each step the barrier snapshot (exact counts with ``admitted``) reaches each
router after ``delivery_ms`` plus a per-router jitter; for the vLLM baselines
each engine's changed counts reach the coordinator model after a jitter and
its pushes reach the routers after the same delivery delay. Requests reach
their engine ``transit_ms`` after routing.
"""

from __future__ import annotations

import heapq
import math
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from redisbal.barrier.snapshot import EngineCounts, Snapshot
from redisbal.bench.balance import (
    burst_max_over_mean,
    gap_closed,
    load_imbalance,
    makespan,
    percentile,
)
from redisbal.bench.oracle import OraclePolicy, World
from redisbal.bench.scenarios import Scenario, make_schedule
from redisbal.bench.vllm import (
    VLLM_POLICIES,
    EngineStat,
    VllmCoordinatorModel,
    reports_before_step,
    vllm_model_for,
)
from redisbal.routing.router_core import RouterCore
from redisbal.sim.model import EngineParams, SimEngine, SimRequest

SCALE_SCENARIO = Scenario(
    "scale-burst", engines=1024, clients=64, mode="lockstep", bursts=2, drain_s=1.5
)


def _snapshot(version: int, engines: dict[str, EngineCounts], t_ms: float) -> Snapshot:
    return Snapshot(
        deployment="scale",
        epoch="sim",
        version=version,
        wave=0,
        step=version,
        forced=False,
        laggards={},
        gone={},
        joining=(),
        time_ms=int(t_ms),
        engines=engines,
    )


def simulate(
    policy: str,
    seed: int,
    sc: Scenario = SCALE_SCENARIO,
    *,
    delivery_ms: float = 1.0,
    jitter_ms: float = 2.0,
    transit_ms: float = 1.0,
    params: EngineParams | None = None,
) -> dict[str, float]:
    """One discrete-event run; returns the metrics (and the simulator's own cost)."""
    wall = time.perf_counter()
    params = params or EngineParams()
    rng = random.Random(f"scale-{seed}")
    ids = [f"e{i:04d}" for i in range(sc.engines)]
    world = World()
    routers: list[RouterCore] = []
    now = 0.0
    done = [0]

    def finish(req: SimRequest) -> None:
        routers[req.client_index].finished(req.decision)  # type: ignore[arg-type]
        done[0] += 1

    slow_from = sc.engines - sc.slow_engines
    for k, eid in enumerate(ids):
        p = replace(params, slow=sc.slow_factor) if k >= slow_from else params
        world.engines[eid] = SimEngine(eid, p, num_clients=sc.clients, on_finish=finish)
        world.transit[eid] = 0
    independent = sc.mode != "lockstep"
    estepping: dict[str, bool] = dict.fromkeys(ids, False)
    latest: dict[str, EngineCounts] = {}
    tick_s = 0.02
    for i in range(sc.clients):
        pol: Any = OraclePolicy(world) if policy == "oracle" else policy
        core = RouterCore(
            i, sc.clients, pol, rng=random.Random(f"router-{seed}-{i}"), clock=lambda: now
        )
        core.connected = True
        core.set_engines(ids)
        routers.append(core)
    vmodel: VllmCoordinatorModel | None = (
        vllm_model_for(policy, sc.mode) if policy in VLLM_POLICIES else None
    )
    before_step = reports_before_step(policy)
    pushes = [0]  # versions of the vLLM coordinator's pushes (each replaces the view)
    if vmodel is not None:  # vLLM's coordinator knows its engines from the start
        for eid in ids:
            vmodel.counts[eid] = EngineStat(0, 0, 0, 0.0)
    schedule = make_schedule(sc, seed, params)
    events: list[tuple[float, int, str, Any]] = []
    seq = 0

    def push(t: float, kind: str, data: Any) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, data))

    for k, a in enumerate(schedule):
        push(a.t, "arrive", k)
    if independent:
        push(0.0, "tick", None)
    else:
        push(0.0, "step", None)
    push(0.0, "sample", None)
    end_by = (schedule[-1].t if schedule else 0.0) + sc.drain_s
    reqs: list[SimRequest] = []
    version = 0
    step_running: list[list[float]] = []
    times: list[float] = []
    loads: list[list[float]] = []
    last_counts: dict[str, tuple[int, int]] = {}
    stepping = False

    def stats_on_change(t: float, e: SimEngine, score: int) -> None:
        """A vLLM engine's stats message, sent only when its counts changed; it reaches
        the coordinator model after a jitter."""
        wr = (len(e.waiting), len(e.running))
        if last_counts.get(e.engine_id) != wr:
            last_counts[e.engine_id] = wr
            push(t + rng.random() * jitter_ms / 1000, "stats", (e.engine_id, score, wr))

    def tick_report(e: SimEngine, t: float) -> None:
        """An independent engine's report: its latest counts for the tick barrier, and
        for the vLLM baselines a stats message."""
        tick = int(t / tick_s)
        latest[e.engine_id] = EngineCounts(
            len(e.waiting), len(e.running), None, 0, tick, int(t * 1000), tuple(e.admitted)
        )
        if vmodel is not None:
            stats_on_change(t, e, tick)

    while events:
        t, _, kind, data = heapq.heappop(events)
        if t > end_by:
            break
        now = t
        if kind == "arrive":
            a = schedule[data]
            core = routers[a.client]
            d = core.route()
            req = SimRequest(
                len(reqs),
                a.client,
                a.output_len,
                t,
                decision=d,
                engine_id=d.engine_id,
                group=a.group,
            )
            reqs.append(req)
            world.transit[d.engine_id] += 1
            push(t + transit_ms / 1000, "deliver", req)
        elif kind == "deliver":
            world.transit[data.engine_id] -= 1
            world.engines[data.engine_id].arrive(data, t)
            if independent:
                if not estepping[data.engine_id]:
                    estepping[data.engine_id] = True
                    push(t, "estep", (data.engine_id, None))
            elif not stepping:
                stepping = True
                push(t, "step", None)
        elif kind == "estep":  # one independent engine's step boundary
            eid, began = data
            e = world.engines[eid]
            if began is not None:
                e.end_step(t)
                tick_report(e, t)
            if not e.busy():
                estepping[eid] = False
                continue
            if before_step:  # counts again before the step (vLLM >= PR 41626, redisbal)
                e.take_inbox()
                tick_report(e, t)
            push(t + e.begin_step(t), "estep", (eid, t))
        elif kind == "tick":  # the tick barrier: every engine's latest report
            push(t + tick_s, "tick", None)
            if vmodel is None:
                version += 1
                idle = EngineCounts(0, 0, None, 0, 0, 0, (0,) * sc.clients)
                engines_now = {eid: latest.get(eid, idle) for eid in ids}
                snap = _snapshot(version, engines_now, t * 1000)
                for i in range(sc.clients):
                    push(t + (delivery_ms + rng.random() * jitter_ms) / 1000, "snap", (i, snap))
        elif kind == "step":
            engines = [world.engines[e] for e in ids]
            if data is not None:  # end of a step that began at data
                for e in engines:
                    e.end_step(t)
                if vmodel is None:
                    # with before-step reports the next step's snapshot (same instant,
                    # fresher counts) supersedes this one when the wave goes on
                    if not (before_step and any(e.busy() for e in engines)):
                        version += 1
                        _barrier_push(
                            version, engines, t, push, rng, sc.clients, delivery_ms, jitter_ms
                        )
                else:
                    version += 1
                    for e in engines:
                        stats_on_change(t, e, version)
            if not any(e.busy() for e in engines):
                stepping = False
                continue
            if before_step:  # counts again before the step (vLLM >= PR 41626, redisbal)
                for e in engines:
                    e.take_inbox()
                if vmodel is None:
                    version += 1
                    _barrier_push(
                        version, engines, t, push, rng, sc.clients, delivery_ms, jitter_ms
                    )
                else:
                    for e in engines:
                        stats_on_change(t, e, version + 1)
            dur = max(e.begin_step(t) for e in engines)
            step_running.append([float(len(e.running)) for e in engines])
            push(t + dur, "step", t)
        elif kind == "stats":
            eid, ver, (w, r) = data
            assert vmodel is not None
            for at, counts in vmodel.on_stats(t * 1000, eid, ver, w, r):
                _vllm_push(at, counts, push, rng, sc.clients, delivery_ms, jitter_ms, pushes)
        elif kind == "snap":
            i, snap = data
            routers[i].apply_snapshot(snap)
        elif kind == "sample":
            times.append(t)
            loads.append([float(world.engines[e].load) for e in ids])
            if independent:
                step_running.append([float(len(world.engines[e].running)) for e in ids])
            push(t + 0.01, "sample", None)
            if vmodel is not None:
                for at, counts in vmodel.advance(t * 1000):
                    _vllm_push(at, counts, push, rng, sc.clients, delivery_ms, jitter_ms, pushes)
    per_burst: list[list[int]] = []
    groups: dict[int, dict[str, int]] = {}
    for r in reqs:
        groups.setdefault(r.group, dict.fromkeys(ids, 0))[r.engine_id] += 1
    for g in sorted(groups):
        per_burst.append(list(groups[g].values()))
    delays = [(r.started_at if r.started_at >= 0 else now) - r.routed_at for r in reqs]
    eff = [sum(row) / len(row) / max(row) for row in step_running if max(row) > 0]
    spans: dict[int, tuple[float, float]] = {}
    for r in reqs:
        lo, hi = spans.get(r.group, (math.inf, -math.inf))
        spans[r.group] = (
            min(lo, r.routed_at),
            max(hi, r.finished_at if r.finished_at >= 0 else now),
        )
    return {
        "makespan_s": makespan(list(spans.values())),
        "burst_max_over_mean": burst_max_over_mean(per_burst),
        "load_imbalance": load_imbalance(times, loads),
        "lockstep_efficiency": sum(eff) / len(eff) if eff else 1.0,
        "p99_queue_delay_s": percentile(delays, 99),
        "sim_wall_s": time.perf_counter() - wall,
        "requests": float(len(reqs)),
    }


def _barrier_push(
    version: int,
    engines: list[SimEngine],
    t: float,
    push: Any,
    rng: random.Random,
    clients: int,
    delivery_ms: float,
    jitter_ms: float,
) -> None:
    """The lockstep barrier's snapshot of every engine's counts at ``t``, to every router."""
    counts = {
        e.engine_id: EngineCounts(
            len(e.waiting), len(e.running), None, 0, version, int(t * 1000), tuple(e.admitted)
        )
        for e in engines
    }
    snap = _snapshot(version, counts, t * 1000)
    for i in range(clients):
        push(t + (delivery_ms + rng.random() * jitter_ms) / 1000, "snap", (i, snap))


def _vllm_push(
    at_ms: float,
    counts: dict[str, Any],
    push: Any,
    rng: random.Random,
    clients: int,
    delivery_ms: float,
    jitter_ms: float,
    pushes: list[int],
) -> None:
    """One push of the vLLM coordinator to every router. Pushes carry increasing
    versions so that every router adopts each of them (vLLM's API servers replace
    their view with every push: ``self.lb_engines = sliced_counts``)."""
    engines = {
        e: EngineCounts(c.waiting, c.running, None, 0, c.score, int(c.t_ms), None)
        for e, c in counts.items()
    }
    pushes[0] += 1
    snap = _snapshot(pushes[0], engines, at_ms)
    for i in range(clients):
        push(at_ms / 1000 + (delivery_ms + rng.random() * jitter_ms) / 1000, "snap", (i, snap))


def run_scale(policies: Sequence[str], seeds: Sequence[int]) -> dict[str, Any]:
    """The projection for each policy (first seed only by default): metrics + meta."""
    out: dict[str, Any] = {
        "clock": "simulated (discrete-event); not real time, no Redis",
        "scenario": SCALE_SCENARIO.describe(),
        "policies": {},
    }
    versions: dict[str, int] = {}
    for k, p in enumerate(policies):
        t = time.monotonic()
        vals = [simulate(p, s) for s in seeds]
        print(
            f"scale projection {k + 1}/{len(policies)}: {p} ({time.monotonic() - t:.0f} s)",
            file=sys.stderr,
            flush=True,
        )
        out["policies"][p] = {k: sum(v[k] for v in vals) / len(vals) for k in vals[0]}
        versions[p] = len(vals)
    pol = out["policies"]
    if all(k in pol for k in ("vllm-21617", "redisbal", "oracle")):
        out["gap_closed"] = {
            m: gap_closed(pol["vllm-21617"][m], pol["redisbal"][m], pol["oracle"][m])
            for m in ("burst_max_over_mean", "load_imbalance", "p99_queue_delay_s")
        }
    return out


def scale_table(doc: dict[str, Any]) -> str:
    lines = [f"\n== scale projection ({doc['clock']}): {doc['scenario']}"]
    ms = ("burst_max_over_mean", "load_imbalance", "lockstep_efficiency", "p99_queue_delay_s")
    lines.append(f"{'policy':<12}" + "".join(f"{m:>22}" for m in ms) + f"{'sim wall s':>12}")
    for p, v in doc["policies"].items():
        lines.append(
            f"{p:<12}" + "".join(f"{v[m]:>22.3f}" for m in ms) + f"{v['sim_wall_s']:>12.1f}"
        )
    if "gap_closed" in doc:
        lines.append(
            "gap closed: "
            + ", ".join(
                f"{m}={'-' if v is None or math.isnan(v) else f'{v:.3f}'}"
                for m, v in doc["gap_closed"].items()
            )
        )
    return "\n".join(lines)
