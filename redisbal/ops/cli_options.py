"""What the ``redisbal`` commands share: the common options, settings, error handling.

Every command takes ``--redis-url`` (``REDISBAL_REDIS_URL``),
``--redis-password-file`` (``REDISBAL_REDIS_PASSWORD_FILE``, the password merged into
the URL, so it never needs to be on a command line), ``--deployment``
(``REDISBAL_DEPLOYMENT``) and ``--log-level`` (``REDISBAL_LOG_LEVEL``), either
before the command name or after it (``redisbal status --redis-url ...``, the
form docker-compose uses); a value given on the command line wins over the
environment, and one given after the command name wins over one before it.
Names and URLs are checked before anything connects; errors name the option
and never show a password. The operator CLI (``redisbal.ops.cli``) and the tooling
commands (``redisbal.sim.cli``, ``redisbal.bench.cli``) both build on
this module, so neither imports the other.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import math
import os
import signal
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import click
import orjson
import redis.exceptions
from click.core import ParameterSource
from redis.exceptions import RedisClusterException
from redis.sentinel import MasterNotFoundError

from redisbal.connection import (
    OUTAGE_ERRORS,
    BadRedisURL,
    explain,
    make_client,
    parse_url,
    redact,
    with_password,
)
from redisbal.errors import RedisbalError
from redisbal.keys import InvalidName, check_name
from redisbal.routing.policies import DEFAULT_POLICY, POLICIES

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")
LOG_LEVELS = ("debug", "info", "warning", "error")
_OPTS = "redisbal.options"
_PRIORITY = {
    ParameterSource.COMMANDLINE: 3,
    ParameterSource.ENVIRONMENT: 2,
    ParameterSource.DEFAULT_MAP: 1,
    ParameterSource.DEFAULT: 0,
}


class FiniteFloat(click.FloatRange):
    """click.FloatRange that also refuses nan and inf: nan compares false with both
    bounds, so FloatRange lets it through (and an engine stepping every nan ms hangs)."""

    name = "float"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        rv = super().convert(value, param, ctx)
        if not math.isfinite(rv):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return rv


def _from_env(ctx: click.Context, param: click.Parameter) -> str:
    src = ctx.get_parameter_source(param.name or "")
    if src is ParameterSource.ENVIRONMENT and param.envvar:
        return f" (from ${param.envvar})"
    return ""


def _remember(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    """Validate a shared option and keep the most explicit value seen (group or command)."""
    name = param.name or ""
    if name == "redis_url" and value is not None:
        try:
            parse_url(value)
        except BadRedisURL as exc:
            raise click.BadParameter(
                f"{exc}{_from_env(ctx, param)}", ctx=ctx, param=param
            ) from None
    elif name == "redis_password_file" and value is not None:
        value = _read_password(value, ctx, param)  # read once; only the password is kept
    elif name == "deployment":
        try:
            check_name(value, "deployment name")
        except InvalidName as exc:
            raise click.BadParameter(
                f"{exc}{_from_env(ctx, param)}", ctx=ctx, param=param
            ) from None
    store = ctx.meta.setdefault(_OPTS, {})  # ctx.meta is shared by the group and its commands
    prio = _PRIORITY.get(ctx.get_parameter_source(name), 0)  # type: ignore[arg-type]
    if name not in store or prio >= store[name][1]:
        store[name] = (value, prio)
    return value


def _read_password(path: str, ctx: click.Context, param: click.Parameter) -> str:
    """The file's text less one trailing newline; a one-line usage error (never its
    content) when it cannot be read or is empty."""
    where = _from_env(ctx, param)
    try:
        with open(path, encoding="utf-8", newline="") as fh:
            text = fh.read()
    except OSError as exc:
        raise click.BadParameter(
            f"{path}{where}: {exc.strerror or exc}", ctx=ctx, param=param
        ) from None
    except UnicodeDecodeError:
        raise click.BadParameter(f"{path}{where}: not UTF-8 text", ctx=ctx, param=param) from None
    password = text[:-2] if text.endswith("\r\n") else text.removesuffix("\n")
    if not password:
        raise click.BadParameter(f"{path}{where} is empty", ctx=ctx, param=param)
    if "\n" in password or "\r" in password:
        raise click.BadParameter(
            f"{path}{where}: a password file holds one line", ctx=ctx, param=param
        )
    return password


_SHARED = (
    click.option(
        "--redis-url",
        envvar="REDISBAL_REDIS_URL",
        metavar="URL",
        expose_value=False,
        callback=_remember,
        help="Redis to use: redis://, rediss://, unix://, redis+sentinel://h:p[,h:p]/service "
        "or redis+cluster://h:p[,h:p]. [env: REDISBAL_REDIS_URL]",
    ),
    click.option(
        "--redis-password-file",
        envvar="REDISBAL_REDIS_PASSWORD_FILE",
        metavar="PATH",
        expose_value=False,
        callback=_remember,
        help="Read the Redis password from this file (one trailing newline dropped) and "
        "use it with --redis-url, which then has none. [env: REDISBAL_REDIS_PASSWORD_FILE]",
    ),
    click.option(
        "--deployment",
        envvar="REDISBAL_DEPLOYMENT",
        default="default",
        show_default=True,
        expose_value=False,
        callback=_remember,
        help="Deployment name (all its keys share the hash tag {<deployment>}). "
        "[env: REDISBAL_DEPLOYMENT]",
    ),
    click.option(
        "--log-level",
        envvar="REDISBAL_LOG_LEVEL",
        type=click.Choice(LOG_LEVELS, case_sensitive=False),
        default="info",
        show_default=True,
        expose_value=False,
        callback=_remember,
        help="Logging level (logs go to stderr). [env: REDISBAL_LOG_LEVEL]",
    ),
)


def common_options(f: F) -> F:
    """Add --redis-url / --redis-password-file / --deployment / --log-level to a command
    (read them with settings())."""
    for opt in reversed(_SHARED):
        f = opt(f)
    return f


@dataclass(frozen=True)
class Settings:
    """The shared options, resolved for the running command."""

    redis_url: str | None
    deployment: str
    log_level: str

    def require_url(self) -> str:
        if not self.redis_url:
            raise click.UsageError(
                "no Redis URL: pass --redis-url (e.g. redis://localhost:6379/0) "
                "or set REDISBAL_REDIS_URL"
            )
        return self.redis_url

    @property
    def safe_url(self) -> str:
        return redact(self.redis_url or "")


def settings(ctx: click.Context | None = None) -> Settings:
    """Resolved shared options; also configures logging once."""
    ctx = ctx or click.get_current_context()
    store = ctx.meta.get(_OPTS, {})
    url = store.get("redis_url", (None, 0))[0]
    password = store.get("redis_password_file", (None, 0))[0]
    if url and password is not None:
        try:
            url = with_password(url, password)
        except BadRedisURL as exc:  # its message has the URL redacted, never the password
            raise click.UsageError(f"--redis-password-file: {exc}", ctx) from None
    s = Settings(
        redis_url=url,
        deployment=store.get("deployment", ("default", 0))[0],
        log_level=str(store.get("log_level", ("info", 0))[0]).lower(),
    )
    if not ctx.meta.get("redisbal.logging"):
        ctx.meta["redisbal.logging"] = True
        logging.basicConfig(
            level=getattr(logging, s.log_level.upper()),
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
            stream=sys.stderr,
        )
    return s


class ConfigError(RedisbalError, click.ClickException):
    """A mistake in the configuration found by talking to Redis (not Redis there, not a
    cluster, a missing or refused password): one line and exit status 2, like a bad
    option, where an outage exits 1."""

    exit_code = 2


@contextlib.contextmanager
def redis_errors(url: str | None) -> Iterator[None]:
    """Turn a configuration mistake, a Redis outage or a refusal into one clear line
    (password redacted)."""
    try:
        yield
    except (BadRedisURL, OSError, redis.exceptions.RedisError, RedisClusterException) as exc:
        safe = redact(url or "")
        mistake = exc if isinstance(exc, BadRedisURL) else explain(exc, url or "")
        if mistake is not None:
            raise ConfigError(str(mistake)) from None  # its URL is redacted already
        if isinstance(exc, OSError) and exc.errno in _BIND_ERRNOS:  # a listening socket
            raise click.ClickException(f"cannot listen: {exc.strerror or exc}") from None
        if isinstance(exc, MasterNotFoundError):  # its message is a client's repr
            detail = f"no sentinel answered with a primary for {_service(url)}"
            raise click.ClickException(f"cannot reach Redis at {safe}: {detail}") from None
        if isinstance(exc, (*OUTAGE_ERRORS, RedisClusterException)):  # no node answered
            detail = redact(str(exc)) or type(exc).__name__
            raise click.ClickException(f"cannot reach Redis at {safe}: {detail}") from None
        if isinstance(exc, redis.exceptions.ResponseError):
            raise click.ClickException(f"Redis at {safe} refused: {redact(str(exc))}") from None
        detail = redact(str(exc)) or type(exc).__name__  # any other client error: one line
        raise click.ClickException(f"Redis at {safe}: {detail}") from None


# what binding a listening socket fails with (an HTTP engine's port in use): never an outage
_BIND_ERRNOS = (errno.EADDRINUSE, errno.EADDRNOTAVAIL)


def _service(url: str | None) -> str:
    try:
        t = parse_url(url or "")
    except BadRedisURL:
        return "the service"
    hosts = ",".join(f"{h}:{p}" for h, p in t.hosts)
    return f"service {t.service!r} (sentinels {hosts}: down, or not monitoring it?)"


def command_client(url: str, socket_timeout: float = 5.0) -> Any:
    """The blocking client of a command that talks to Redis a few times and exits
    (``status``, ``load-functions``, the reachability check): each try waits at most
    ``socket_timeout`` (2 s to connect; 5 s to answer: on a host loaded to 19, beside
    three vLLM servers, one of ``status``'s reads waited over 2 s on a Redis that was
    up, and the command said Redis was out of reach), and a call is tried at most twice, the second
    time at once after a slot-map refresh on a Redis Cluster. redis-py's cluster client
    tries 11 times about a second apart: ``status`` on a cluster whose primary for the
    deployment was stopped took 25 s to say so. A sync cluster client connects when
    made: call this inside ``redis_errors``."""
    return make_client(
        url, cluster_retries=1, socket_connect_timeout=2.0, socket_timeout=socket_timeout
    )


def check_reachable(url: str) -> None:
    """Fail fast, with the redacted URL, when Redis does not answer or is misconfigured."""
    with redis_errors(url):
        client = command_client(url)
        try:
            client.ping()
        finally:
            client.close()


@contextlib.contextmanager
def signals_stop(stop: Callable[[], None]) -> Iterator[None]:
    """While inside: SIGINT/SIGTERM call stop() (the command then shuts down cleanly and
    exits 0); the previous handlers are restored afterwards.

    stop() runs on a thread of its own: a handler runs in the main thread between two
    of its bytecodes, possibly while that thread holds the lock stop() takes (a
    threading.Event's, inside Event.wait), and the lock is not reentrant."""

    def handler(signum: int, frame: object) -> None:
        threading.Thread(target=stop, name="redisbal-signal", daemon=True).start()

    with signals_handled(handler, signal.SIGINT, signal.SIGTERM):
        yield


@contextlib.contextmanager
def signals_handled(handler: Callable[[int, Any], None], *sigs: signal.Signals) -> Iterator[None]:
    """While inside, ``handler`` handles ``sigs``; the previous handlers come back after."""
    old = {sig: signal.signal(sig, handler) for sig in sigs}
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


async def run_until_signal(main: Awaitable[T], stop: Callable[[], None]) -> T:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop)
    try:
        return await main
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def write_json(path: str | None, data: Any) -> None:
    if path:
        try:
            with open(path, "wb") as fh:
                fh.write(orjson.dumps(data, option=orjson.OPT_INDENT_2))
        except OSError as exc:
            raise click.ClickException(f"cannot write {path}: {exc.strerror or exc}") from None


