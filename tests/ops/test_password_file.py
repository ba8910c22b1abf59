"""``--redis-password-file`` (``REDISBAL_REDIS_PASSWORD_FILE``): the Redis password
from a file (a mounted secret) merged into the URL, on every command that takes
``--redis-url``; against a real redis-server that requires a password. The password
never shows in any output."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.cli import run_cli
from support.gateway_stack import FAST, MODEL, gateway_process, openai_client

from redisbal.connection import BadRedisURL, parse_url, with_password
from redisbal.sim.embedded import RedisServer
from redisbal.sim.http_engine import HttpEngine

SECRET = "Pw9/file@secret:%x"  # characters a URL must percent-encode


@pytest.fixture(scope="module")
def secured() -> Iterator[RedisServer]:
    """A TCP server that requires SECRET from its start."""
    with RedisServer(tcp=True, password=SECRET) as server:
        yield server


def _error_lines(out: subprocess.CompletedProcess[str]) -> list[str]:
    assert SECRET not in out.stdout + out.stderr and "Traceback" not in out.stderr
    return [x for x in out.stderr.splitlines() if x.startswith("Error:")]


@pytest.fixture
def pw_file(tmp_path: Path) -> Path:
    f = tmp_path / "redis-password"
    f.write_text(SECRET + "\n")  # as `echo` and most secret stores write it
    return f


def test_the_file_gives_the_password_after_the_command_before_it_or_from_the_env(
    secured: RedisServer, pw_file: Path
) -> None:
    url = secured.url
    assert _error_lines(run_cli("status", "--redis-url", url)) == [
        f"Error: the server requires a password: redis://:PASSWORD@127.0.0.1:{secured.port}/0 "
        "(percent-encode / @ : in it)"
    ]
    for out in (
        run_cli("status", "--redis-url", url, "--redis-password-file", str(pw_file)),
        run_cli("--redis-password-file", str(pw_file), "status", "--redis-url", url),
        run_cli("status", env={"REDISBAL_REDIS_URL": url,
                            "REDISBAL_REDIS_PASSWORD_FILE": str(pw_file)}),
        run_cli("coordinator", "--redis-url", url, "--redis-password-file", str(pw_file),
             "--duration", "0.5"),
    ):  # fmt: skip
        assert out.returncode == 0, out.stderr
        assert _error_lines(out) == []


def test_a_wrong_password_in_the_file_is_refused_without_showing_it(
    secured: RedisServer, tmp_path: Path
) -> None:
    wrong = tmp_path / "wrong"
    wrong.write_text("wrong-" + SECRET)
    out = run_cli("status", "--redis-url", secured.url, "--redis-password-file", str(wrong))
    assert out.returncode == 2
    assert "wrong-" not in out.stderr
    [line] = _error_lines(out)
    assert line.startswith(f"Error: the server at redis://:***@127.0.0.1:{secured.port}/0 refused")


@pytest.mark.parametrize(
    ("content", "said"),
    [
        (None, "No such file or directory"),
        ("", "is empty"),
        ("\n", "is empty"),
        ("a\nb\n", "a password file holds one line"),
    ],
)
def test_a_missing_or_empty_file_is_a_one_line_usage_error(
    tmp_path: Path, content: str | None, said: str
) -> None:
    f = tmp_path / "pw"
    if content is not None:
        f.write_text(content)
    out = run_cli("status", "--redis-url", "redis://127.0.0.1:1/0", "--redis-password-file", str(f))
    assert out.returncode == 2, out.stderr
    [line] = _error_lines(out)
    assert line.startswith("Error: Invalid value for '--redis-password-file': ") and said in line
    assert "a\nb" not in out.stderr


def test_a_url_with_a_password_and_a_file_is_a_usage_error(pw_file: Path) -> None:
    out = run_cli(
        "status", "--redis-url", "redis://:other@127.0.0.1:1/0",
        "--redis-password-file", str(pw_file),
    )  # fmt: skip
    assert out.returncode == 2
    assert _error_lines(out) == [
        "Error: --redis-password-file: 'redis://:***@127.0.0.1:1/0' has a password already: "
        "give it in the URL or in a file, not both"
    ]


@pytest.mark.parametrize(
    ("url", "user"),
    [
        ("redis://h:6379/0", None),
        ("redis://app@h:6379/0", "app"),
        ("redis://app:@h:6379/0", "app"),
        ("rediss://h:6380/0?ssl_cert_reqs=none", None),
        ("unix:///run/redis.sock?db=0", None),
        ("redis+sentinel://h:1,h:2/svc?sentinel_password=s", None),
        ("redis+cluster://app@h:7000,h:7001", "app"),
    ],
)
def test_with_password_puts_it_in_every_kind_of_url(url: str, user: str | None) -> None:
    merged = with_password(url, SECRET)
    t = parse_url(merged)
    assert t.password == SECRET and t.username == user
    assert SECRET not in merged  # percent-encoded
    with pytest.raises(BadRedisURL, match="has a password already"):
        with_password(merged, "x")


async def test_the_gateway_serves_with_the_password_from_the_file(
    secured: RedisServer, pw_file: Path, deployment: str
) -> None:
    """The gateway's routers and URL reads (its own clients) use it: an engine that
    registered in the secured Redis is routed to through a gateway given only the file."""
    engine = HttpEngine(
        "0", redis_url=with_password(secured.url, SECRET), deployment=deployment, port=0,
        params=FAST,
    )  # fmt: skip
    await engine.start()
    try:
        async with gateway_process(
            None, None, "--redis-url", secured.url, "--redis-password-file", str(pw_file),
            "--deployment", deployment,
        ) as (g, url, lines):  # fmt: skip
            assert "1 engines with URLs" in lines[-1], lines
            client = openai_client(url)
            try:
                c = await client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
                assert c.choices[0].text
            finally:
                await client.close()
            assert engine.arrived == 1
            g.terminate()
            code = g.wait(30)
            rest = g.stderr.read() if g.stderr else ""
    finally:
        await engine.stop()
    assert code == 0
    assert SECRET not in "".join(lines) + rest
