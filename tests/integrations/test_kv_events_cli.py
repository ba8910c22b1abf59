"""`redisbal kv-events` and `engine-sim --kv-events` as users run them: bad input is one
line and exit code 2, a run says what it follows and stops cleanly on SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
from click.testing import CliRunner
from support.cli import REDISBAL, run_cli, scrub_environ, scrubbed_env
from support.procs import free_port_block

from redisbal.ops.cli import cli

UNREACHABLE = "redis://127.0.0.1:1/0"  # every bad input must be refused before connecting


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["kv-events", "--source", "e0"], "use ENGINE_ID=tcp://host:port"),
        (["kv-events", "--source", "e0=http://h:1"], "is not a ZeroMQ endpoint"),
        (["kv-events", "--source", "e0=tcp://h"], "--source: 'tcp://h': give the host and port"),
        (["kv-events", "--source", "e0=tcp://*:5557"], "give the host and port to connect to"),
        (["kv-events", "--source", "e 0=tcp://h:1"], "invalid engine id 'e 0'"),
        (["kv-events", "--source", "e0=tcp://h:1", "--source", "e0=tcp://h:2"], "twice"),
        (["kv-events", "--source", "e0=tcp://h:1", "--replay", "e1=tcp://h:2"], "no --source"),
        (["kv-events", "--source", "e0=tcp://h:1", "--block-size", "0"], "--block-size"),
        (["kv-events"], "Missing option '--source'"),
        (["engine-sim", "--kv-events", "tcp://127.0.0.1:5557"], "needs --http-port and"),
        (
            ["engine-sim", "--http-port", "0", "--cache-blocks", "8", "--kv-events", "udp://x"],
            "is not a ZeroMQ endpoint",
        ),
        (
            [
                "engine-sim",
                "--http-port",
                "0",
                "--cache-blocks",
                "8",
                "-n",
                "3",
                "--kv-events",
                "tcp://127.0.0.1:65534",
            ],
            "out of range",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(args: list[str], expected: str) -> None:
    res = run_cli(*args, "--redis-url", UNREACHABLE)
    assert res.returncode == 2, res.stderr
    assert expected in res.stderr
    assert "Traceback" not in res.stderr and "cannot reach" not in res.stderr


def test_without_the_extra_it_says_which_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    scrub_environ(monkeypatch)
    monkeypatch.setitem(sys.modules, "zmq", None)  # import now fails
    args = ["kv-events", "--source", "e0=tcp://h:1", "--redis-url", UNREACHABLE]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 1
    assert "pip install 'redisbal[kv-events]'" in res.output


def test_a_run_says_what_it_follows_and_stops_on_sigterm(redis_url: str, deployment: str) -> None:
    port = free_port_block(1)
    proc = subprocess.Popen(
        [REDISBAL, "kv-events", "--redis-url", redis_url, "--deployment", deployment,
         "--source", f"e0=tcp://127.0.0.1:{port}"],
        stderr=subprocess.PIPE, text=True, env=scrubbed_env(),
    )  # fmt: skip
    assert proc.stderr is not None
    try:
        lines = []
        for line in proc.stderr:
            lines.append(line)
            if "following engine e0" in line:
                break
        assert f"following engine e0 at tcp://127.0.0.1:{port}" in "".join(lines)
        assert any(f"deployment {deployment}" in line for line in lines)
        proc.send_signal(signal.SIGTERM)
        _, rest = proc.communicate(timeout=30)
        assert proc.returncode == 0, rest
        assert "Traceback" not in rest and "e0: 0 anchors" in rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