# -- option declarations used by several commands ------------------------------------------


def option(
    *decls: str, type: Any = None, default: Any = None, help: str, **kw: Any
) -> Callable[[F], F]:
    """A click option that shows its default when it has one (one line per option)."""
    return click.option(
        *decls, type=type, default=default, show_default=default is not None, help=help, **kw
    )


OptionRow = tuple[str, Any, Any, str]


def options(*items: OptionRow | Callable[[F], F]) -> Callable[[F], F]:
    """Several options in --help order: rows of (space-separated flags, type, default,
    help) made with option(), or ready option decorators (the shared ones below)."""

    def apply(f: F) -> F:
        for item in reversed(items):
            if isinstance(item, tuple):
                flags, type_, default, help_ = item
                item = option(*flags.split(), type=type_, default=default, help=help_)
            f = item(f)
        return f

    return apply


DURATION_UNTIL_SIGNAL = option(
    "--duration",
    type=FiniteFloat(0, min_open=True),
    help="Stop after this many seconds (default: until SIGINT/SIGTERM).",
)
SEED = option("--seed", type=int, default=0, help="Seed of the load.")


def policy_option(help: str) -> Callable[[F], F]:
    """--policy: a name from POLICIES, the default policy unless given."""
    return option(
        "--policy", type=click.Choice(sorted(POLICIES)), default=DEFAULT_POLICY, help=help
    )


def mode_option(help: str) -> Callable[[F], F]:
    """--mode: how simulated engines step."""
    return option("--mode", type=click.Choice(["lockstep", "tick"]), default="lockstep", help=help)


def slow_option(help: str) -> Callable[[F], F]:
    """--slow ID[,ID...]:FACTOR (repeatable): straggler engines."""
    return click.option("--slow", multiple=True, metavar="ID[,ID...]:FACTOR", help=help)


def _writable_later(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A file written at the end of a run: its directory must exist and be writable now,
    or the run's figures are lost after it."""
    if value is not None:
        parent = os.path.dirname(os.path.abspath(value))
        if not os.path.isdir(parent):
            raise click.BadParameter(f"{value!r}: directory {parent!r} does not exist")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise click.BadParameter(f"{value!r}: directory {parent!r} is not writable")
    return value


def stats_out_option(help: str) -> Callable[[F], F]:
    """--stats-out PATH: a JSON file written at the end."""
    return click.option(
        "--stats-out",
        type=click.Path(dir_okay=False, writable=True),
        callback=_writable_later,
        help=help,
    )
