"""The operator CLI: ``redisbal coordinator``, ``status``, ``load-functions``.

The shared options and error handling live in ``redisbal.ops.cli_options``. The
tooling commands (``engine-sim``, ``api``, ``demo``, ``bench``) are registered
by "module:attribute" strings and imported only when run, so that ``redisbal
--help`` and ``redisbal status`` never import the simulator or the benchmark,
and one missing optional dependency cannot break the other commands.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import click
import orjson

from redisbal import __version__
from redisbal.config import LEASE_TTL, SETTINGS, CoordinatorConfig
from redisbal.endpoints import InvalidURL
from redisbal.keys import InvalidName, check_name
from redisbal.ops.cli_options import (
    DURATION_UNTIL_SIGNAL,
    FiniteFloat,
    check_reachable,
    command_client,
    common_options,
    option,
    redis_errors,
    settings,
    signals_stop,
)

F = TypeVar("F", bound=Callable[..., Any])

# -- the group --------------------------------------------------------------------------------

# Commands implemented in other modules: name -> ("module:attribute", the first paragraph
# of the command's help, shown by `redisbal --help` without importing the module; a test
# checks that it matches). Register a command here with one line.
EXTERNAL_COMMANDS: dict[str, tuple[str, str]] = {
    "api": (
        "redisbal.sim.cli:api",
        "Run API-server routers that send simulated load to `redisbal engine-sim` engines.",
    ),
    "bench": (
        "redisbal.bench.cli:bench_command",
        "Routing quality: every policy on the same LLM-like traffic, on a simulated clock.",
    ),
    "demo": (
        "redisbal.sim.cli:demo",
        "Run the whole system for a few seconds and print what users felt, against a baseline.",
    ),
    "gateway": (
        "redisbal.gateway.cli:gateway",
        "OpenAI-compatible gateway: route every request with the shared snapshot.",
    ),
    "kv-events": (
        "redisbal.integrations.kv_events:kv_events_command",
        "Follow engines' KV-cache events (vLLM's or SGLang's ZeroMQ publisher) into Redis.",
    ),
    "loadgen": (
        "redisbal.bench.loadgen:loadgen",
        "Open-loop load against an OpenAI-compatible URL; TTFT, ITL, latency, errors.",
    ),
    "engine-sim": (
        "redisbal.sim.cli:engine_sim",
        "Run simulated continuous-batching engines that report to Redis for real.",
    ),
    "scrape": (
        "redisbal.integrations.scrape:scrape_command",
        "Report engines from their Prometheus /metrics (vLLM, SGLang), in tick mode.",
    ),
}


class RedisbalGroup(click.Group):
    """A click group that also lists and loads the EXTERNAL_COMMANDS."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *EXTERNAL_COMMANDS})

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The command list, from EXTERNAL_COMMANDS' summaries for the external ones."""
        rows = []
        for name in self.list_commands(ctx):
            cmd = super().get_command(ctx, name)
            if cmd is None:
                cmd = click.Command(name, help=EXTERNAL_COMMANDS[name][1])
            if not cmd.hidden:
                rows.append((name, cmd))
        if rows:
            limit = formatter.width - 6 - max(len(name) for name, _ in rows)
            with formatter.section("Commands"):
                formatter.write_dl([(name, cmd.get_short_help_str(limit)) for name, cmd in rows])

    def invoke(self, ctx: click.Context) -> Any:
        """A name or URL that a command passed on unchecked is still refused before any key
        is built from it (keys.check_name, endpoints.check_url): one line, not a traceback."""
        try:
            return super().invoke(ctx)
        except (InvalidName, InvalidURL) as exc:
            raise click.UsageError(str(exc)) from None

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        cmd = super().get_command(ctx, cmd_name)
        if cmd is not None or cmd_name not in EXTERNAL_COMMANDS:
            return cmd
        return load_command(cmd_name)


def load_command(name: str) -> click.Command:
    """Import an external command; one whose module cannot be imported says why when run."""
    module, _, attr = EXTERNAL_COMMANDS[name][0].partition(":")
    try:
        loaded = getattr(importlib.import_module(module), attr)
    except ImportError as exc:
        reason = f"{name} is unavailable: {exc}"

        @click.command(name, help=reason, context_settings={"ignore_unknown_options": True})
        @click.argument("args", nargs=-1, type=click.UNPROCESSED)
        def unavailable(args: tuple[str, ...]) -> None:
            raise click.ClickException(reason)

        return unavailable
    if not isinstance(loaded, click.Command):
        raise TypeError(f"{EXTERNAL_COMMANDS[name][0]} is not a click command")
    return loaded


