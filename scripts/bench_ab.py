"""Redis server time per report of two redisbal trees, interleaved on one server, as ratios.

    git worktree add /tmp/before <commit>
    python scripts/bench_ab.py --before /tmp/before [--after .] [--rounds 8]
        [--delivery pipelined|concurrent|sequential] [--redis-url URL]

This machine's timings wander by tens of percent within minutes, so two
versions measured at different times cannot be compared. Here each round runs
``bench_core.bench_report_server_time`` (64 engines, 3 repeats) once for each
tree, in alternating order, against the same redis-server (each tree's Lua is
its own function library there), and the figure that counts is the median of
the per-round ratios after / before.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

ONE_RUN = r"""
import json, sys
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/scripts"]
import redis, bench_core
client = redis.Redis.from_url(sys.argv[2])
r = bench_core.bench_report_server_time(client, sys.argv[2], repeats=3, delivery=sys.argv[3])
print(json.dumps({"us": r["median_us"], "mode": r["mode"], "lib": bench_core.__file__}))
"""


def measure(tree: str, url: str, delivery: str) -> float:
    out = subprocess.run(
        [sys.executable, "-c", ONE_RUN, tree, url, delivery],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": tree},
    )
    if out.returncode:
        raise SystemExit(f"run in {tree} failed:\n{out.stderr[-3000:]}")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    if not r["lib"].startswith(os.path.abspath(tree)):
        raise SystemExit(f"{tree}: imported {r['lib']} instead of the tree's own code")
    return float(r["us"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", required=True, help="checkout of the version to compare with")
    ap.add_argument("--after", default=".", help="checkout of the new version (default: .)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument(
        "--delivery", default="pipelined", choices=("pipelined", "concurrent", "sequential")
    )
    ap.add_argument("--redis-url", help="default: start a redis-server")
    args = ap.parse_args()
    trees = {"before": os.path.abspath(args.before), "after": os.path.abspath(args.after)}
    server = None
    url = args.redis_url
    if not url:
        from redisbal.sim.embedded import RedisServer

        server = RedisServer().start()
        url = server.url
    got: dict[str, list[float]] = {"before": [], "after": []}
    try:
        for i in range(args.rounds):
            order = ["before", "after"] if i % 2 == 0 else ["after", "before"]
            for name in order:
                got[name].append(measure(trees[name], url, args.delivery))
            print(
                f"round {i + 1}/{args.rounds}: before {got['before'][-1]:.1f} us, "
                f"after {got['after'][-1]:.1f} us",
                flush=True,
            )
    finally:
        if server is not None:
            server.cleanup()
    ratios = [a / b for a, b in zip(got["after"], got["before"], strict=True)]
    for name, v in got.items():
        print(f"{name:6s}: median {statistics.median(v):.2f} us (range {min(v):.2f}-{max(v):.2f})")
    ratio = statistics.median(ratios)
    print(f"after / before, median of {len(ratios)} rounds ({args.delivery}): {ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
