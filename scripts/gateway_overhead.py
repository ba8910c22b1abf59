#!/usr/bin/env python3
"""What one gateway adds: the same open-loop load straight to an engine and through
the gateway, interleaved in one run, so that host noise hits both alike.

Starts a redis-server, one HTTP engine simulator (``--base-step-ms`` small, so the
engine answers in about one event-loop turn) and one ``redisbal gateway``
process, then for each rate runs ``redisbal loadgen``'s generator against the
engine and against the gateway, ``--reps`` times each, alternating. Non-streamed
small bodies (one output token) give added end-to-end latency; streamed requests
give added time to first token. The gateway's CPU is read from /proc
(user + system seconds over the run's elapsed time).

    python scripts/gateway_overhead.py --rates 200,500 --duration 8 --reps 2 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import time
from typing import Any

import orjson

from redisbal.embedded import RedisServer
from redisbal.gateway.loadgen import plan, run

HERE = os.path.dirname(os.path.abspath(__file__))
REDISBAL = os.path.join(os.path.dirname(sys.executable), "redisbal")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_http(url: str, timeout: float = 20.0) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} not ready")
        time.sleep(0.2)


def one_run(url: str, rate: float, duration: float, stream: bool, seed: int) -> dict[str, Any]:
    planned = plan(
        rate=rate,
        duration=duration,
        arrival="poisson",
        burst=1,
        burst_every=1.0,
        prompt_mean=8,
        output_mean=8 if stream else 1,
        sigma=0.0,
        seed=seed,
    )
    opts = {
        "model": "redisbal-sim",
        "stream": stream,
        "chat": False,
        "ignore_eos": True,
        "headers": {"Content-Type": "application/json"},
        "timeout": 30.0,
        "progress": False,
    }
    return asyncio.run(run(url, planned, opts))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rates", default="200,500")
    ap.add_argument("--duration", type=float, default=8.0)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    rates = [float(r) for r in a.rates.split(",")]
    procs: list[subprocess.Popen[bytes]] = []
    with RedisServer(tcp=True) as server:
        eport, gport = free_port(), free_port()
        env = {**os.environ, "REDISBAL_REDIS_URL": server.url, "REDISBAL_DEPLOYMENT": "ovh"}
        try:
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "redisbal.sim.http_engine",
                        "--redis-url",
                        server.url,
                        "--deployment",
                        "ovh",
                        "--http-port",
                        str(eport),
                        "--base-step-ms",
                        "0.05",
                        "--running-cap",
                        "1024",
                        "--log-level",
                        "warning",
                    ],
                    env=env,
                )
            )
            wait_http(f"http://127.0.0.1:{eport}/health")
            gw = subprocess.Popen(
                [REDISBAL, "gateway", "--port", str(gport), "--log-level", "warning"], env=env
            )
            procs.append(gw)
            wait_http(f"http://127.0.0.1:{gport}/health")
            direct, via = f"http://127.0.0.1:{eport}", f"http://127.0.0.1:{gport}"
            rows = []
            for stream in (False, True):
                for rate in rates:
                    for rep in range(a.reps):
                        for name, url in (("direct", direct), ("gateway", via)):
                            c0, t0 = cpu_seconds(gw.pid), time.monotonic()
                            res = one_run(url, rate, a.duration, stream, seed=rep)
                            cores = (cpu_seconds(gw.pid) - c0) / (time.monotonic() - t0)
                            row = {
                                "target": name,
                                "rate": rate,
                                "stream": stream,
                                "rep": rep,
                                "gateway_cores": round(cores, 3),
                                **res,
                            }
                            rows.append(row)
                            print(orjson.dumps(row).decode(), flush=True)
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(10)
    table = summarize(rows)
    print(table)
    if a.json:
        with open(a.json, "wb") as fh:
            fh.write(orjson.dumps({"rows": rows}, option=orjson.OPT_INDENT_2))


def summarize(rows: list[dict[str, Any]]) -> str:
    """Markdown: per (mode, rate), medians over reps of direct and gateway, and the
    difference (what the gateway adds)."""
    out = [
        "| mode | rate | metric | direct ms | gateway ms | added ms | gateway cores |",
        "|---|---|---|---|---|---|---|",
    ]
    keys = sorted({(r["stream"], r["rate"]) for r in rows})
    for stream, rate in keys:
        sel = [r for r in rows if r["stream"] == stream and r["rate"] == rate]
        metrics = ("ttft_p50_ms", "ttft_p99_ms") if stream else ("e2e_p50_ms", "e2e_p99_ms")
        for m in metrics:
            d = _median([r[m] for r in sel if r["target"] == "direct" and r[m] is not None])
            g = _median([r[m] for r in sel if r["target"] == "gateway" and r[m] is not None])
            cores = _median([r["gateway_cores"] for r in sel if r["target"] == "gateway"])
            out.append(
                f"| {'stream' if stream else 'whole'} | {rate:g} | {m} | {d:.2f} | "
                f"{g:.2f} | {g - d:+.2f} | {cores:.2f} |"
            )
    return "\n".join(out)


def _median(v: list[float]) -> float:
    s = sorted(v)
    return s[len(s) // 2] if s else float("nan")


if __name__ == "__main__":
    main()
