#!/usr/bin/env python3
"""Start a local Redis Cluster of three primaries for trying redisbal on a cluster.

    python scripts/local_cluster.py                  # random free ports, until Ctrl-C
    python scripts/local_cluster.py --ports 7000,7001,7002
    python scripts/local_cluster.py --binary /path/to/redis-server --duration 600

It prints the ``redis+cluster://`` URL to use, e.g.

    export REDISBAL_REDIS_URL=redis+cluster://127.0.0.1:7000,127.0.0.1:7001,127.0.0.1:7002
    redisbal --deployment llama coordinator --expect 4 &
    redisbal --deployment llama engine-sim --engines 4 &
    redisbal --deployment llama api --burst 256 --duration 30

Needs redis-server (7.x for sharded pub/sub; 6.2 works with classic pub/sub) and
redis-cli (to run ``redis-cli --cluster create``): on Debian/Ubuntu
``apt-get install redis-server redis-tools``. Nodes listen on 127.0.0.1 only,
without persistence, in a temporary directory that is removed on exit. Each port
P also needs P + 10000 free (the cluster bus).
"""

from __future__ import annotations

import argparse
import signal
import sys
import time

from redisbal.sim.cluster import ClusterTopology, system_binary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ports", help="comma-separated ports of the primaries (default: free ones)")
    ap.add_argument("--binary", default=None, help="redis-server to run (default: on PATH)")
    ap.add_argument("--duration", type=float, default=None, help="stop after this many seconds")
    args = ap.parse_args(argv)
    binary = args.binary or system_binary()
    if not binary:
        print("redis-server not found: apt-get install redis-server redis-tools", file=sys.stderr)
        return 2
    ports = [int(p) for p in args.ports.split(",")] if args.ports else None
    cluster = ClusterTopology(binary, ports=ports)
    stop = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    cluster.start()
    try:
        version = ".".join(map(str, cluster.version))
        pubsub = "sharded pub/sub" if cluster.version >= (7, 0, 0) else "classic pub/sub"
        print(f"Redis {version} cluster of {cluster.n} primaries is up ({pubsub}).")
        print(f"export REDISBAL_REDIS_URL={cluster.url}", flush=True)
        end = None if args.duration is None else time.monotonic() + args.duration
        while not stop and (end is None or time.monotonic() < end):
            time.sleep(0.2)
    finally:
        cluster.cleanup()
        print("cluster stopped", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
