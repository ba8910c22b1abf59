#!/usr/bin/env python3
"""The simulator against real time: for each real-time run of
scripts/gateway_policies.py (its ``--json``), the quality simulator on the same trace,
engines, running cap, slow engines, replicas and seeds (redisbal.bench.calibration),
and the two rankings of the policies by mean TTFT p99, compared pair by pair.

    python scripts/sim_vs_real.py straggler=rt-straggler.json sessions=rt-sessions.json \\
        --trace-dir . --json cmp.json

``--reference oracle,redisbal+cost`` simulates more policies on the same seeds, to
set beside the rest without a real-time run: the oracle (join-the-shortest-queue on
exact global state) shows how much better any router could do there.

Each run is simulated with what its engines fed the routers (``--report-as`` in its
engine arguments; ``--no-admitted`` in older runs is ``load-only``:
redisbal.bench.calibration.feed_from_args); ``--report-as FORM`` simulates every run
with FORM instead, to see what another feed would change.

A pair of policies is "settled" when every real-time seed orders it the same way;
the simulator must order every settled pair as real time does. The calibration
knobs (``--tick-ms``, ``--delivery-ms``, ``--jitter-ms``, ``--transit-ms``,
``--step-overhead-ms``, ``--vllm-transport``) are the simulator's; their defaults
are the calibration docs/BENCHMARKS.md records.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from dataclasses import asdict
from typing import Any

import orjson

from redisbal.bench.calibration import (
    Calibration,
    CalibrationError,
    feed_from_args,
    pair_verdicts,
    ranking,
    simulate_run,
)
from redisbal.sim.report_as import FEEDS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="NAME=FILE: a gateway_policies.py --json")
    ap.add_argument("--trace-dir", default=None, help="where the traces are [the JSON's dir]")
    ap.add_argument("--policies", default=None, help="only these (default: every one run)")
    d = Calibration()
    ap.add_argument("--tick-ms", type=float, default=d.tick_ms)
    ap.add_argument("--delivery-ms", type=float, default=d.delivery_ms)
    ap.add_argument("--jitter-ms", type=float, default=d.jitter_ms)
    ap.add_argument("--transit-ms", type=float, default=d.transit_ms)
    ap.add_argument(
        "--step-overhead-ms",
        default=str(d.step_overhead_ms),
        help="ms added to every step, or 'measured': the real runs' mean overshoot per step",
    )
    ap.add_argument("--vllm-transport", action="store_true", help="vLLM's own publish loop")
    ap.add_argument(
        "--reference", default="", help="also simulate these policies (e.g. oracle), no real run"
    )
    ap.add_argument(
        "--report-as",
        choices=FEEDS,
        default=None,
        help="simulate every run with this feed, not the one its engines had",
    )
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    docs: dict[str, tuple[str, dict[str, Any]]] = {}
    for spec in a.runs:
        name, _, path = spec.partition("=")
        if not path:
            ap.error(f"{spec!r}: give NAME=FILE")
        try:
            with open(path, "rb") as fh:
                docs[name] = (path, orjson.loads(fh.read()))
        except (OSError, orjson.JSONDecodeError) as exc:
            sys.exit(f"sim_vs_real: cannot read {path}: {exc}")
    overhead = step_overhead(a.step_overhead_ms, [d for _, d in docs.values()])
    if overhead is None:
        ap.error("--step-overhead-ms: a number, or 'measured' with runs that recorded it")
    cal = Calibration(
        a.tick_ms, a.delivery_ms, a.jitter_ms, a.transit_ms, overhead, a.vllm_transport
    )
    print(f"calibration: {cal}")
    results: dict[str, Any] = {"calibration": asdict(cal)}
    settled = agreed = 0
    for name, (path, doc) in docs.items():
        run_args = doc["args"]
        if not run_args.get("trace"):
            sys.exit(f"sim_vs_real: {path} replayed no trace: nothing to simulate alike")
        try:
            feed = a.report_as or feed_from_args(run_args)
        except CalibrationError as exc:
            sys.exit(f"sim_vs_real: {path}: {exc}")
        tdir = a.trace_dir or os.path.dirname(os.path.abspath(path))
        want = a.policies.split(",") if a.policies else None
        real: dict[str, dict[int, float]] = {}
        for r in doc["runs"]:
            if want is None or r["policy"] in want:
                real.setdefault(r["policy"], {})[r["seed"]] = r["ttft_p99_ms"]
        sim: dict[str, dict[int, float]] = {}
        seeds_run = sorted({s for v in real.values() for s in v})
        refs = {p: seeds_run for p in a.reference.split(",") if p and p not in real}
        for policy, seeds in [*real.items(), *refs.items()]:
            for seed in seeds:
                trace = os.path.join(tdir, run_args["trace"].replace("{seed}", str(seed)))
                try:
                    m = simulate_run(run_args, policy, seed, trace, cal, feed)
                except (CalibrationError, OSError, ValueError) as exc:
                    sys.exit(f"sim_vs_real: {name} {policy} seed {seed}: {exc}")
                sim.setdefault(policy, {})[seed] = 1000 * m["ttft_p99_s"]
        pairs = pair_verdicts(real, {p: v for p, v in sim.items() if p in real})
        settled += sum(1 for p in pairs if p[2])
        agreed += sum(1 for p in pairs if p[2] and p[3])
        print(report(f"{name} (fed as {feed})", real, sim, pairs))
        results[name] = {"report_as": feed, "real_ms": real, "sim_ms": sim, "pairs": pairs}
    print(f"\nsettled pairs ordered as in real time: {agreed} of {settled}")
    if a.json:
        with open(a.json, "wb") as fh:
            fh.write(orjson.dumps(results, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS))


def step_overhead(given: str, docs: list[dict[str, Any]]) -> float | None:
    """The ms added to every simulated step: a number, or ("measured") the mean of
    the real runs' ``step_overshoot_ms`` (None when none recorded it)."""
    if given != "measured":
        try:
            return float(given)
        except ValueError:
            return None
    got = [r["step_overshoot_ms"] for d in docs for r in d["runs"] if "step_overshoot_ms" in r]
    return round(statistics.fmean(got), 3) if got else None


