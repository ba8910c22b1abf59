"""``ab``: route() and Redis server time per report of two checkouts, interleaved, as
ratios after / before.

    git worktree add /tmp/before main
    python scripts/redis_cost.py ab --before /tmp/before [--after .] [--rounds 8]

Timings on a shared host wander by tens of percent within minutes, so two versions
measured at different times cannot be compared. Each round measures, in a fresh
interpreter per checkout and in alternating order, the report's server time (64
engines, 3 repeats, against one redis-server where each checkout's Lua is its own
function library) and route() of the default policy at 32 and 1,024 engines; the
figures that count are the medians of the per-round ratios. A checkout from before
this mode existed is measured by its ``scripts/bench_core.py`` (same functions).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from redisbal.bench.redis_cost.common import add_server_option, load_average, start_server

ROUTE_ENGINES = (32, 1024)
ONE_RUN = r"""
import json, sys
tree, url, delivery = sys.argv[1:4]
sys.path[:0] = [tree, tree + "/scripts"]
try:
    from redisbal.bench.redis_cost import core
except ImportError:  # a checkout from before redis_cost: the same functions
    import bench_core as core
import redis
out = {"lib": core.__file__}
if url:
    client = redis.Redis.from_url(url)
    r = core.bench_report_server_time(client, url, repeats=3, delivery=delivery)
    out["report_us"] = r["median_us"]
for n in (32, 1024):
    out[f"route_{n}_us"] = core.bench_route(n, "redisbal")["median_us"]
print(json.dumps(out))
"""


def measure(tree: str, url: str, delivery: str) -> dict[str, float]:
    """One checkout's figures, measured in a fresh interpreter on its own code."""
    out = subprocess.run(
        [sys.executable, "-c", ONE_RUN, tree, url, delivery],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": tree},
        check=False,
    )
    if out.returncode:
        raise SystemExit(f"run in {tree} failed:\n{out.stderr[-3000:]}")
    got = json.loads(out.stdout.strip().splitlines()[-1])
    if not str(got.pop("lib")).startswith(tree):
        raise SystemExit(f"{tree}: did not import the checkout's own code")
    return {k: float(v) for k, v in got.items()}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--before", required=True, help="checkout of the version to compare with")
    ap.add_argument("--after", default=".", help="checkout of the new version (default: .)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument(
        "--delivery", default="pipelined", choices=("pipelined", "concurrent", "sequential")
    )
    ap.add_argument("--redis-url", help="default: start a redis-server")
    ap.add_argument("--route-only", action="store_true", help="route() only, no Redis")
    add_server_option(ap)


def run(args: argparse.Namespace) -> int:
    trees = {"before": os.path.abspath(args.before), "after": os.path.abspath(args.after)}
    server = None
    url = "" if args.route_only else args.redis_url
    if not args.route_only and not url:
        server = start_server(args.redis_server)
        url = server.url
    got: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    try:
        for i in range(args.rounds):
            order = ["before", "after"] if i % 2 == 0 else ["after", "before"]
            for name in order:
                got[name].append(measure(trees[name], url, args.delivery))
            cells = "  ".join(
                f"{k} {got['before'][-1][k]:.2f} -> {got['after'][-1][k]:.2f}"
                for k in got["after"][-1]
            )
            print(f"round {i + 1}/{args.rounds}: {cells}  (load {load_average():.1f})", flush=True)
    finally:
        if server is not None:
            server.cleanup()
    for key in got["after"][0]:
        before = [r[key] for r in got["before"]]
        ratios = [a[key] / b[key] for a, b in zip(got["after"], got["before"], strict=True)]
        print(
            f"{key}: before median {statistics.median(before):.2f} us; after / before, median "
            f"of {len(ratios)} rounds {statistics.median(ratios):.3f} "
            f"(range {min(ratios):.3f}-{max(ratios):.3f})"
        )
    return 0
