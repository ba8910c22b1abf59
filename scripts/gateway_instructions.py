#!/usr/bin/env python3
"""Instructions per request of one gateway process, counted by callgrind: what
``scripts/gateway_overhead.py`` measures in CPU time, without the host's noise (on a
busy 2-core machine its ratios swing by a third from one repetition to the next).

For each ``--targets`` kind (``plain``: no tracing, ``--access-log off``; ``traced``:
100% sampled to an OTLP/HTTP sink that drops what it gets; ``logged``: JSON access
lines to /dev/null; ``other``: ``--other-src DIR``'s gateway, without its access log
where it has one), starts Redis, one engine-sim engine and the gateway under
``valgrind --tool=callgrind`` with instrumentation off; warms it up, switches counting
on (``callgrind_control``), sends ``--rate`` requests a second for ``--duration``
seconds, waits 6 s (the batch processor exports every 5 s), switches counting off and
reads the total. The figure includes the gateway's background work over that window,
the same for every kind. Needs valgrind; slow (the gateway runs about 50x slower).

    python scripts/gateway_instructions.py --targets plain,traced --mode stream
"""

from __future__ import annotations

import argparse
import glob
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from gateway_overhead import SINK, free_port, one_run, wait_http

from redisbal.sim.embedded import RedisServer


def count(kind: str, a: Any, out_dir: str) -> dict[str, Any]:
    """One gateway of ``kind`` under callgrind: its requests and instructions."""
    py = sys.executable
    with RedisServer(tcp=True) as server:
        env = {**os.environ, "REDISBAL_REDIS_URL": server.url, "REDISBAL_DEPLOYMENT": "ins"}
        eport, gport = free_port(), free_port()
        procs = [
            subprocess.Popen(
                [py, "-m", "redisbal", "engine-sim", "--engines", "1", "--http-port", str(eport),
                 "--base-step-ms", "1", "--running-cap", "1024", "--log-level", "warning"],
                env=env, cwd=out_dir,
            )
        ]  # fmt: skip
        cmd = [py, "-m", "redisbal", "gateway", "--port", str(gport), "--log-level", "warning"]
        cmd += ["--client-index", "auto", "--no-tell-routes"]
        genv, cwd = env, out_dir
        if kind == "other":  # (-m puts the working directory first)
            genv, cwd = {**env, "PYTHONPATH": os.path.abspath(a.other_src)}, a.other_src
        elif kind == "logged":
            cmd += ["--access-log", "json"]
        else:
            cmd += ["--access-log", "off"]
        if kind == "traced":
            sport = free_port()
            procs.append(subprocess.Popen([py, "-c", SINK, str(sport)]))
            cmd += ["--otlp-traces-endpoint", f"http://127.0.0.1:{sport}"]
        out = os.path.join(out_dir, f"callgrind.{kind}")
        vg = [
            "valgrind",
            "--tool=callgrind",
            "--instr-atstart=no",
            f"--callgrind-out-file={out}.%p",
        ]
        gw = subprocess.Popen(vg + cmd, env=genv, cwd=cwd, stderr=subprocess.DEVNULL)
        try:
            wait_http(f"http://127.0.0.1:{eport}/health")
            url = f"http://127.0.0.1:{gport}"
            wait_http(url + "/health", timeout=600)
            one_run(url, 10, 3, a.mode == "stream", seed=9)  # warm
            subprocess.run(["callgrind_control", "--instr=on", str(gw.pid)], check=True,
                           capture_output=True)  # fmt: skip
            res = one_run(url, a.rate, a.duration, a.mode == "stream", seed=1)
            time.sleep(6)
            for what in ("--instr=off", "--dump"):
                subprocess.run(["callgrind_control", what, str(gw.pid)], check=True,
                               capture_output=True)  # fmt: skip
            time.sleep(2)
        finally:
            gw.send_signal(signal.SIGTERM)
            gw.wait(120)
            for p in procs:
                p.terminate()
                p.wait(10)
    total = 0
    for name in glob.glob(f"{out}.{gw.pid}*"):
        with open(name) as fh:
            total += sum(int(ln.split()[1]) for ln in fh if ln.startswith("totals:"))
    n = max(1, res["requests"])
    return {"target": kind, "mode": a.mode, "requests": res["requests"], "ok": res["ok"],
            "instructions": total, "per_request": round(total / n)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--targets", default="plain,traced")
    ap.add_argument("--mode", choices=("stream", "whole"), default="stream")
    ap.add_argument("--rate", type=float, default=8.0)
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--other-src", default=None)
    ap.add_argument(
        "--keep",
        default=None,
        metavar="DIR",
        help="keep the callgrind files here (callgrind_annotate --inclusive=yes reads them)",
    )
    a = ap.parse_args()
    kinds = a.targets.split(",")
    if unknown := set(kinds) - {"plain", "traced", "logged", "other"}:
        sys.exit(f"gateway_instructions: unknown targets {sorted(unknown)}")
    if "other" in kinds and not a.other_src:
        sys.exit("gateway_instructions: the target 'other' needs --other-src")
    rows = []
    with tempfile.TemporaryDirectory(prefix="redisbal-callgrind-") as tmp:
        out_dir = os.path.abspath(a.keep) if a.keep else tmp
        os.makedirs(out_dir, exist_ok=True)
        for kind in kinds:
            rows.append(count(kind, a, out_dir))
            print(rows[-1], flush=True)
    base = rows[0]["per_request"]
    print(f"| target | mode | requests (ok) | instructions per request | x {rows[0]['target']} |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['target']} | {r['mode']} | {r['requests']} ({r['ok']}) "
              f"| {r['per_request']:,} | {r['per_request'] / base:.3f} |")  # fmt: skip


if __name__ == "__main__":
    main()
