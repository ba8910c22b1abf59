"""The command line: help and version, clear errors for bad input (without leaking
secrets), status against a real server with reporting engines, a timed coordinator run.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import orjson
import pytest
import redis
from click.testing import CliRunner
from support.cli import scrub_environ, scrubbed_env
from support.helpers import wait_until

import redisbal
from redisbal import Counts, Reporter
from redisbal.keys import DeploymentKeys
from redisbal.ops.cli import cli

COMMANDS = ["coordinator", "engine-sim", "api", "status", "demo", "load-functions"]


@pytest.fixture
def runner(monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    scrub_environ(monkeypatch)
    return CliRunner()


def run(runner: CliRunner, *args: str, **kw: object):  # type: ignore[no-untyped-def]
    return runner.invoke(cli, list(args), catch_exceptions=False, **kw)  # type: ignore[arg-type]


# -- help and version ---------------------------------------------------------------------------


def test_group_help_lists_every_command(runner: CliRunner) -> None:
    res = run(runner, "--help")
    assert res.exit_code == 0
    for cmd in COMMANDS:
        assert cmd in res.output
    assert "REDISBAL_REDIS_URL" in res.output


@pytest.mark.parametrize("cmd", COMMANDS)
def test_each_command_has_help_with_the_shared_options(runner: CliRunner, cmd: str) -> None:
    res = run(runner, cmd, "--help")
    assert res.exit_code == 0, res.output
    assert f"Usage: redisbal {cmd}" in res.output
    for opt in ("--redis-url", "--deployment", "--log-level"):
        assert opt in res.output


def test_version(runner: CliRunner) -> None:
    res = run(runner, "--version")
    assert res.exit_code == 0
    assert res.output.strip() == f"redisbal, version {redisbal.__version__}"


def test_python_dash_m_runs_the_cli() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "redisbal", "--version"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert redisbal.__version__ in out.stdout


# -- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["group", "command"])
def test_bad_deployment_name_names_the_option(runner: CliRunner, where: str) -> None:
    opts = ["--redis-url", "redis://127.0.0.1:1/0", "--deployment", "has space"]
    args = [*opts, "status"] if where == "group" else ["status", *opts]
    res = run(runner, *args)
    assert res.exit_code == 2
    assert "Invalid value for '--deployment'" in res.output
    assert "'has space'" in res.output
    assert "A-Z a-z 0-9" in res.output  # says what a valid name is


def test_bad_deployment_from_env_says_so(runner: CliRunner) -> None:
    res = run(
        runner, "status", env={"REDISBAL_DEPLOYMENT": "{x}", "REDISBAL_REDIS_URL": "redis://h"}
    )
    assert res.exit_code == 2
    assert "--deployment" in res.output and "$REDISBAL_DEPLOYMENT" in res.output


def test_bad_url_scheme(runner: CliRunner) -> None:
    res = run(runner, "status", "--redis-url", "http://localhost:6379")
    assert res.exit_code == 2
    assert "Invalid value for '--redis-url'" in res.output
    assert "unsupported scheme 'http'" in res.output


def test_bad_url_never_shows_the_password(runner: CliRunner) -> None:
    res = run(runner, "status", "--redis-url", "redis+sentinel://u:s3cret@host:notaport/mymaster")
    assert res.exit_code == 2
    assert "--redis-url" in res.output and "notaport" in res.output
    assert "s3cret" not in res.output


def test_unreachable_redis_is_one_clear_line_without_the_password(runner: CliRunner) -> None:
    # port 1 on loopback: nothing listens there
    res = run(runner, "status", "--redis-url", "redis://:s3cret@127.0.0.1:1/0")
    assert res.exit_code == 1
    assert "cannot reach Redis at redis://:***@127.0.0.1:1/0" in res.output
    assert "s3cret" not in res.output
    assert "Traceback" not in res.output


def test_missing_url_says_how_to_give_one(runner: CliRunner) -> None:
    res = run(runner, "status")
    assert res.exit_code == 2
    assert "--redis-url" in res.output and "REDISBAL_REDIS_URL" in res.output


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["coordinator", "--stall-ms", "0"], "Invalid value for '--stall-ms'"),
        (["coordinator", "--tick-ms", "x"], "'x' is not a valid integer"),
        (
            ["coordinator", "--dead-after-ms", "200", "--stall-ms", "300"],
            "stall_ms (300) must be below dead_after_ms (200)",
        ),
        (["coordinator", "--expect", "a b"], "Invalid value for '--expect'"),
        (["coordinator", "--expect", "0"], "must be in 1..4096"),
        (["engine-sim", "--engines", "0"], "Invalid value for '--engines'"),
        (["engine-sim", "--slow", "3:abc"], "use ID[,ID...]:FACTOR"),
        (["engine-sim", "--slow", "9:2"], "does not run: ['9']"),
        (["engine-sim", "--id-prefix", "{"], "invalid engine id"),
        (["engine-sim", "--no-report"], "--no-report needs --http-port"),
        (["engine-sim", "--http-port", "0", "--slow", "7:2"], "does not run: ['7']"),
        (["engine-sim", "--http-port", "0", "--advertise-host", "a/b"], "not a host name"),
        (["engine-sim", "--http-port", "0", "--host", "bad host"], "not a host name"),
        (["api", "--client-index", "3", "--client-count", "2"], "do not fit in --client-count 2"),
        (["api"], "no load: give --burst N and/or --rate R"),
        (["api", "--burst", "-5"], "Invalid value for '--burst'"),
        (["api", "--policy", "fastest"], "Invalid value for '--policy'"),
        (["status", "--watch", "0"], "Invalid value for '--watch'"),
        (["demo", "--engines", "0"], "Invalid value for '--engines'"),
        (["demo", "--duration", "-1"], "Invalid value for '--duration'"),
        (["demo", "--http", "--mode", "lockstep"], "--mode tick only"),
        (["demo", "--http", "--rate", "5", "--burst", "10"], "--burst or --rate"),
        (["demo", "--compare", "fastest"], "use 'none' or policies from redisbal, random"),
        (["demo", "--compare", "none,round-robin"], "Invalid value for '--compare'"),
        (["demo", "--sigma", "-1"], "Invalid value for '--sigma'"),
        (["demo", "--slow", "99:2"], "does not run: 99 (its engines are 0..7)"),
        (["api", "--burst", "5", "--start-at", "nan"], "Invalid value for '--start-at'"),
        (["bench", "--seeds", "0"], "--seeds takes a count (3) or a list (1,2,5)"),
        (["bench", "--seeds", ","], "--seeds takes a count (3) or a list (1,2,5)"),
    ],
)
def test_bad_numbers_and_values_are_usage_errors(
    runner: CliRunner, args: list[str], expected: str
) -> None:
    # the URL is valid but unreachable: every one of these must fail before connecting
    res = run(runner, *args, "--redis-url", "redis://127.0.0.1:1/0")
    assert res.exit_code == 2, res.output
    assert expected in res.output
    assert "cannot reach" not in res.output


def test_metrics_port_without_prometheus_names_the_extra(
    runner: CliRunner, redis_url: str, deployment: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delitem(sys.modules, "redisbal.ops.coordinator_metrics", raising=False)
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import now fails
    res = run(
        runner,
        "coordinator",
        "--redis-url",
        redis_url,
        "--deployment",
        deployment,
        "--metrics-port",
        "9",
        "--duration",
        "0.1",
    )
    assert res.exit_code == 1
    assert "pip install 'redisbal[metrics]'" in res.output


# -- against a real server ----------------------------------------------------------------------


def test_option_before_or_after_the_command_and_env(
    runner: CliRunner, redis_url: str, deployment: str
) -> None:
    before = run(runner, "--redis-url", redis_url, "--deployment", deployment, "status", "--json")
    after = run(runner, "status", "--json", "--redis-url", redis_url, "--deployment", deployment)
    env = run(
        runner,
        "status",
        "--json",
        env={"REDISBAL_REDIS_URL": redis_url, "REDISBAL_DEPLOYMENT": deployment},
    )
    # the command line wins over the environment
    both = run(
        runner,
        "status",
        "--json",
        "--deployment",
        deployment,
        env={"REDISBAL_REDIS_URL": redis_url, "REDISBAL_DEPLOYMENT": "other"},
    )
    for res in (before, after, env, both):
        assert res.exit_code == 0, res.output
        st = orjson.loads(res.output)
        assert st["deployment"] == deployment
        assert st["snapshot"] is None and st["engines"] == []


def _two_engines(redis_url: str, deployment: str, r: redis.Redis) -> list[Reporter]:
    keys = DeploymentKeys(deployment)
    r.hset(keys.config, mapping={"join_grace_ms": "0"})
    reps = [Reporter(redis_url, deployment, engines=e, heartbeat=False) for e in ("0", "1")]
    for rep in reps:
        rep.register(wait=True)  # the first snapshot waits for both
    reps[0].report(Counts(step=1, waiting=3, running=7, kv_usage=0.25), wait=True)
    res = reps[1].report(Counts(step=1, waiting=5, running=2), wait=True)
    assert res.version >= 1  # the barrier completed: a snapshot exists
    return reps


def test_status_table_shows_each_engine(
    runner: CliRunner, redis_url: str, deployment: str, r: redis.Redis
) -> None:
    reps = _two_engines(redis_url, deployment, r)
    try:
        res = run(runner, "status", "--redis-url", redis_url, "--deployment", deployment)
    finally:
        for rep in reps:
            rep.close()
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert lines[0].startswith(f"deployment {deployment}  epoch ")
    assert "snapshot v1 wave 0 step 1" in lines[0] and "forced no" in lines[0]
    assert "stale 0" in lines[1] and "expired 0" in lines[1]
    rows = {ln.split()[0]: ln.split() for ln in lines if ln[:2] in ("0 ", "1 ")}
    # engine, waiting, running, kv, room, step, age, progress, state, stale
    assert lines[3].split() == [
        "engine", "waiting", "running", "kv", "room", "step", "age", "progress", "state", "stale"
    ]  # fmt: skip
    # 0: 7 running hold a quarter of its KV cache, room for 21 like them, 3 queued
    assert rows["0"][1:6] == ["3", "7", "0.25", "18.0", "0:1"]
    assert rows["1"][1:6] == ["5", "2", "-", "-", "0:1"]  # no KV usage: room unknown
    assert rows["0"][8] == rows["1"][8] == "live"


def test_status_room_counts_a_declared_cap(
    runner: CliRunner, redis_url: str, deployment: str, r: redis.Redis
) -> None:
    """An engine that declared its running cap: its room is the fewer of its free slots
    and its KV room, less its queue, as routers read it."""
    r.hset(DeploymentKeys(deployment).config, mapping={"join_grace_ms": "0"})
    rep = Reporter(redis_url, deployment, engines=["0", "1"], heartbeat=False, running_cap=8)
    try:
        rep.register(wait=True)
        rep.report(Counts(step=1, waiting=3, running=7, kv_usage=0.25), engine="0", wait=True)
        rep.report(Counts(step=1, waiting=0, running=2), engine="1", wait=True)
        res = run(runner, "status", "--json", "--redis-url", redis_url, "--deployment", deployment)
    finally:
        rep.close()
    assert res.exit_code == 0, res.output
    by_id = {e["engine"]: e for e in orjson.loads(res.output)["engines"]}
    # 0: 8 slots less 7 running and 3 queued (its KV room, 18, is the larger); 1: 6 free
    assert (by_id["0"]["cap"], by_id["0"]["kv_room"]) == (8, -2.0)
    assert (by_id["1"]["cap"], by_id["1"]["kv_room"]) == (8, 6.0)


def test_status_json_and_gone_engines(
    runner: CliRunner, redis_url: str, deployment: str, r: redis.Redis
) -> None:
    reps = _two_engines(redis_url, deployment, r)
    reps[1].close()  # graceful leave: republished without it
    # a new process behind the published step (1) starts a new step sequence: live at
    # once; one that only registered waits
    late = Reporter(redis_url, deployment, engines="late", heartbeat=False)
    assert late.report(Counts(step=0, waiting=1, running=1), wait=True).accepted
    quiet = Reporter(redis_url, deployment, engines="quiet", heartbeat=False)
    quiet.register(wait=True)
    try:
        res = run(runner, "status", "--json", "--redis-url", redis_url, "--deployment", deployment)
    finally:
        for rep in (reps[0], late, quiet):
            rep.close()
    assert res.exit_code == 0, res.output
    st = orjson.loads(res.output)
    assert st["snapshot"]["version"] >= 2 and st["snapshot"]["forced"] is False
    assert st["counters"]["left"] == 1
    by_id = {e["engine"]: e for e in st["engines"]}
    assert by_id["0"]["state"] == "live"
    assert (by_id["0"]["waiting"], by_id["0"]["running"], by_id["0"]["kv"]) == (3, 7, 0.25)
    assert 0 <= by_id["0"]["age_ms"] < 60_000
    assert by_id["1"]["state"] == "left" and by_id["1"]["age_ms"] is None
    assert by_id["1"]["incarnation"] == reps[1].incarnation
    assert by_id["late"]["state"] == "live" and by_id["late"]["incarnation"] == late.incarnation
    assert by_id["late"]["source"] == "report" and by_id["late"]["step"] == 0
    assert by_id["quiet"]["state"] == "registered" and by_id["quiet"]["waiting"] is None


def test_coordinator_duration_run_configures_and_releases(
    runner: CliRunner, redis_url: str, deployment: str, r: redis.Redis
) -> None:
    keys = DeploymentKeys(deployment)
    res = run(
        runner,
        "coordinator",
        "--redis-url",
        redis_url,
        "--deployment",
        deployment,
        "--duration",
        "0.6",
        "--stall-ms",
        "50",
        "--expect",
        "a,b",
        "--id",
        "coord-test",
    )
    assert res.exit_code == 0, res.output
    assert "coordinator coord-test stopped" in res.output
    config = {k.decode(): v.decode() for k, v in r.hgetall(keys.config).items()}
    assert config["stall_ms"] == "50" and config["expected"] == "a,b"
    members = {m.decode() for m in r.zrange(keys.members, 0, -1)}
    assert members == {"a", "b"}  # registered: the first snapshot waits for them
    # the lease was given up: a standby would not have to wait for the TTL
    until = int(config.get("lease_until_ms") or 0)
    sec, usec = r.time()
    assert config.get("lease_owner") in (None, "") or until <= sec * 1000 + usec // 1000


def test_api_without_engines_fails_clearly(
    runner: CliRunner, redis_url: str, deployment: str
) -> None:
    res = run(
        runner,
        "api",
        "--redis-url",
        redis_url,
        "--deployment",
        deployment,
        "--burst",
        "4",
        "--wait-engines",
        "0.3",
    )
    assert res.exit_code == 1
    assert f"no snapshot for deployment {deployment!r}" in res.output


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_coordinator_signal_releases_the_lease_and_exits_0(
    redis_url: str, deployment: str, r: redis.Redis, sig: signal.Signals
) -> None:
    keys = DeploymentKeys(deployment)
    proc = subprocess.Popen(
        [sys.executable, "-m", "redisbal", "coordinator", "--id", "sig-test"],
        env=_cli_env(redis_url, deployment),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:

        def leading() -> bool:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            return r.hget(keys.config, "lease_owner") == b"sig-test"

        wait_until(leading, 30, "the coordinator to take the lease")
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out
    assert "released the lease" in out and "coordinator sig-test stopped" in out
    assert r.hget(keys.config, "lease_until_ms") == b"0"


def _cli_env(redis_url: str, deployment: str) -> dict[str, str]:
    return scrubbed_env({"REDISBAL_REDIS_URL": redis_url, "REDISBAL_DEPLOYMENT": deployment})


def test_engine_sim_tick_mode_serves_two_routers_of_one_api_process(
    redis_url: str, deployment: str, r: redis.Redis, tmp_path: Path
) -> None:
    """The two process roles on their own: independent (tick) engines, and one api
    process with two routers (indexes 1 and 2 of 3) under Poisson load."""
    env = _cli_env(redis_url, deployment)
    r.hset(DeploymentKeys(deployment).config, mapping={"tick_ms": "10", "join_grace_ms": "0"})
    engines_json, api_json = tmp_path / "engines.json", tmp_path / "api.json"
    sim = subprocess.Popen(
        [sys.executable, "-m", "redisbal", "engine-sim", "-n", "2", "--id-prefix", "e",
         "--mode", "tick", "--running-cap", "4", "--stats-out", str(engines_json)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        api = subprocess.run(
            [sys.executable, "-m", "redisbal", "api", "--client-index", "1", "--routers", "2",
             "--client-count", "3", "--rate", "60", "--duration", "1", "--mean-output", "5",
             "--seed", "7", "--stats-out", str(api_json)],
            env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert api.returncode == 0, api.stdout + api.stderr
        assert "api 1-2: t=" in api.stdout  # progress lines
        sim.send_signal(signal.SIGTERM)
        out, _ = sim.communicate(timeout=30)
    finally:
        if sim.poll() is None:
            sim.kill()
            sim.wait()
    assert sim.returncode == 0, out
    routers = orjson.loads(api_json.read_bytes())
    assert [x["client_index"] for x in routers] == [1, 2]
    assert all(x["sent"] > 0 and x["completed"] == x["sent"] for x in routers)
    assert all(x["unfinished"] == 0 and x["snapshots"] > 0 for x in routers)
    stats = orjson.loads(engines_json.read_bytes())
    assert stats["mode"] == "tick" and [e["engine"] for e in stats["engines"]] == ["e0", "e1"]
    sent = sum(x["sent"] for x in routers)
    assert sum(e["assigned"] for e in stats["engines"]) == sent
    assert sum(e["served"] for e in stats["engines"]) == sent
    for e in stats["engines"]:  # what the routers say they sent is what each engine got
        assert e["assigned"] == sum(x["routed"].get(e["engine"], 0) for x in routers)
    # the engines left gracefully on SIGTERM
    assert r.zcard(DeploymentKeys(deployment).members) == 0


def test_status_watch_refreshes_until_ctrl_c(redis_url: str, deployment: str) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "redisbal", "status", "--watch", "0.2"],
        env=_cli_env(redis_url, deployment),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    header = f"deployment {deployment}  epoch"
    try:
        # Ctrl-C once it has refreshed twice (a loaded machine may take seconds to start it)
        wait_until(lambda: "".join(lines).count(header) >= 2, 30, "two refreshes")
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
        reader.join(10)
        assert proc.stderr is not None
        out, err = "".join(lines), proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    # refreshed (in place on a terminal; appended when stdout is a pipe, as here)
    assert out.count(f"deployment {deployment}  epoch") >= 2
    assert out.count("(Ctrl-C to stop)") >= 2


def test_load_functions(runner: CliRunner, redis_url: str, r: redis.Redis) -> None:
    """Redis 7: the library is loaded and named; 6.2: a clear refusal, exit 1."""
    from redisbal.barrier.operations import library

    res = run(runner, "--redis-url", redis_url, "load-functions")
    major = int(str(r.info("server")["redis_version"]).split(".")[0])
    if major < 7:
        assert res.exit_code == 1
        assert "no functions" in res.output and "EVALSHA" in res.output
        return
    assert res.exit_code == 0, res.output
    name = library()[0]
    assert f"loaded {name}" in res.output
    assert [x[1] for x in r.function_list(library=name)] == [name.encode()]
    again = run(runner, "--redis-url", redis_url, "load-functions")  # idempotent
    assert again.exit_code == 0, again.output


def test_a_signal_landing_while_the_stop_event_is_locked_still_stops() -> None:
    """The coordinator's loop waits on a threading.Event; a SIGTERM handled while the main
    thread holds that event's lock (inside Event.wait) must not call Event.set there: the
    lock is not reentrant, and the process hung (seen once in CI: no exit in 30 s)."""
    code = textwrap.dedent(
        """
        import os, signal, threading
        from redisbal.ops.cli_options import signals_stop
        ev = threading.Event()
        with signals_stop(ev.set):
            with ev._cond:  # where Event.wait holds it
                os.kill(os.getpid(), signal.SIGTERM)
                for _ in range(1000):  # bytecodes: the handler runs here, in this thread
                    pass
            assert ev.wait(5), "not stopped"
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20)
    assert out.returncode == 0, out.stderr
