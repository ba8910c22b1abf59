"""The quality benchmark's suite (size x scenario x seed x policy on the simulated
clock), its summary over seeds and its tables."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from redisbal.bench.balance import spread
from redisbal.bench.latency import HIGHER_IS_BETTER, QUALITY_METRICS
from redisbal.bench.quality import simulate
from redisbal.bench.suite import Progress
from redisbal.bench.traffic import QUALITY_ENGINE, SIZES, QualityScenario, default_quality_scenarios
from redisbal.sim.model import EngineParams
from redisbal.sim.workload import Request

# at 1,024 engines a run costs tens of seconds (every router applies every snapshot
# of 1,024 engines): one seed and one scenario unless asked for more
BIG_SEEDS = 1
BIG_SCENARIOS = ("poisson",)


@dataclass
class QualityConfig:
    policies: list[str]
    seeds: list[int]
    sizes: list[str] = field(default_factory=lambda: list(SIZES))
    scenarios: list[str] | None = None  # None: the default ones (fewer at 1,024 engines)
    trace: list[Request] | None = None
    trace_name: str = ""
    pass_output: bool = False
    report_as: str = "full"  # what the engines feed the routers (redisbal.sim.report_as)
    # a trace's engines (the scenarios bring their own)
    engine: EngineParams = field(default_factory=lambda: QUALITY_ENGINE)


def plan(cfg: QualityConfig) -> list[tuple[QualityScenario, list[int]]]:
    """(scenario, seeds) to run, in order."""
    out = []
    for size in cfg.sizes:
        clients, engines = SIZES[size]
        big = engines > 256
        seeds = cfg.seeds[:BIG_SEEDS] if big and cfg.scenarios is None else cfg.seeds
        if cfg.trace is not None:
            last = max((r.t for r in cfg.trace), default=0.0)
            sc = QualityScenario(
                "trace",
                "trace",
                clients,
                engines,
                duration_s=last,
                warmup_s=0.0,
                warm=False,
                engine=cfg.engine,
            )
            out.append((sc, seeds))
            continue
        scs = default_quality_scenarios(clients, engines)
        names = cfg.scenarios or (list(BIG_SCENARIOS) if big else list(scs))
        out.extend((scs[n], seeds) for n in names)
    return out


def run_quality(cfg: QualityConfig) -> dict[str, Any]:
    """Every run of the suite; returns the document (runs, summary, meta)."""
    todo = plan(cfg)
    total = sum(len(seeds) for _, seeds in todo) * len(cfg.policies)
    prog = Progress(total)
    runs: list[dict[str, Any]] = []
    t0 = time.monotonic()
    try:
        for sc, seeds in todo:
            for seed in seeds:
                for p in cfg.policies:
                    prog.show(f"{sc.size:<7} {sc.name:<9} {p:<14} seed {seed}")
                    m = simulate(
                        p,
                        seed,
                        sc,
                        workload=cfg.trace,
                        pass_output=cfg.pass_output,
                        report_as=cfg.report_as,
                    )
                    runs.append(
                        {"size": sc.size, "scenario": sc.name, "policy": p, "seed": seed} | m
                    )
    finally:
        prog.close()
    doc: dict[str, Any] = {
        "clock": "simulated (discrete-event); not real time, no Redis",
        "scenarios": {f"{sc.size} {sc.name}": sc.describe() for sc, _ in todo},
        "runs": runs,
        "summary": summarize(runs),
        "elapsed_s": round(time.monotonic() - t0, 1),
    }
    return doc


def summarize(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """size -> scenario -> policy -> metric -> {mean, lo, hi, sd, n}, plus
    ``ttft_p99_gap_s``, p99 TTFT minus the oracle's on the same seed, when it ran."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["size"], r["scenario"], r["policy"]), []).append(r)
    out: dict[str, Any] = {}
    for (size, scen, pol), rs in groups.items():
        cell = {}
        for m in (*QUALITY_METRICS, "sim_wall_s"):
            vals = [r[m] for r in rs if m in r and not math.isnan(r[m])]
            if vals:
                s = spread(vals)
                cell[m] = {"mean": s.mean, "lo": s.lo, "hi": s.hi, "sd": s.std, "n": s.n}
        out.setdefault(size, {}).setdefault(scen, {})[pol] = cell
    oracle_p99 = {
        (r["size"], r["scenario"], r["seed"]): r["ttft_p99_s"]
        for r in runs
        if r["policy"] == "oracle"
    }
    for (size, scen, pol), rs in groups.items():
        gaps = [
            r["ttft_p99_s"] - oracle_p99[(size, scen, r["seed"])]
            for r in rs
            if (size, scen, r["seed"]) in oracle_p99
        ]
        if gaps:  # paired by seed: the same arrivals for both
            g = spread(gaps)
            out[size][scen][pol]["ttft_p99_gap_s"] = {
                "mean": g.mean,
                "lo": g.lo,
                "hi": g.hi,
                "sd": g.std,
                "n": g.n,
            }
    return out


