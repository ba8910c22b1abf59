"""The benchmark's JSON document (means, spread, gap closed) and its text and
Markdown tables."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from redisbal.bench.balance import METRICS, gap_closed, gap_within_noise, spread
from redisbal.bench.run import LAG_LIMIT_S, RunResult
from redisbal.bench.scenarios import Scenario


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


def finite(x: Any) -> Any:
    """JSON has no NaN / infinity: write them as null."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [finite(v) for v in x]
    return x
