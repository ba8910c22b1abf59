"""The benchmark's scenarios and their seeded arrival schedules: the same seed gives
the same arrivals, output lengths, API-server assignment and bursts for every policy."""

from __future__ import annotations

import random
from dataclasses import dataclass

from redisbal.sim.model import EngineParams, output_length

BENCH_POLICIES = (
    "random",
    "round-robin",
    "vllm-pre",
    "vllm-21617",
    "vllm-latest",
    "redisbal",
    "oracle",
)
SCENARIO_NAMES = ("burst", "skew", "straggler", "churn", "steady")
# output lengths of the benchmark's requests: lognormal, mean 40 tokens, capped
OUT_MEAN, OUT_SIGMA, OUT_CAP = 40.0, 1.0, 160


@dataclass(frozen=True)
class Scenario:
    """One benchmark scenario, and how the benchmark drives it."""

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
    """The five scenarios (burst, skew, straggler, churn, steady). Full: 4 bursts
    (each followed by its 3 s period: the last one drains for at most 3 s), 6 s of
    Poisson. ``quick``: 2 bursts and 1.5 s after the last, 2 s of Poisson and 0.5 s
    after; runs end there and what is unfinished is censored at the end (makespan in
    quick runs is a lower bound)."""
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
