"""The quality benchmark's scenarios: LLM-like traffic (``redisbal.sim.workload``) on
engines with a prefix cache and a KV budget (``QUALITY_ENGINE``), at a load set
against the deployment's estimated throughput."""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

from redisbal.errors import InvalidArgument
from redisbal.routing.cache_view import BLOCK_TOKENS
from redisbal.sim.model import EngineParams
from redisbal.sim.workload import (
    OUTPUT_MEAN,
    PROMPT_MEAN,
    Request,
    SessionShape,
    bursts,
    poisson,
    sessions,
    sized,
)

# 64 slots, 12 ms base step, prefill 12 us per uncached token (module doc of
# redisbal.sim.model), 65,536 tokens of KV (64 requests of 1,024 tokens), the
# prefix cache in the same memory (4,096 blocks of 16), 8,192 prefill tokens a step
QUALITY_ENGINE = EngineParams(
    running_cap=64,
    prefill_per_token_s=12e-6,
    kv_capacity_tokens=65536,
    cache_blocks=4096,
    prefill_budget_tokens=8192,
)
SIZES = {"8x32": (8, 32), "64x32": (64, 32), "64x1024": (64, 1024)}
QUALITY_SCENARIOS = ("poisson", "burst", "straggler", "sessions")


@dataclass(frozen=True)
class QualityScenario:
    name: str
    traffic: str  # "poisson", "burst", "sessions" or "trace"
    clients: int = 8
    engines: int = 32
    mode: str = "independent"  # or "lockstep" (every step lasts the slowest engine's)
    load: float = 0.9  # fraction of the estimated throughput (poisson, sessions)
    duration_s: float = 20.0  # arrivals (poisson, sessions) or bursts' span
    warmup_s: float = 5.0  # requests routed before are served but not measured
    drain_s: float = 10.0  # after the last arrival, run at most this long
    slo_ttft_s: float = 1.0  # goodput counts requests with TTFT within it
    slow_share: float = 0.0  # share of engines that step slow_factor x slower
    slow_factor: float = 1.0
    burst_factor: float = 1.0  # burst size / (engines x running cap)
    burst_every_s: float = 6.0
    burst_window_s: float = 0.5
    tick_s: float = 0.02  # independent engines: the barrier's publication period (tick_ms)
    warm: bool = True  # engines start with a steady-state batch (``warm_batch``)
    # every engine's parameters (the slow ones' slowed)
    engine: EngineParams = field(default_factory=lambda: QUALITY_ENGINE)

    @property
    def size(self) -> str:
        return f"{self.clients}x{self.engines}"

    def describe(self) -> str:
        what = {
            "poisson": f"ShareGPT-like sizes, Poisson at {self.load:g}x estimated throughput",
            "burst": (
                f"bursts of {self.burst_factor:g}x running capacity within "
                f"{self.burst_window_s * 1000:.0f} ms every {self.burst_every_s:g} s"
            ),
            "sessions": (
                f"multi-turn sessions over shared system prompts at {self.load:g}x "
                "estimated throughput (the estimate is conservative for sessions)"
            ),
            "trace": "trace replay",
        }[self.traffic]
        extra = ""
        if self.slow_share:
            extra = f"; {self.slow_share:.0%} of engines {self.slow_factor:g}x slower"
        return (
            f"{self.clients} API servers x {self.engines} engines, {self.mode}; {what}"
            f"{extra}; TTFT SLO {self.slo_ttft_s:g} s"
        )


def default_quality_scenarios(clients: int, engines: int) -> dict[str, QualityScenario]:
    """The four scenarios at one size. At 1,024 engines the runs are shorter (the
    simulator's cost grows with engines x API servers x snapshots)."""
    big = engines > 256
    dur, warm, drain = (1.5, 0.5, 0.25) if big else (15.0, 3.0, 3.0)
    base = QualityScenario(
        "poisson",
        "poisson",
        clients,
        engines,
        load=0.95,
        duration_s=dur,
        warmup_s=warm,
        drain_s=drain,
    )
    return {
        "poisson": base,
        "burst": replace(
            base,
            name="burst",
            traffic="burst",
            mode="lockstep",
            duration_s=12.0 if not big else 3.0,
            burst_every_s=6.0 if not big else 1.5,
            warmup_s=0.0,
            warm=False,
            drain_s=90.0 if not big else 2.0,  # every burst finishes: 4,096 tokens ~ 80 s
            slo_ttft_s=2.0,
        ),
        "straggler": replace(base, name="straggler", load=0.9, slow_share=0.125, slow_factor=2.0),
        "sessions": replace(base, name="sessions", traffic="sessions", load=1.3),
    }


