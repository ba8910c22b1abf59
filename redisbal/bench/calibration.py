"""The simulator held to real time: the quality simulator (``redisbal.bench.quality``)
run on what a real-time run of scripts/gateway_policies.py ran (its trace, engine
arguments, running cap, slow engines, gateway replicas and TTFT objective, and what its
engines fed the routers: ``--report-as`` in its engine arguments), and the
two rankings of the policies compared pair by pair.

The knobs the simulator has and real time sets for it (``Calibration``): the
barrier's tick, a snapshot's delivery delay and jitter, a request's transit, a fixed
time added to every engine step (the real engines' event-loop overshoot), and whether
the vLLM baselines get vLLM's own publish loop or, as the real-time gateways give
them, redisbal's snapshots.
"""

from __future__ import annotations

import itertools
import statistics
from dataclasses import dataclass, replace
from typing import Any

from redisbal.bench.quality import simulate
from redisbal.bench.traffic import QualityScenario
from redisbal.errors import CalibrationError as CalibrationError
from redisbal.sim.model import EngineParams
from redisbal.sim.report_as import LOAD_ONLY, REPORT_AS
from redisbal.sim.workload import Request, read_trace

# engine-sim's flags that set EngineParams: (field, scale from the flag's unit)
ENGINE_FLAGS: dict[str, tuple[str, float | None]] = {
    "--base-step-ms": ("base_step_s", 1e-3),
    "--per-seq-ms": ("per_seq_s", 1e-3),
    "--prefill-ms": ("prefill_s", 1e-3),
    "--prefill-token-us": ("prefill_per_token_s", 1e-6),
    "--kv-tokens": ("kv_capacity_tokens", None),
    "--cache-blocks": ("cache_blocks", None),
    "--prefill-budget-tokens": ("prefill_budget_tokens", None),
}


@dataclass(frozen=True)
class Calibration:
    """The simulator's transport and timing, set to what real time does."""

    tick_ms: float = 20.0  # the coordinator's tick (settings' tick_ms)
    delivery_ms: float = 1.0  # snapshot made -> at a router
    jitter_ms: float = 2.0  # plus up to this, per router and snapshot
    transit_ms: float = 1.0  # routed -> at the engine
    step_overhead_ms: float = 0.0  # added to every engine step (slowed with it)
    vllm_transport: bool = False  # vLLM baselines on vLLM's publish loop, not snapshots


def engine_from_args(args: list[str], running_cap: int) -> EngineParams:
    """EngineParams from engine-sim's flags (as gateway_policies' ``--engine-args``);
    engine-sim's defaults are EngineParams' own. (``--report-as`` is the reports' form,
    not the engine's: ``feed_from_args``; so was ``--no-admitted`` in older runs.)"""
    args = _without_report_as([a for a in args if a not in ("--admitted", "--no-admitted")])
    given: dict[str, Any] = {}
    i = 0
    while i < len(args):
        flag = args[i]
        if flag not in ENGINE_FLAGS or i + 1 >= len(args):
            raise CalibrationError(f"engine argument {flag!r} has no simulator counterpart")
        name, scale = ENGINE_FLAGS[flag]
        try:
            given[name] = float(args[i + 1]) * scale if scale else int(args[i + 1])
        except ValueError:
            raise CalibrationError(
                f"engine argument {flag} {args[i + 1]!r}: not a number"
            ) from None
        i += 2
    return EngineParams(running_cap=running_cap, **given)


def _without_report_as(args: list[str]) -> list[str]:
    """``args`` less ``--report-as FORM`` (or ``--report-as=FORM``)."""
    out: list[str] = []
    skip = False
    for a in args:
        if skip:
            skip = False
        elif a == "--report-as":
            skip = True
        elif not a.startswith("--report-as="):
            out.append(a)
    return out


