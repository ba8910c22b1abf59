"""``redisbal gateway`` exposed, as a process: at a 1,024 open-file limit, silent
connections past it while requests are served; SIGTERM with a slow upload in flight
exits 0 after --drain-s; the warning when bound beyond loopback without a key; keys
from a file, bad key files as one-line usage errors."""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import signal
import time
from typing import Any

import pytest
from support.cli import run_cli
from support.gateway_stack import MODEL, gateway_process, openai_client, settled, stack
from support.helpers import await_until
from support.prometheus import scrape, val

pytestmark = [pytest.mark.slow, pytest.mark.gateway]

KEY = "sk-file-key-42"


def _nofile_1024() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))


async def test_1100_silent_connections_at_a_1024_fd_limit_requests_still_served(
    redis_url: str, deployment: str, tmp_path: Any
) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 2400:
        import pytest

        pytest.skip("the test itself needs 1,100 sockets and more")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2400), hard))
    keys = tmp_path / "keys"
    keys.write_text(f"# the clients' keys\n{KEY}\n")
    async with stack(redis_url, deployment, n=2) as st:
        async with gateway_process(
            redis_url, deployment, "--api-key-file", str(keys), "--header-timeout-s", "600",
            "--keepalive-timeout-s", "600", preexec=_nofile_1024,
        ) as (g, base, lines):  # fmt: skip
            assert "open-file limit 1024, at most 480 client connections" in lines[-1], lines
            port = int(base.rsplit(":", 1)[1])
            silent = []
            try:
                for _ in range(1100):
                    silent.append(await asyncio.open_connection("127.0.0.1", port))
                await asyncio.sleep(0.5)  # (the gateway accepts them meanwhile)
                c = openai_client(base, KEY)
                try:
                    for _ in range(20):
                        got = await c.completions.create(model=MODEL, prompt="a", max_tokens=2)
                        assert got.choices
                finally:
                    await c.close()
                fds = len(os.listdir(f"/proc/{g.pid}/fd"))
                assert g.poll() is None and fds < 1024, fds
            finally:
                for _, w in silent:
                    w.close()
            assert g.stderr is not None
            g.send_signal(signal.SIGTERM)
            rc = await asyncio.to_thread(g.wait, 60)
            err = g.stderr.read()
            assert rc == 0 and "Too many open files" not in err, err
        await settled(st)


async def test_sigterm_with_a_slow_upload_exits_zero_after_drain_s(
    redis_url: str, deployment: str
) -> None:
    async with stack(redis_url, deployment, n=1) as st:
        async with gateway_process(
            redis_url, deployment, "--drain-s", "2", "--body-timeout-s", "600"
        ) as (g, base, _):
            port = int(base.rsplit(":", 1)[1])
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                b'\r\nContent-Length: 1000\r\n\r\n{"prompt": '
            )
            await writer.drain()
            await await_until(  # the request is in the gateway's hands (its gauge says so)
                lambda: val(scrape(f"{base}/metrics"), "redisbal_gateway_inflight") == 1,
                threaded=True, what="the slow upload in flight",
            )  # fmt: skip
            t0 = time.monotonic()
            g.send_signal(signal.SIGTERM)
            assert g.stderr is not None
            line = await asyncio.to_thread(g.stderr.readline)
            assert "draining 1 in-flight" in line, line

            async def upload() -> None:  # goes on, slowly, during the drain and after it
                with contextlib.suppress(ConnectionError):
                    while True:
                        writer.write(b" ")
                        await asyncio.sleep(0.2)

            slow = asyncio.ensure_future(upload())
            rc = await asyncio.to_thread(g.wait, 60)  # not 2 s + aiohttp's own 60 s
            took = time.monotonic() - t0
            slow.cancel()
            err = g.stderr.read()
            assert rc == 0, err
            assert "1 requests still in flight after --drain-s 2s" in err, err
            print(f"SIGTERM with a slow upload, --drain-s 2: exit {rc} after {took:.2f}s")
            writer.close()
        await settled(st)


async def test_warns_when_open_beyond_loopback_and_bad_key_files(
    redis_url: str, deployment: str, tmp_path: Any
) -> None:
    async with gateway_process(redis_url, deployment, "--host", "0.0.0.0") as (g, _, _):
        assert g.stderr is not None
        line = await asyncio.to_thread(g.stderr.readline)
        assert "without an API key" in line, line
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY}\n")
    async with gateway_process(
        redis_url, deployment, "--host", "0.0.0.0", "--api-key-file", str(keys)
    ) as (g, _, _):
        g.send_signal(signal.SIGTERM)
        assert g.stderr is not None
        rest = await asyncio.to_thread(g.stderr.read)
        assert "without an API key" not in rest and KEY not in rest, rest
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n")
    for path, says in ((tmp_path / "missing", "No such file"), (empty, "holds no key")):
        out = run_cli("gateway", "--api-key-file", str(path), env={"REDISBAL_REDIS_URL": redis_url})
        assert out.returncode == 2 and says in out.stderr, out.stderr
        assert "Traceback" not in out.stderr