@click.group(
    "redisbal", cls=RedisbalGroup, context_settings={"help_option_names": ["-h", "--help"]}
)
@click.version_option(__version__, "--version", "-V", prog_name="redisbal")
@common_options
def cli() -> None:
    """redisbal: a Redis-backed shared-state load balancer for data-parallel LLM engines.

    Engines report step-tagged counts into Redis, a Lua barrier publishes a
    consistent snapshot when every live engine has reported the step, and API
    servers route each request locally from it. Try `redisbal demo`.
    """


# -- coordinator ------------------------------------------------------------------------------


def _parse_expect(ctx: click.Context, param: click.Parameter, value: str | None) -> list[str]:
    """--expect N (ids 0..N-1) or ID,ID,...: every item is checked, and the bad one named
    (a stray comma is a mistake, not an item to drop)."""
    if value is None:
        return []
    text = value.strip()
    if not text:
        raise click.BadParameter("no engines given: a count N (engines 0..N-1) or ids, e.g. a,b")
    if text.isascii() and text.isdigit():  # not "²", which isdigit() but int() refuses
        n = int(text)
        if not 1 <= n <= 4096:
            raise click.BadParameter(f"expected engine count must be in 1..4096, got {n}")
        return [str(i) for i in range(n)]
    ids = [x.strip() for x in text.split(",")]
    for pos, i in enumerate(ids, 1):
        if not i:
            raise click.BadParameter(f"item {pos} of {value!r} is empty (a stray comma?)")
        try:
            check_name(i, "engine id")
        except InvalidName as exc:
            raise click.BadParameter(f"item {pos} of {value!r}: {exc}") from None
    dup = next((i for n, i in enumerate(ids) if i in ids[:n]), None)
    if dup is not None:
        raise click.BadParameter(f"engine id {dup!r} is listed twice in {value!r}")
    return ids


def _setting(name: str) -> Callable[[F], F]:
    """--<name> for a coordinator setting, with its default, bounds and unit from config.py."""
    s = LEASE_TTL if name == "lease_ttl_ms" else SETTINGS[name]
    flag = "--" + name.replace("_", "-")
    return option(
        flag,
        type=click.IntRange(s.lo, s.hi),
        default=s.default,
        metavar=s.unit.upper(),
        help=s.help,
    )


def _settings_options(f: F) -> F:
    """--<setting> for every deployment setting of config.SETTINGS, in its order."""
    for name in reversed(SETTINGS):
        f = _setting(name)(f)
    return f


@cli.command()
@common_options
@_settings_options
@click.option(
    "--expect",
    metavar="N|ID,ID,...",
    callback=_parse_expect,
    help="Engines the first snapshot must wait for: a count N (ids 0..N-1) or a list of ids.",
)
@_setting("lease_ttl_ms")
@click.option("--id", "coordinator_id", metavar="NAME", help="Coordinator id (default host-pid).")
@DURATION_UNTIL_SIGNAL
@click.option(
    "--metrics-port",
    type=click.IntRange(1, 65535),
    metavar="PORT",
    help="Serve Prometheus metrics on this port (needs redisbal[metrics]).",
)
@click.option(
    "--metrics-addr", default="127.0.0.1", show_default=True, help="Metrics bind address."
)
def coordinator(
    expect: list[str],
    lease_ttl_ms: int,
    coordinator_id: str | None,
    duration: float | None,
    metrics_port: int | None,
    metrics_addr: str,
    **setting_values: int,
) -> None:
    """Keep a deployment in order: config, expiry, stall guard, idle heartbeat, lease.

    Not on the request path; run a second one as a hot standby. SIGINT/SIGTERM
    release the lease and exit 0.
    """
    from redisbal.ops.coordinator import Coordinator

    s = settings()
    url = s.require_url()
    config = CoordinatorConfig(**setting_values, expected=expect, lease_ttl_ms=lease_ttl_ms)
    try:
        config.check()
        if coordinator_id is not None:
            check_name(coordinator_id, "coordinator id")
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    check_reachable(url)
    coord = Coordinator(url, s.deployment, config, coordinator_id=coordinator_id)
    server = None
    if metrics_port is not None:
        try:
            from redisbal.ops.coordinator_metrics import serve_coordinator_metrics
        except ImportError as exc:
            if (exc.name or "").startswith("prometheus_client"):
                raise click.ClickException(
                    "--metrics-port needs prometheus_client: pip install 'redisbal[metrics]'"
                ) from None
            raise click.ClickException(f"metrics are unavailable: {exc}") from None
        try:
            server = serve_coordinator_metrics(coord, metrics_port, metrics_addr)
        except OSError as exc:  # the port in use, an address not of this host
            raise click.ClickException(
                f"cannot serve metrics on {metrics_addr}:{metrics_port}: {exc.strerror or exc} "
                "(choose another --metrics-port or --metrics-addr)"
            ) from None
    try:
        with redis_errors(url), signals_stop(coord.stop):
            coord.run(duration)
    finally:
        for closer in ("shutdown", "close", "stop"):
            fn = getattr(server, closer, None)
            if callable(fn):
                with contextlib.suppress(Exception):
                    fn()
                break
    st = coord.stats
    click.echo(
        f"coordinator {coord.id} stopped: ticks {st.ticks}, expired {st.expired}, "
        f"forced {st.forced}, idle publishes {st.idle_published}, errors {st.errors}",
        err=True,
    )


