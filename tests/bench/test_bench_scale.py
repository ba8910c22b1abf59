"""scripts/bench_scale.py at a tiny size against a real redis-server: it drives the
engines, every router gets snapshots, and the JSON holds the figures it promises."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from redisbal.sim.embedded import RedisServer

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "scripts" / "bench_scale.py")


@pytest.mark.parametrize(
    ("batch", "mode"),
    [(0, ""), (4, ""), (4, "--nodes"), (0, "--independent"), (4, "--independent")],
)
def test_bench_scale_smoke(
    fresh_server: RedisServer, tmp_path: Path, batch: int, mode: str
) -> None:
    out = tmp_path / "scale.json"
    run = subprocess.run(
        [
            sys.executable, SCRIPT, "--redis-url", fresh_server.url,
            "--engines", "8", "--subscribers", "2", "--rate", "50",
            "--warmup", "1", "--duration", "2", "--json", str(out), "--batch", str(batch),
            *([mode] if mode else []),
        ],
        capture_output=True, text=True, timeout=90,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    doc = json.loads(out.read_text())
    for key in ("date", "commit", "machine", "redis_version", "points", "model"):
        assert key in doc, key
    assert doc["machine"]["cores"] >= 1
    (p,) = doc["points"]
    assert (p["engines"], p["subscribers"], p["deployments"]) == (8, 2, 1)
    assert p["snapshots_per_s"] > 0
    r = p["redis"]
    assert r["cpu_ms_per_step"] > 0 and r["net_out_MBps"] > 0
    calls = r["commands"].get("fcall") or r["commands"]["evalsha"]
    assert calls["usec_per_call"] > 0
    assert set(r["step_ms"]) == {"reports_ms", "publish_ms", "other_ms"}
    # each snapshot names 8 engines with 2 admitted counts each: a few hundred bytes
    assert 8 * 50 < p["snapshot_bytes"] < 8 * 1000
    assert len(p["routers"]) == 2
    for router in p["routers"]:
        assert router["snapshots"] > 0 and router["adopted"] > 0
        # a snapshot arrives after the report that completed it was sent (an order): the
        # last report of its step, or (independent) the call whose reply names it
        assert router["p50_ms"] > 0 and router["p99_ms"] >= router["p50_ms"]
        assert router["adopt_ms"] > 0 and router["proc_ms"] > 0
    assert "N x K" in run.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--batch", "5000"], "--batch must be"),
        (["--independent", "--rate", "30"], "divides 1000"),
        (["--nodes", "--redis-url", "unix:///tmp/r.sock"], "redis://host:port"),
    ],
)
def test_bench_scale_bad_arguments_are_one_line(args: list[str], message: str) -> None:
    run = subprocess.run(
        [sys.executable, SCRIPT, *args, "--engines", "8"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2
    assert message in run.stderr and "Traceback" not in run.stderr
