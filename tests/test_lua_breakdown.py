"""scripts/lua_breakdown.py at a tiny size: its stage copies of the function library load
and run (each stage's marker is found in report_many's body), and it prints every stage."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from redisbal.sim.embedded import find_redis_server, server_version

SCRIPT = str(Path(__file__).resolve().parent.parent / "scripts" / "lua_breakdown.py")


def test_lua_breakdown_prints_every_stage() -> None:
    if server_version(find_redis_server()) < (7, 0):
        pytest.skip("needs Redis >= 7 (functions); only an older redis-server is here")
    run = subprocess.run(
        [sys.executable, SCRIPT, "--engines", "16", "--batch", "4", "--calls", "1"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    for label in ("checks", "records read", "reports applied", "whole (publish"):
        assert label in run.stdout
    for part in ("hgetall", "newest", "counts", "whole"):
        assert f"  {part} " in run.stdout
