"""The whole benchmark: every scenario x seed x policy, in real time or on the
simulated clock, with a progress line."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import click

from redisbal.bench.balance import METRICS
from redisbal.bench.procs import ProcRun
from redisbal.bench.run import Run, RunResult
from redisbal.bench.scale import simulate
from redisbal.bench.scenarios import Scenario, default_scenarios
from redisbal.sim.embedded import RedisServer


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
    """The same runs on the discrete-event simulator (``scale.simulate``)."""
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
