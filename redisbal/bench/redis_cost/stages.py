"""``lua``: where a report's and a publish's Redis time goes, by stage (server time,
Redis >= 7).

Starts a redis-server, registers N lockstep engines (compact snapshots, no admitted
counts, one incarnation each, as the integrations send) and drives a few steps with
lua/report_many.lua, B engines per call. Then it loads copies of the function library
that stop at a stage and return, and times each with INFO commandstats (usec per
FCALL, divided by the engines per call or in the deployment):

- a report_many call, steady state: up to the end of its argument checks, of its read
  of the records (begin_reports), of applying the reports; then whole (publishes
  included, real steps);
- one publish of all N engines (a republish of the published step): the records'
  HGETALL alone, with each record's newest report found (read_newest), with the
  compact counts made (compact_parts); then the whole publish.

A stage's copy runs on the state the real steps left and writes nothing, so each of
its calls sees the same state. Timings are wall time on a shared host: compare stages
within one run.
"""

from __future__ import annotations

import argparse
import functools
import itertools
from collections.abc import Callable

import redis

from redisbal.barrier.loader import library
from redisbal.barrier.operations import Scripts
from redisbal.bench.redis_cost.common import (
    add_server_option,
    renamed_library,
    start_server,
    usec_per_call,
)
from redisbal.keys import DeploymentKeys
from redisbal.reporting.reporter import new_incarnation

# report_many's body, at the start of each stage after the one named
REPORT_STAGES = {
    "checks": "local now, now_text = now_ms()\nlocal pass\npass, err = begin_reports",
    "records read": "local replies = {}\nfor i = 1, n do\n  local reply, bad = apply_report",
    "reports applied": "local version = end_reports(pass)",
}
# a publish cut short after one of PUBLISH_PARTS (ARGV[3]), reading as publish() reads
PUBLISH_PART = """
  local d = open_deployment(keys, argv, 3, 3)
  local flat = redis.call('HGETALL', d.reports)
  if argv[3] == 'hgetall' then return #flat end
  local ids, jsons, n = {}, {}, 0
  for i = 1, #flat, 2 do
    if is_engine_field(flat[i]) then
      n = n + 1
      ids[n] = flat[i]
      local _, _
      _, _, jsons[n] = read_newest(flat[i + 1])
    end
  end
  if argv[3] == 'newest' then return n end
  local _, _, counts = compact_parts(ids, jsons, now_ms(), nil)
  return #counts
"""
PUBLISH_PARTS = ("hgetall", "newest", "counts")


def per_call_us(r: redis.Redis, run: Callable[[], object], calls: int) -> float:
    r.config_resetstat()
    for _ in range(calls):
        run()
    return usec_per_call(r, "fcall")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--engines", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--calls", type=int, default=5, help="timed rounds per stage")
    add_server_option(ap)


def run(args: argparse.Namespace) -> int:
    if not 1 <= args.batch <= 1024 or args.engines < args.batch or args.calls < 1:
        raise SystemExit("need 1 <= --batch <= 1024, --engines >= --batch and --calls >= 1")
    server = start_server(args.redis_server)
    try:
        r = redis.Redis.from_url(server.url)
        if server.version < (7, 0):
            raise SystemExit("the lua mode needs Redis >= 7 (functions)")
        keys = DeploymentKeys("lb")
        r.hset(keys.config, mapping={"compact_from": 0, "dead_after_ms": 1_000_000_000})
        name, source = library()
        r.function_load(source, replace=True)
        Scripts(r, keys).call("register", "ep", *(f"engine-{i}" for i in range(args.engines)))
        incs = [new_incarnation() for _ in range(args.engines)]
        n, b = args.engines, args.batch

        def step(function: str, s: int) -> None:
            for lo in range(0, n, b):
                hi = min(n, lo + b)
                fields = [
                    x
                    for i in range(lo, hi)
                    for x in (f"engine-{i}", "0", s, i % 5, 10 + i % 7, "0.4000", "", incs[i], "1")
                ]
                r.fcall(function, 7, *keys.script_keys(), "lb", "PUBLISH", "ep", hi - lo, *fields)

        for s in range(3):
            step(f"{name}_report_many", s)
        calls = (n + b - 1) // b
        print(f"report_many, {n} engines, {b} per call: server us per engine-step")
        body = source.index("local function op_report_many")
        for stage, mark in REPORT_STAGES.items():
            if mark not in source[body:]:
                raise SystemExit(f"report_many no longer has {mark!r}: update REPORT_STAGES")
            stop = "if true then return 0 end\n" + mark
            cut = source[:body] + source[body:].replace(mark, stop, 1)
            r.function_load(renamed_library(cut, name, "lbstage"), replace=True)
            us = per_call_us(r, lambda: step("lbstage_report_many", 3), args.calls)
            print(f"  to the end of {stage:16} {us / b:7.2f}", flush=True)
        steps = itertools.count(4)
        us = per_call_us(r, lambda: step(f"{name}_report_many", next(steps)), args.calls)
        print(f"  whole (publish included)      {us / b:7.2f}  ({calls} calls a step)")

        extra = (
            f"redis.register_function('lb_publish_part', function(keys, argv){PUBLISH_PART}end)\n"
            "redis.register_function('lb_publish', function(keys, argv)\n"
            "  local d = open_deployment(keys, argv, 3, 3)\n"
            "  return publish(d, published_score(d), now_ms())\n"
            "end)\n"
        )
        r.function_load(renamed_library(source, name, "lbpub") + extra, replace=True)
        print(f"one publish of {n} engines (compact): ms, and us per engine")
        for part in (*PUBLISH_PARTS, "whole"):
            fn, arg = ("lb_publish", "") if part == "whole" else ("lb_publish_part", part)
            call = functools.partial(r.fcall, fn, 7, *keys.script_keys(), "lb", "PUBLISH", arg)
            us = per_call_us(r, call, args.calls * 4)
            print(f"  {part:8} {us / 1000:6.2f} ms  {us / n:6.2f} us", flush=True)
    finally:
        server.cleanup()
    return 0
