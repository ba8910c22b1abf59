#!/usr/bin/env python3
"""One deployment's Cluster failover, seen from another deployment reported by the same
process (``redisbal.bench.isolation``).

Starts a Redis Cluster (3 primaries, 1 replica each, ``cluster-require-full-coverage
no`` so that the other slots stay served, node timeout ``--node-timeout-ms``), picks
two deployments on different primaries (the victim on the primary of slot 0, the
default node of redis-py's cluster clients), SIGKILLs the victim's primary while both
report through one sender, and prints per run: kill -> promotion, kill -> the
victim's next accepted report, the other deployment's snapshots while the victim's
primary was dead and its longest pause (the target: at most 1 s), and the load
average. Then, per run and reporter kind (``blocking``: ``Router`` and ``Reporter``
from a thread; ``async``: ``AsyncRouter`` and ``AsyncReporter`` from a task), the
setup of an application holding both deployments (``run_one_loop``): a router for
each and one loop reporting every engine of both in turn with ``wait=True``; it
prints the other's cadence before the kill and its longest gap after it, as its
router adopted the snapshots (the target: at most 2x the cadence). The cluster is
started again for each run.

    python scripts/bench_isolation.py [--runs 3] [--step-s 0.1] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import subprocess

from redisbal.bench.isolation import run_isolation, run_one_loop
from redisbal.keys import DeploymentKeys
from redisbal.sim.cluster import ClusterTopology, system_binary


def one_run(node_timeout_ms: int, kind: str = "sender", step_s: float = 0.1) -> dict[str, object]:
    """One run on a fresh cluster: ``kind`` "sender" (run_isolation), or "blocking" /
    "async" (run_one_loop with those routers and reporters)."""
    with ClusterTopology(
        system_binary(), replicas=1, node_timeout_ms=node_timeout_ms, full_coverage=False
    ) as cluster:
        slot0 = cluster.slot_owner(0)[0]
        deps = cluster.deployments_on_distinct_primaries(3, f"iso{os.getpid()}")
        deps.sort(key=lambda d: cluster.node_for_key(DeploymentKeys(d).snapshot) is not slot0)
        victim, other = deps[0], deps[1]
        slot = cluster.slot_of(DeploymentKeys(victim).snapshot)
        old, _ = cluster.slot_owner(slot)

        def promoted() -> bool:
            primary, _ = cluster.slot_owner(slot)
            return primary is not old and cluster.role(primary) == "master"

        if kind != "sender":
            loop_out = asyncio.run(
                run_one_loop(
                    cluster.url, victim, other, old.kill, promoted, kind=kind, step_s=step_s
                )
            )
            return dataclasses.asdict(loop_out)
        out = asyncio.run(run_isolation(cluster.url, victim, other, old.kill, promoted))
    row = dataclasses.asdict(out)
    del row["other_done"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--node-timeout-ms", type=int, default=1500)
    ap.add_argument("--step-s", type=float, default=0.1, help="the one-loop runs' step")
    ap.add_argument("--json", help="write the runs here")
    args = ap.parse_args()
    rows = []
    for kind in ("sender", "blocking", "async"):
        kind_rows = []
        for i in range(args.runs):
            row = {"setup": kind, **one_run(args.node_timeout_ms, kind, args.step_s)}
            kind_rows.append(row)
            print(f"run {i + 1}: " + ", ".join(f"{k}={v}" for k, v in row.items()), flush=True)
        gaps = [float(r["other_max_gap_s"]) for r in kind_rows]  # type: ignore[arg-type]
        ratios = [
            float(r["other_max_gap_s"]) / float(r["cadence_s"])  # type: ignore[arg-type]
            for r in kind_rows
            if "cadence_s" in r
        ]
        ratio = f", longest/cadence worst {max(ratios):.1f}x" if ratios else ""
        print(
            f"{kind}: other deployment's longest pause: median {statistics.median(gaps):.3f} s, "
            f"worst {max(gaps):.3f} s over {len(kind_rows)} runs{ratio}"
        )
        rows += kind_rows
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"commit": commit, "runs": rows}, f, indent=1)


if __name__ == "__main__":
    main()
