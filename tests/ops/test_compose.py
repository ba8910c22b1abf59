"""docker-compose.yml and the Dockerfile, checked without Docker (none on this machine).

Every redisbal service's command is parsed by the real CLI (click), with the
service's environment, so an option that was renamed or removed, a bad value or
a missing subcommand fails here; ``redisbal <cmd> --help`` must succeed and list
every option the service uses. The ``tests`` service points REDISBAL_REDIS_URL at
the compose Redis: the suite is shown to honour it by running part of it against
an external server through that variable.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any

import click
import pytest
import yaml
from support.cli import REDISBAL, scrub_environ, scrubbed_env
from support.helpers import wait_until
from support.procs import free_port_block

from redisbal.connection import parse_url
from redisbal.sim.embedded import RedisServer

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
REQUIRED = {"redis", "coordinator", "engines", "api", "tests"}


def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(COMPOSE.read_text(encoding="utf-8"))
    return data


def services() -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = compose()["services"]
    return out


def interpolate(value: object, env: dict[str, str] | None = None) -> str:
    """A value as compose passes it: ``${VAR:-default}`` and ``${VAR}`` from the
    environment of ``docker compose`` (here: ``env``, none by default)."""
    env = env or {}

    def one(m: re.Match[str]) -> str:
        return env.get(m.group(1)) or (m.group(2) or "")

    return re.sub(r"\$\{(\w+)(?::-([^}]*))?\}", one, str(value))


def service_env(svc: dict[str, Any]) -> dict[str, str]:
    return {k: interpolate(v) for k, v in (svc.get("environment") or {}).items()}


def command(svc: dict[str, Any]) -> list[str]:
    cmd = svc.get("command", [])
    return shlex.split(cmd) if isinstance(cmd, str) else [str(c) for c in cmd]


def redisbal_services() -> list[str]:
    return sorted(n for n, s in services().items() if command(s)[:1] == ["redisbal"])


def split_command(cli: click.Group, argv: list[str]) -> tuple[list[str], str, list[str]]:
    """redisbal [group options] <subcommand> [options] -> (group args, name, args)."""
    takes_value = {
        opt for p in cli.params if isinstance(p, click.Option) and not p.is_flag for opt in p.opts
    }
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok in cli.list_commands(click.Context(cli)):
            return argv[:i], tok, argv[i + 1 :]
        if not tok.startswith("-"):
            raise AssertionError(f"{tok!r} is not a redisbal command")
        i += 1 if ("=" in tok or tok not in takes_value) else 2
    raise AssertionError(f"no subcommand in {argv}")


def test_compose_has_every_service_and_they_share_one_redis_url() -> None:
    svcs = services()
    assert set(svcs) >= REQUIRED, sorted(REQUIRED - set(svcs))
    assert {"coordinator", "engines", "api"} <= set(redisbal_services())
    for name in ("coordinator", "engines", "api", "tests"):
        env = svcs[name].get("environment", {})
        assert env.get("REDISBAL_REDIS_URL") == "redis://redis:6379/0", name
        assert parse_url(env["REDISBAL_REDIS_URL"]).kind == "single"
        assert "redis" in svcs[name].get("depends_on", {}), f"{name} must wait for redis"
    redis_cmd = command(svcs["redis"])
    assert redis_cmd[0] == "redis-server" and "--save" in redis_cmd
    assert "healthcheck" in svcs["redis"]


@pytest.mark.parametrize("name", [*sorted(REQUIRED - {"redis", "tests"}), "status"])
def test_service_command_is_a_real_cli_invocation(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The command parses with the real click CLI (options exist, values are valid),
    under the service's own environment."""
    from redisbal.ops.cli import cli

    svc = services()[name]
    argv = command(svc)
    assert argv[0] == "redisbal", argv
    scrub_environ(monkeypatch)
    for k, v in service_env(svc).items():
        monkeypatch.setenv(k, v)
    group_args, sub, args = split_command(cli, argv[1:])
    ctx = cli.make_context("redisbal", [*group_args, sub])
    cmd = cli.get_command(ctx, sub)
    assert cmd is not None, sub
    assert "unavailable" not in (cmd.callback.__name__ if cmd.callback else ""), (
        f"redisbal {sub} is not available: {cmd.help}"
    )
    sub_ctx = cmd.make_context(sub, list(args), parent=ctx)  # raises on unknown/bad options
    known = {o for p in cmd.params for o in getattr(p, "opts", [])}
    used = {a.split("=")[0] for a in args if a.startswith("-")}
    assert used <= known, f"{name}: unknown options {sorted(used - known)}"
    assert sub_ctx.params is not None


