"""Plot the Grafana dashboard's main panels from a live local run (docs/plots/).

Runs what the Kubernetes small overlay runs, as local processes: a redis-server,
two coordinators with metrics, four simulated HTTP engines (engine 0 steps 3x
slower, so the stall guard forces snapshots), two gateways, and `redisbal loadgen`
sending 40 streamed requests/s through both; scrapes the exporters every second and
plots the series the dashboard's queries compute (rates over 5 s, quantiles of
histogram bucket increases). Needs redis-server on PATH and the plot extra.

    python scripts/dashboard_figures.py --out docs/plots/dashboard.png
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import urllib.request
from collections import defaultdict
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from redisbal.sim.embedded import free_port

Scrape = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str) -> Scrape:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    out: Scrape = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def pick(sc: Scrape, name: str, **labels: str) -> dict[tuple[tuple[str, str], ...], float]:
    want = set(labels.items())
    return {lab: v for (n, lab), v in sc.items() if n == name and want <= set(lab)}


def total(sc: Scrape, name: str, **labels: str) -> float:
    return sum(pick(sc, name, **labels).values())


def quantile(q: float, buckets: dict[float, float]) -> float:
    """histogram_quantile over cumulative bucket counts (linear within a bucket)."""
    items = sorted(buckets.items())
    count = items[-1][1] if items else 0.0
    if count <= 0:
        return float("nan")
    rank, lo, prev = q * count, 0.0, 0.0
    for le, c in items:
        if c >= rank:
            if le == float("inf"):
                return lo
            return lo + (le - lo) * (rank - prev) / max(c - prev, 1e-12)
        lo, prev = le, c
    return lo


def run(seconds: float, workdir: Path) -> tuple[list[float], list[Scrape], list[Scrape]]:
    rport, m1, m2, g1, g2 = (free_port() for _ in range(5))
    env = dict(os.environ, REDISBAL_REDIS_URL=f"redis://127.0.0.1:{rport}/0")
    env.update(REDISBAL_DEPLOYMENT="llama", REDISBAL_LOG_LEVEL="warning")
    cmds = [
        ["redis-server", "--port", str(rport), "--save", "", "--appendonly", "no"],
        *(
            ["redisbal", "coordinator", "--id", f"coordinator-{i}", "--metrics-port", str(p)]
            for i, p in ((0, m1), (1, m2))
        ),
        [
            *("redisbal", "engine-sim", "--engines", "4", "--http-port", "0"),
            *("--running-cap", "16", "--slow", "engine-sim-0:3.0"),
            *("--no-summary", "--id-prefix", "engine-sim-"),
        ],
        *(["redisbal", "gateway", "--port", str(p), "--drain-s", "5"] for p in (g1, g2)),
    ]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for i, cmd in enumerate(cmds):
            log = open(workdir / f"proc{i}.log", "wb")  # noqa: SIM115 - closed with the process
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=log))
            time.sleep(1.0 if i == 0 else 0.2)
        for url in (m1, g1, g2):  # every exporter answers before the load starts
            deadline = time.monotonic() + 30
            while True:
                try:
                    scrape(f"http://127.0.0.1:{url}/metrics")
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.5)
        time.sleep(2)
        dead = [" ".join(cmds[i][:2]) for i, p in enumerate(procs) if p.poll() is not None]
        if dead:
            raise RuntimeError(f"exited early: {dead} (logs in {workdir})")
        load = ["redisbal", "loadgen", "--url", f"http://127.0.0.1:{g1}"]
        load += ["--url", f"http://127.0.0.1:{g2}", "--rate", "40", "--duration", str(seconds)]
        loadgen = subprocess.Popen(load, env=env, stdout=subprocess.DEVNULL)
        procs.append(loadgen)
        ts, coord, gws = [], [], []
        start = time.monotonic()
        # until the load's last request finished, and 5 s of quiet after it
        while time.monotonic() - start < seconds + 5 or loadgen.poll() is None:
            ts.append(time.monotonic() - start)
            coord.append(scrape(f"http://127.0.0.1:{m1}/metrics"))
            merged: Scrape = defaultdict(float)
            for p in (g1, g2):
                for k, v in scrape(f"http://127.0.0.1:{p}/metrics").items():
                    merged[k] += v
            gws.append(dict(merged))
            time.sleep(max(0.0, ts[-1] + 1.0 - (time.monotonic() - start)))
        return ts, coord, gws
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()


def rate(ts: list[float], vals: list[float], w: int = 5) -> tuple[list[float], list[float]]:
    return ts[w:], [(vals[i] - vals[i - w]) / (ts[i] - ts[i - w]) for i in range(w, len(ts))]


def plot(ts: list[float], coord: list[Scrape], gws: list[Scrape], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 4, figsize=(18, 7.5))
    ax: Any = axes.flat
    a = next(ax)
    a.plot(ts, [total(c, "redisbal_snapshot_age_seconds") for c in coord])
    a.set(title="Snapshot age", ylabel="s")
    a = next(ax)
    for name, label in (("published", "barrier"), ("forced", "forced")):
        x, y = rate(ts, [total(c, f"redisbal_snapshots_{name}_total") for c in coord])
        a.plot(x, y, label=label)
    a.set(title="Snapshots per second", ylabel="1/s")
    a.legend()
    a = next(ax)
    for name in ("engines_live", "snapshot_stalled", "snapshot_suspect", "snapshot_laggards"):
        a.plot(ts, [total(c, f"redisbal_{name}") for c in coord], label=name.split("_", 1)[1])
    a.set(title="Engines by state")
    a.legend()
    a = next(ax)
    engines = sorted({dict(k)["engine"] for k in pick(coord[-1], "redisbal_engine_waiting")})
    for e in engines:
        load = [total(c, "redisbal_engine_waiting", engine=e) for c in coord]
        load = [
            w + total(c, "redisbal_engine_running", engine=e)
            for w, c in zip(load, coord, strict=True)
        ]
        a.plot(ts, load, label=e)
    a.set(title="Waiting + running per engine")
    a.legend(fontsize=7)
    a = next(ax)
    statuses = sorted(
        {dict(k)["status"] for g in gws for k in pick(g, "redisbal_gateway_requests_total")}
    )
    for s in statuses:
        x, y = rate(ts, [total(g, "redisbal_gateway_requests_total", status=s) for g in gws])
        a.plot(x, y, label=s)
    a.set(title="Gateway requests by status", ylabel="req/s")
    a.legend()
    a = next(ax)
    reasons = sorted(
        {dict(k)["reason"] for g in gws for k in pick(g, "redisbal_gateway_errors_total")}
    )
    for r in reasons:
        x, y = rate(ts, [total(g, "redisbal_gateway_errors_total", reason=r) for g in gws])
        a.plot(x, y, label=r)
    x, y = rate(ts, [total(g, "redisbal_gateway_retries_total") for g in gws])
    a.plot(x, y, "--", label="retries")
    a.set(title="Errors by reason, retries", ylabel="req/s")
    a.legend()
    a = next(ax)
    name = "redisbal_gateway_added_latency_seconds_bucket"
    for q in (0.5, 0.99):
        ys = []
        for i in range(5, len(gws)):
            now, before = gws[i], gws[i - 5]
            b = {
                float(dict(k)["le"]): v - before.get((name, k), 0.0)
                for k, v in pick(now, name, stream="true").items()
            }
            ys.append(quantile(q, b) * 1000)
        a.plot(ts[5:], ys, label=f"p{int(q * 100)}")
    a.set(title="Gateway added latency (streamed)", ylabel="ms")
    a.legend()
    a = next(ax)
    for e in engines:
        x, y = rate(ts, [total(g, "redisbal_gateway_decisions_total", engine=e) for g in gws])
        a.plot(x, y, label=e)
    a.set(title="Route decisions per engine", ylabel="req/s")
    a.legend(fontsize=7)
    for a in axes.flat:
        a.set_xlabel("s")
        a.grid(alpha=0.3)
        a.set_ylim(bottom=0)
    fig.suptitle(
        "redisbal dashboard panels: 4 simulated engines (engine 0 3x slower), 2 gateways, 40 req/s"
    )
    fig.tight_layout()
    fig.savefig(out, dpi=80)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("docs/plots/dashboard.png"))
    ap.add_argument("--seconds", type=float, default=40.0)
    args = ap.parse_args()
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"redisbal-dashboard-{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    ts, coord, gws = run(args.seconds, work)
    plot(ts, coord, gws, args.out)
    print(f"wrote {args.out} ({len(ts)} scrapes; process logs in {work})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