def throughput_per_engine(
    prompt_mean: float,
    output_mean: float,
    params: EngineParams = QUALITY_ENGINE,
    uncached_mean: float | None = None,
) -> float:
    """Requests per second one engine completes at a full batch of requests of mean
    size, computing ``uncached_mean`` prompt tokens each (default: all of them); the
    batch is what the KV capacity holds when that is fewer than the running cap (a
    request holds its prompt and half its output on average)."""
    cap: float = params.running_cap
    if params.kv_capacity_tokens > 0:
        cap = min(cap, params.kv_capacity_tokens / (prompt_mean + output_mean / 2))
    adm = cap / output_mean
    unc = prompt_mean if uncached_mean is None else uncached_mean
    step = params.step_time(round(cap), round(adm), round(adm * unc))
    return adm / step


def _mean_sizes(reqs: list[Request]) -> tuple[float, float]:
    n = max(1, len(reqs))
    return sum(r.prompt_tokens for r in reqs) / n, sum(r.output_tokens for r in reqs) / n


def build_workload(sc: QualityScenario, seed: int) -> list[Request]:
    """The scenario's requests for one seed (the same for every policy)."""
    cap = sc.engines * sc.engine.running_cap
    slow = round(sc.engines * sc.slow_share)
    # slow engines serve at 1 / slow_factor of the speed
    speed = (sc.engines - slow + slow / max(sc.slow_factor, 1e-9)) if slow else sc.engines
    if sc.traffic == "poisson":
        rate = sc.load * speed * throughput_per_engine(PROMPT_MEAN, OUTPUT_MEAN, sc.engine)
        return poisson(rate, sc.duration_s, sc.clients, seed)
    if sc.traffic == "burst":
        count = max(1, int(sc.duration_s / sc.burst_every_s))
        return bursts(
            round(sc.burst_factor * cap),
            count,
            sc.burst_every_s,
            sc.burst_window_s,
            sc.clients,
            seed,
        )
    if sc.traffic == "sessions":
        shape = SessionShape()
        # load against the capacity with every possible hit (each turn computes only
        # what its session's previous turn did not leave in the cache): a policy that
        # loses the hits does more work than the deployment has room for
        probe = sessions(50.0, 20.0, 1, 12345, shape)
        p, o = _mean_sizes(probe)
        unc = sum(
            r.prompt_tokens - BLOCK_TOKENS * len(probe[r.after].done_blocks if r.after >= 0 else ())
            for r in probe
        ) / max(1, len(probe))
        turns = len(probe) / max(1, len({r.key for r in probe}))
        rate = sc.load * speed * throughput_per_engine(p, o, sc.engine, unc) / turns
        return sessions(rate, sc.duration_s, sc.clients, seed, shape)
    raise InvalidArgument(f"no generator for traffic {sc.traffic!r}")


def engine_params(sc: QualityScenario, k: int) -> EngineParams:
    """Engine k's parameters: the last slow_share of the engines are the slow ones."""
    slow = round(sc.engines * sc.slow_share)
    if k >= sc.engines - slow:
        return replace(sc.engine, slow=sc.slow_factor)
    return sc.engine


def client_rng(seed: int, i: int) -> random.Random:
    return random.Random(f"quality-router-{seed}-{i}")


def warm_batch(sc: QualityScenario, seed: int, k: int) -> list[tuple[int, int, int]]:
    """Engine k's requests at time 0, as (prompt, output, produced): a steady-state
    batch, so that a short run measures a loaded deployment instead of its fill-up.
    ``load`` x the batch the KV capacity allows (at most the running cap) requests,
    drawn length-biased (a request running at a random moment is more likely a long
    one) and each part way through its output. Not routed: the routers learn of them
    from the first snapshot, as of any load they did not route."""
    rng = random.Random(f"warm-{sc.name}-{seed}-{k}")
    p = sc.engine
    slots = min(p.running_cap, p.kv_capacity_tokens / (PROMPT_MEAN + OUTPUT_MEAN / 2))
    n = min(p.running_cap, round(min(sc.load, 1.0) * slots))
    pool = [sized(rng) for _ in range(8 * n)]
    out = []
    for prompt, output in rng.choices(pool, weights=[o for _, o in pool], k=n):
        out.append((prompt, output, rng.randrange(output)))
    return out