@pytest.mark.slow
def test_every_service_command_has_working_help_listing_its_options() -> None:
    """`redisbal <cmd> --help` succeeds (the installed entry point) and lists every
    option the compose file passes to it."""
    from redisbal.ops.cli import cli

    for name in redisbal_services():
        _, sub, args = split_command(cli, command(services()[name])[1:])
        out = subprocess.run([REDISBAL, sub, "--help"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, f"redisbal {sub} --help: {out.stderr}"
        for opt in (a.split("=")[0] for a in args if a.startswith("--")):
            assert re.search(rf"(^|[\s,]){re.escape(opt)}\b", out.stdout), f"{name}: {opt}"


def test_compose_wiring_is_consistent() -> None:
    """Engines the coordinator expects = engines started; metrics reachable from the host."""
    svcs = services()
    coord, engines = command(svcs["coordinator"]), command(svcs["engines"])
    n_engines = int(engines[engines.index("--engines") + 1])
    expect = coord[coord.index("--expect") + 1]
    assert expect == str(n_engines)
    port = coord[coord.index("--metrics-port") + 1]
    assert coord[coord.index("--metrics-addr") + 1] == "0.0.0.0"
    assert any(str(p).endswith(f":{port}") for p in svcs["coordinator"].get("ports", []))
    api = command(svcs["api"])
    assert int(api[api.index("--client-count") + 1]) >= int(api[api.index("--routers") + 1])


def test_the_gateways_require_a_key_from_the_environment_with_a_marked_placeholder() -> None:
    """Bound to 0.0.0.0 in their containers, the gateways never serve without a key:
    REDISBAL_GATEWAY_API_KEY when set, else a placeholder that says to change it."""
    for name in ("gateway-a", "gateway-b"):
        svc = services()[name]
        assert "0.0.0.0" in command(svc)
        raw = svc["environment"]["REDISBAL_API_KEY"]
        assert raw == "${REDISBAL_GATEWAY_API_KEY:-sk-redisbal-CHANGE-ME}", raw
        assert service_env(svc)["REDISBAL_API_KEY"] == "sk-redisbal-CHANGE-ME"
        set_key = {"REDISBAL_GATEWAY_API_KEY": "k-42"}
        assert interpolate(raw, set_key) == "k-42"
    header = COMPOSE.read_text(encoding="utf-8").split("\nname:")[0]
    assert 'curl -s localhost:8310/v1/models -H "Authorization: Bearer $KEY"' in header
    assert "REDISBAL_GATEWAY_API_KEY" in header and "CHANGE-ME" in header


def test_tests_service_runs_the_suite_and_the_dockerfile_can_build_it() -> None:
    svc = services()["tests"]
    assert command(svc)[:1] == ["pytest"] and "tests" in command(svc)
    assert svc.get("build", {}).get("target") == "test"
    docker = DOCKERFILE.read_text(encoding="utf-8")
    stages = re.findall(r"^FROM\s+\S+(?:\s+AS\s+(\S+))?", docker, re.M | re.I)
    assert "runtime" in stages and "test" in stages, stages
    assert ".[metrics,gateway,tracing]" in docker and ".[dev]" in docker
    for path in re.findall(r"^COPY\s+(\S+)\s", docker, re.M):
        assert (ROOT / path).exists(), f"Dockerfile copies missing {path}"
    for name in redisbal_services():
        assert services()[name].get("build", {}).get("target", "runtime") in stages
    ignored = (ROOT / ".dockerignore").read_text(encoding="utf-8").split()
    assert ".git" in ignored


@pytest.mark.slow
def test_conftest_honours_redisbal_redis_url() -> None:
    """What the compose `tests` service relies on: with REDISBAL_REDIS_URL set the
    integration tests run against that server (test ids say [external]) and pass."""
    conftest = (ROOT / "tests" / "conftest.py").read_text(encoding="utf-8")
    assert "REDISBAL_REDIS_URL" in conftest
    with RedisServer(tcp=True) as server:
        env = scrubbed_env(
            {"REDISBAL_REDIS_URL": server.url}
        )  # redis://127.0.0.1:<port>/0, as in compose
        out = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA",
             "tests/ops/test_metrics.py", "-k", "exporter_over_http or router_metrics"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        passed = re.findall(r"^PASSED (\S+)", out.stdout, re.M)
        assert passed and all("[external]" in t for t in passed), out.stdout[-2000:]
        # and they really used that server: their deployments' keys are there
        with server.client() as c:
            assert any(k.startswith(b"redisbal:{") for k in c.keys("redisbal:*"))


HTTP_PATH = ("coordinator-http", "http-engines", "gateway-a", "gateway-b")


def _local(argv: list[str], ports: dict[str, str]) -> list[str]:
    """A service's command for this host: compose's host names and ports swapped for
    local ones (the ports the compose file uses may be taken here)."""
    out = []
    for tok in argv:
        tok = {"0.0.0.0": "127.0.0.1", "http-engines": "127.0.0.1"}.get(tok, tok)
        out.append(ports.get(tok, tok))
    if out[0] == "redisbal":
        out[0] = REDISBAL
    return out


@pytest.mark.slow
def test_http_path_services_run_as_processes_and_answer_an_openai_request() -> None:
    """The compose file's HTTP path (coordinator, 4 HTTP engines, 2 gateways), each
    service's own command and environment run as a process against a local Redis;
    an OpenAI client request with the gateways' key goes through each gateway, one
    with another key gets a 401."""
    import openai

    svcs = services()
    for name in HTTP_PATH:
        assert name in svcs, name
        assert "healthcheck" in svcs[name] or name == "coordinator-http", name
    for name in ("gateway-a", "gateway-b"):
        port = command(svcs[name])[command(svcs[name]).index("--port") + 1]
        assert svcs[name]["ports"] == [f"127.0.0.1:{port}:{port}"]
        assert "http-engines" in svcs[name]["depends_on"]
    eng = command(svcs["http-engines"])
    n = int(eng[eng.index("--engines") + 1])
    coord = command(svcs["coordinator-http"])
    assert coord[coord.index("--expect") + 1] == str(n) == "4"
    base = eng[eng.index("--http-port") + 1]
    base = free_port_block(n + 2)  # the engines' ports, then the gateways'
    free = list(range(base, base + n + 2))
    ports = {base: str(free[0])}
    for name, p in zip(("gateway-a", "gateway-b"), free[n:], strict=True):
        argv = command(svcs[name])
        ports[argv[argv.index("--port") + 1]] = str(p)
    procs: list[subprocess.Popen[str]] = []
    with RedisServer(tcp=True) as server:
        try:
            for name in HTTP_PATH:
                env = scrubbed_env(service_env(svcs[name]))
                env["REDISBAL_REDIS_URL"] = server.url
                procs.append(subprocess.Popen(
                    _local(command(svcs[name]), ports), env=env, text=True,
                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                ))  # fmt: skip
            for name in ("gateway-a", "gateway-b"):
                argv = command(svcs[name])
                url = f"http://127.0.0.1:{ports[argv[argv.index('--port') + 1]]}"
                wait_until(partial(_answers_200, url + "/health"), 30, f"{url} ready", 0.2)
                key = service_env(svcs[name])["REDISBAL_API_KEY"]
                client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=2)
                c = client.completions.create(model="redisbal-sim", prompt="hi", max_tokens=3)
                assert c.usage is not None and 1 <= c.usage.completion_tokens <= 3
                client.close()
                keyless = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
                with pytest.raises(openai.AuthenticationError):  # a wrong key: 401
                    keyless.completions.create(model="redisbal-sim", prompt="hi", max_tokens=3)
                keyless.close()
        finally:
            for p in procs:
                p.terminate()
            codes = [p.wait(20) for p in procs]
            errs = [p.communicate()[1] for p in procs]  # (reads stderr to its end, closes it)
        assert codes == [0, 0, 0, 0], [e[-500:] for e in errs]


def _answers_200(url: str) -> bool:
    """GET ``url`` answers 200 (a refused connection raises: "not yet" to wait_until)."""
    import urllib.request

    with urllib.request.urlopen(url, timeout=2) as r:
        return bool(r.status == 200)