def report(
    name: str,
    real: dict[str, dict[int, float]],
    sim: dict[str, dict[int, float]],
    pairs: list[tuple[str, str, bool, bool]],
) -> str:
    """Markdown: per policy, real and simulated TTFT p99 per seed and their ranks;
    then the pairs the simulator orders otherwise."""
    rr, sr = ranking(real), ranking(sim)
    out = [
        f"\n{name}: TTFT p99 ms per seed (mean)",
        "| policy | real | simulated | real rank | simulated rank |",
        "|---|---|---|---|---|",
    ]
    for p in rr:
        cells = [
            ", ".join(f"{v[s]:.0f}" for s in sorted(v)) + f" ({statistics.fmean(v.values()):.0f})"
            for v in (real[p], sim[p])
        ]
        out.append(f"| {p} | {cells[0]} | {cells[1]} | {rr.index(p) + 1} | {sr.index(p) + 1} |")
    for p in sr:
        if p not in real:  # --reference: simulated only
            v = sim[p]
            cell = (
                ", ".join(f"{v[s]:.0f}" for s in sorted(v))
                + f" ({statistics.fmean(v.values()):.0f})"
            )
            out.append(f"| {p} (simulated only) | - | {cell} | - | {sr.index(p) + 1} |")
    for a, b, is_settled, same in pairs:
        if not same:
            why = "settled in real time" if is_settled else "real order within seed noise"
            out.append(f"- simulator orders {b} before {a} ({why})")
    return "\n".join(out)


if __name__ == "__main__":
    main()
