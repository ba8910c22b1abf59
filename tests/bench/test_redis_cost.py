"""scripts/redis_cost.py, each mode at a tiny size: it runs to the end on a real
redis-server and prints what it measures (the figures themselves are the
benchmark's, in docs/BENCHMARKS.md, not a test's)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from redisbal.sim.embedded import find_redis_server, server_version

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "scripts" / "redis_cost.py")


def redis_cost(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    run = subprocess.run(
        [sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=timeout
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return run


def test_every_mode_has_its_options() -> None:
    out = redis_cost("--help").stdout
    for mode in ("core", "batch", "ab", "callgrind", "lua"):
        assert mode in out
        assert "usage:" in redis_cost(mode, "--help").stdout
    bad = subprocess.run([sys.executable, SCRIPT, "nope"], capture_output=True, text=True)
    assert bad.returncode == 2 and "invalid choice" in bad.stderr


def test_lua_mode_prints_every_stage() -> None:
    """Its stage copies of the function library load and run (each stage's marker is
    found in report_many's body), and it prints every stage."""
    if server_version(find_redis_server()) < (7, 0):
        pytest.skip("needs Redis >= 7 (functions); only an older redis-server is here")
    out = redis_cost("lua", "--engines", "16", "--batch", "4", "--calls", "1").stdout
    for label in ("checks", "records read", "reports applied", "whole (publish"):
        assert label in out
    for part in ("hgetall", "newest", "counts", "whole"):
        assert f"  {part} " in out


def test_batch_mode_compares_batches_with_single_reports() -> None:
    out = redis_cost(
        "batch", "--engines", "8", "--batches", "4", "--steps", "3", "--repeats", "1"
    ).stdout
    assert "8 engines" in out and "b4/a: median" in out


def test_ab_mode_compares_a_checkout_with_itself() -> None:
    """Both sides are this checkout, measured in their own interpreters: every figure
    gets a ratio."""
    out = redis_cost("ab", "--before", str(ROOT), "--after", str(ROOT), "--rounds", "1").stdout
    for key in ("report_us", "route_32_us", "route_1024_us"):
        assert f"{key}: before median" in out and "after / before" in out
