"""PNG plots of a benchmark (``--plot``; needs matplotlib)."""

from __future__ import annotations

import math
import os
import statistics
from typing import Any

import click

from redisbal.bench.run import RunResult


def pyplot() -> Any:
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
    plt = pyplot()
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
    plt = pyplot()
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
    ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title(
        "(vllm-21617 - redisbal) / (vllm-21617 - oracle), clipped to [-1, 2]; "
        "hatched: gap within seed noise",
        fontsize=8,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)
    return path


def plot_policy_seeds(doc: dict[str, Any], path: str, metric: str = "ttft_p99_ms") -> str:
    """A real-time comparison (scripts/gateway_policies.py --json): each policy's
    ``metric`` per seed (a line each, so a seed's hard traffic shows in every policy)
    and its mean (a bar), best first."""
    plt = pyplot()
    by: dict[str, dict[int, float]] = {}
    for r in doc["runs"]:
        if r.get(metric) is not None:
            by.setdefault(r["policy"], {})[int(r["seed"])] = float(r[metric])
    if not by:
        raise click.ClickException(f"no run has {metric!r}: nothing to plot")
    order = sorted(by, key=lambda p: sum(by[p].values()) / len(by[p]))
    seeds = sorted({s for v in by.values() for s in v})
    fig, ax = plt.subplots(figsize=(2.4 + 1.5 * len(order), 3.4))
    xs = range(len(order))
    ax.bar(xs, [sum(by[p].values()) / len(by[p]) for p in order], color="0.85", label="mean")
    for s in seeds:
        ax.plot(xs, [by[p].get(s, math.nan) for p in order], marker="o", lw=0.8, label=f"seed {s}")
    ax.set_xticks(list(xs), order, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel(metric.replace("_", " "))
    ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_overhead(rows: list[dict[str, Any]], path: str, base: str | None = None) -> str:
    """The gateway-overhead benchmark (scripts/gateway_overhead.py --json): CPU per
    request of each target, whole and streamed, a dot per repetition and a bar at the
    median; with ``base`` (a peer router), a line at 1.5x its median."""
    plt = pyplot()
    cpu: dict[bool, dict[str, list[float]]] = {False: {}, True: {}}
    for r in rows:
        if r.get("cpu_ms_per_request"):
            cpu[bool(r["stream"])].setdefault(r["target"], []).append(r["cpu_ms_per_request"])
    if not any(cpu.values()):
        raise click.ClickException("no row has CPU per request: nothing to plot")
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4), squeeze=False)
    for ax, stream in zip(axes[0], (False, True), strict=True):
        by = cpu[stream]
        order = sorted(by, key=lambda t: statistics.median(by[t]))
        xs = range(len(order))
        ax.bar(xs, [statistics.median(by[t]) for t in order], color="0.85", label="median")
        for x, t in zip(xs, order, strict=True):
            ax.plot([x] * len(by[t]), by[t], "o", ms=3, color="C0", alpha=0.7)
        if base in by:
            target = 1.5 * statistics.median(by[base])
            ax.axhline(target, ls="--", lw=0.8, color="C3", label=f"1.5x {base}")
        ax.set_xticks(list(xs), order, rotation=25, ha="right", fontsize=7)
        ax.set_title("streamed" if stream else "whole", fontsize=9)
        ax.set_ylabel("CPU ms per request")
        ax.legend(fontsize=6, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