# -- status -----------------------------------------------------------------------------------


@cli.command()
@common_options
@click.option(
    "--watch",
    "-w",
    type=FiniteFloat(0.1, 3600),
    is_flag=False,
    flag_value=1.0,
    default=None,
    metavar="[SECONDS]",
    help="Refresh every SECONDS (default 1) until Ctrl-C.",
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (one object).")
def status(watch: float | None, as_json: bool) -> None:
    """Show the deployment: snapshot, counters and a per-engine table."""
    from redisbal.ops.status import format_status, gather_status

    s = settings()
    url = s.require_url()
    with redis_errors(url):
        client = command_client(url)
    seen: set[str] = set()
    try:
        with redis_errors(url):
            while True:
                st = gather_status(client, s.deployment, seen if watch else None)
                seen |= {e["engine"] for e in st["engines"]}
                if as_json:
                    click.echo(orjson.dumps(st).decode())
                else:
                    if watch:
                        click.clear()
                        click.echo(f"{time.strftime('%H:%M:%S')}  {s.safe_url}  (Ctrl-C to stop)")
                    click.echo(format_status(st))
                if not watch:
                    return
                time.sleep(watch)
    except KeyboardInterrupt:
        return  # Ctrl-C ends --watch normally
    finally:
        client.close()


# -- load-functions ---------------------------------------------------------------------------


@cli.command("load-functions")
@common_options
def load_functions() -> None:
    """Load redisbal's function library into Redis 7+ (run as an administrator).

    Engines and the coordinator load it themselves when their Redis user may run
    FUNCTION LOAD; least-privilege users (docs/DEPLOY.md) may not, because a
    library is server-wide: whoever can load one can change the code every user
    runs. Run this once as an admin after each redisbal upgrade, before starting
    the clients: a client that finds no library and may not load it uses EVALSHA
    until it is restarted (slower on the server, same results).
    """
    from redisbal.barrier.loader import library
    from redisbal.barrier.operations import load_library

    s = settings()
    url = s.require_url()
    with redis_errors(url):
        client = command_client(url)
    try:
        with redis_errors(url):
            major = int(str(client.info("server")["redis_version"]).split(".")[0])
            if major < 7:
                raise click.ClickException(
                    f"{s.safe_url} runs Redis {major}.x, which has no functions; "
                    "redisbal uses EVALSHA there, nothing to load"
                )
            name = load_library(client)
    finally:
        client.close()
    click.echo(f"loaded {name} ({len(library()[1])} bytes of Lua) into {s.safe_url}")


# Set by `redisbal demo` for the processes it starts (each in its own session, so that
# Ctrl-C reaches the demo alone), to its own pid: they stop when the demo is gone,
# killed or not.
EXIT_WITH_PARENT_ENV = "REDISBAL_EXIT_WITH_PARENT"
PARENT_CHECK_S = 0.5
PARENT_GONE_KILL_S = 10.0  # after SIGTERM, how long a process may take to stop


def exit_with_parent(parent: int) -> None:
    """Stop this process (SIGTERM to itself, SIGKILL 10 s later) once ``parent``, the
    process that started it, is gone (at once if it already is: killed while this one
    was starting). A demo killed with SIGKILL, or by a test's timeout, cannot stop its
    children, and an engine simulator left behind spins for good."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_CHECK_S)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(PARENT_GONE_KILL_S)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True, name="exit-with-parent").start()


def main() -> None:
    """Console-script entry point.

    ``gc.freeze()`` leaves the objects made by the imports so far (most of a short
    command's heap) out of every garbage collection, the interpreter's last one at
    exit included: that one was about a fifth of ``redisbal status``'s CPU, and on a
    starved machine the command was seen still in it seconds after printing. Only the
    collector skips them; nothing the commands close or flush at exit changes."""
    gc.freeze()
    parent = os.environ.pop(EXIT_WITH_PARENT_ENV, "")  # (not for processes this one starts)
    if parent.isdigit():
        exit_with_parent(int(parent))
    cli(prog_name="redisbal")


if __name__ == "__main__":
    main()