def feed_from_args(run_args: dict[str, Any]) -> str:
    """What the run's engines fed the routers (``redisbal.sim.report_as``): the last
    ``--report-as FORM`` (engine-sim's own rule), ``full`` without one, and
    ``load-only`` for ``--no-admitted``, which runs recorded before ``--report-as``
    give: those engines sent no admitted counts, no total and no cap."""
    args = str(run_args.get("engine_args") or "").split()
    if "--no-admitted" in args:
        return LOAD_ONLY
    forms = [
        b if a == "--report-as" else a.split("=", 1)[1]
        for a, b in itertools.pairwise([*args, ""])
        if a == "--report-as" or a.startswith("--report-as=")
    ]
    if forms and forms[-1] not in REPORT_AS:
        raise CalibrationError(f"--report-as {forms[-1]!r}: not one of {', '.join(REPORT_AS)}")
    return forms[-1] if forms else "full"


def slow_engines(slow: list[str], engines: int) -> tuple[float, float]:
    """(share of engines that are slow, their factor) from demo-style ``ID:FACTOR``
    entries; every slow engine must share one factor (the simulator slows the last
    ones by one factor)."""
    factors = []
    for item in slow:
        for part in item.split(","):
            _, _, f = part.partition(":")
            factors.append(float(f) if f else 2.0)
    if not factors:
        return 0.0, 1.0
    if len(set(factors)) > 1:
        raise CalibrationError(f"slow engines with different factors {sorted(set(factors))}")
    return len(factors) / engines, factors[0]


def replay(path: str, gateways: int) -> list[Request]:
    """The trace as loadgen sends it: request k (in time order) to gateway k mod n."""
    reqs = read_trace(path, gateways)
    return [replace(r, client=k % gateways) for k, r in enumerate(reqs)]


def scenario_for(
    run_args: dict[str, Any], work: list[Request], cal: Calibration
) -> QualityScenario:
    """The simulated scenario of a real-time run's arguments (its JSON's ``args``)."""
    engines = int(run_args["engines"])
    params = engine_from_args(
        str(run_args.get("engine_args") or "").split(), int(run_args["running_cap"])
    )
    params = replace(params, base_step_s=params.base_step_s + cal.step_overhead_ms / 1000)
    share, factor = slow_engines(list(run_args.get("slow") or []), engines)
    return QualityScenario(
        "trace",
        "trace",
        clients=int(run_args["gateways"]),
        engines=engines,
        duration_s=max((r.t for r in work), default=0.0),
        warmup_s=0.0,
        drain_s=float(run_args.get("drain_timeout") or 90.0),
        slo_ttft_s=float(run_args["slo_ttft_ms"]) / 1000,
        slow_share=share,
        slow_factor=factor,
        tick_s=cal.tick_ms / 1000,
        warm=False,
        engine=params,
    )


def simulate_run(
    run_args: dict[str, Any],
    policy: str,
    seed: int,
    trace: str,
    cal: Calibration,
    feed: str | None = None,
) -> dict[str, float]:
    """One simulated run of what the real-time run of (policy, seed) ran; ``feed``:
    the engines' reports in another form than the run's (``redisbal.sim.report_as``)."""
    work = replay(trace, int(run_args["gateways"]))
    sc = scenario_for(run_args, work, cal)
    return simulate(
        policy,
        seed,
        sc,
        workload=work,
        keys_guessed=True,  # loadgen sends a trace's keys as the body's user
        report_as=feed or feed_from_args(run_args),
        delivery_ms=cal.delivery_ms,
        jitter_ms=cal.jitter_ms,
        transit_ms=cal.transit_ms,
        vllm_transport=cal.vllm_transport,
    )


def ranking(by_seed: dict[str, dict[int, float]]) -> list[str]:
    """Policies by mean over seeds, best (lowest) first."""
    return sorted(by_seed, key=lambda p: statistics.fmean(by_seed[p].values()))


def pair_verdicts(
    real: dict[str, dict[int, float]], sim: dict[str, dict[int, float]]
) -> list[tuple[str, str, bool, bool]]:
    """For each pair of policies (a, b), a better than b in real time by mean: whether
    every real-time seed orders them so (else the pair's real order is within seed
    noise), and whether the simulator orders them the same way by mean."""
    order = ranking(real)
    out = []
    for i, a in enumerate(order):
        for b in order[i + 1 :]:
            seeds = set(real[a]) & set(real[b])
            settled = all(real[a][s] < real[b][s] for s in seeds)
            same = statistics.fmean(sim[a].values()) <= statistics.fmean(sim[b].values())
            out.append((a, b, settled, same))
    return out