COLUMNS = (
    ("ttft_p50_s", "TTFT p50 s"),
    ("ttft_p99_s", "TTFT p99 s"),
    ("ttft_p99_gap_s", "p99-oracle"),
    ("e2e_p99_s", "e2e p99 s"),
    ("goodput_rps", "goodput/s"),
    ("prefix_hit_rate", "hit rate"),
    ("lockstep_efficiency", "lockstep eff"),
    ("makespan_s", "makespan s"),
    ("load_imbalance", "imbalance"),
    ("burst_max_over_mean", "burst max/mean"),
)


def _cell(v: Any, signed: bool = False) -> str:
    if v is None:
        return "-"
    mean, sd, n = v["mean"], v["sd"], v["n"]
    digits = 1 if abs(mean) >= 100 else 3
    sign = "+" if signed else ""
    return f"{mean:{sign}.{digits}f}" + (f" ±{sd:.{digits}f}" if n > 1 else "")


def _rows(doc: dict[str, Any]) -> list[tuple[str, str, list[str], list[list[str]]]]:
    """(title, note, header, rows) per size x scenario."""
    out = []
    for size, scens in doc["summary"].items():
        for scen, pols in scens.items():
            cols = [(m, h) for m, h in COLUMNS if any(m in c for c in pols.values())]
            if all(c.get("prefix_hit_rate", {}).get("hi", 0) == 0 for c in pols.values()):
                cols = [(m, h) for m, h in cols if m != "prefix_hit_rate"]  # no prefixes
            rows = []
            for pol, cell in pols.items():
                rows.append([pol, *(_cell(cell.get(m), m.endswith("gap_s")) for m, _ in cols)])
            n = max((c["ttft_p99_s"]["n"] for c in pols.values() if "ttft_p99_s" in c), default=0)
            wall = sum(c["sim_wall_s"]["mean"] * c["sim_wall_s"]["n"] for c in pols.values())
            note = (
                f"{doc['scenarios'].get(f'{size} {scen}', '')}; {n} seed(s), mean ±sd; "
                f"simulator cost {wall:.0f} s"
            )
            out.append((f"{size} {scen}", note, ["policy", *(h for _, h in cols)], rows))
    return out


def quality_tables(doc: dict[str, Any]) -> str:
    lines = [f"Routing quality ({doc['clock']})"]
    for title, note, header, rows in _rows(doc):
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        lines.append(f"\n== {title}: {note}")
        lines.append(
            "  ".join(
                h.rjust(w) if i else h.ljust(w)
                for i, (h, w) in enumerate(zip(header, widths, strict=True))
            )
        )
        for r in rows:
            lines.append(
                "  ".join(
                    c.rjust(w) if i else c.ljust(w)
                    for i, (c, w) in enumerate(zip(r, widths, strict=True))
                )
            )
    better = ", ".join(sorted(HIGHER_IS_BETTER))
    lines.append(
        f"\nhigher is better: {better}; lower for the rest. "
        "p99-oracle: TTFT p99 minus the oracle's on the same seed."
    )
    return "\n".join(lines)


def quality_markdown(doc: dict[str, Any]) -> str:
    parts = [f"# Routing quality ({doc['clock']})\n"]
    for title, note, header, rows in _rows(doc):
        parts.append(f"\n## {title}\n\n{note}\n")
        parts.append("| " + " | ".join(header) + " |")
        parts.append("|" + "---|" * len(header))
        parts.extend("| " + " | ".join(r) + " |" for r in rows)
    parts.append("\nMetrics:\n")
    parts.extend(f"- `{m}`: {d}" for m, d in QUALITY_METRICS.items())
    return "\n".join(parts) + "\n"
