"""The ``redisbal`` command line (click).

Every command takes ``--redis-url`` (``REDISBAL_REDIS_URL``), ``--deployment``
(``REDISBAL_DEPLOYMENT``) and ``--log-level`` (``REDISBAL_LOG_LEVEL``), either
before the command name or after it (``redisbal status --redis-url ...``, the
form docker-compose uses); a value given on the command line wins over the
environment, and one given after the command name wins over one before it.
Names and URLs are checked before anything connects; errors name the option
and never show a password.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import math
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import click
import orjson
import redis.exceptions
from click.core import ParameterSource

from redisbal import __version__
from redisbal.connection import BadRedisURL, make_client, parse_url, redact
from redisbal.keys import InvalidName, check_name
from redisbal.policies import POLICIES

F = TypeVar("F", bound=Callable[..., Any])
LOG_LEVELS = ("debug", "info", "warning", "error")
_OPTS = "redisbal.options"
_PRIORITY = {
    ParameterSource.COMMANDLINE: 3,
    ParameterSource.ENVIRONMENT: 2,
    ParameterSource.DEFAULT_MAP: 1,
    ParameterSource.DEFAULT: 0,
}
REDIS_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)


class FiniteFloat(click.FloatRange):
    """click.FloatRange that also refuses nan and inf: nan compares false with both
    bounds, so FloatRange lets it through (and an engine stepping every nan ms hangs)."""

    name = "float"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        rv = super().convert(value, param, ctx)
        if not math.isfinite(rv):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return rv


# -- shared options ---------------------------------------------------------------------------


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
    """Add --redis-url / --deployment / --log-level to a command (read them with settings())."""
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
    s = Settings(
        redis_url=store.get("redis_url", (None, 0))[0],
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


@contextlib.contextmanager
def redis_errors(url: str | None) -> Iterator[None]:
    """Turn a Redis outage or refusal into one clear line (password redacted)."""
    try:
        yield
    except REDIS_ERRORS as exc:
        raise click.ClickException(
            f"cannot reach Redis at {redact(url or '')}: {redact(str(exc)) or type(exc).__name__}"
        ) from None
    except redis.exceptions.ResponseError as exc:
        raise click.ClickException(
            f"Redis at {redact(url or '')} refused: {redact(str(exc))}"
        ) from None


def check_reachable(url: str) -> None:
    """Fail fast, with the redacted URL, when Redis does not answer."""
    with redis_errors(url):
        client = make_client(url, socket_connect_timeout=2.0, socket_timeout=2.0)
        try:
            client.ping()
        finally:
            client.close()


@contextlib.contextmanager
def _signals_stop(stop: Callable[[], None]) -> Iterator[None]:
    """While inside: SIGINT/SIGTERM call stop() (the command then shuts down cleanly and
    exits 0); the previous handlers are restored afterwards."""

    def handler(signum: int, frame: object) -> None:
        stop()

    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


async def _run_until_signal(main: Any, stop: Callable[[], None]) -> Any:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop)
    try:
        return await main
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def _write_json(path: str | None, data: Any) -> None:
    if path:
        with open(path, "wb") as fh:
            fh.write(orjson.dumps(data, option=orjson.OPT_INDENT_2))


# -- the group --------------------------------------------------------------------------------

# Commands implemented in other modules: name -> "module:attribute". They are imported when
# used or listed, so that one optional dependency cannot break the other commands.
# Register a command here (one line), e.g.  "bench": "redisbal.bench:bench",
EXTERNAL_COMMANDS: dict[str, str] = {
    "bench": "redisbal.bench:bench_command",
    "gateway": "redisbal.gateway.command:gateway",
    "loadgen": "redisbal.gateway.loadgen:loadgen",
}


class RedisbalGroup(click.Group):
    """A click group that also lists and loads the EXTERNAL_COMMANDS."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *EXTERNAL_COMMANDS})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        cmd = super().get_command(ctx, cmd_name)
        if cmd is not None or cmd_name not in EXTERNAL_COMMANDS:
            return cmd
        module, _, attr = EXTERNAL_COMMANDS[cmd_name].partition(":")
        try:
            loaded = getattr(importlib.import_module(module), attr)
        except ImportError as exc:
            reason = f"{cmd_name} is unavailable: {exc}"

            @click.command(cmd_name, help=reason, context_settings={"ignore_unknown_options": True})
            @click.argument("args", nargs=-1, type=click.UNPROCESSED)
            def unavailable(args: tuple[str, ...]) -> None:
                raise click.ClickException(reason)

            return unavailable
        if not isinstance(loaded, click.Command):
            raise TypeError(f"{EXTERNAL_COMMANDS[cmd_name]} is not a click command")
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
    if not value:
        return []
    value = value.strip()
    if value.isdigit():
        n = int(value)
        if not 1 <= n <= 4096:
            raise click.BadParameter(f"expected engine count must be in 1..4096, got {n}")
        return [str(i) for i in range(n)]
    ids = [x.strip() for x in value.split(",") if x.strip()]
    for i in ids:
        try:
            check_name(i, "engine id")
        except InvalidName as exc:
            raise click.BadParameter(str(exc)) from None
    if len(set(ids)) != len(ids):
        raise click.BadParameter("engine ids must be unique")
    return ids


def _ms(name: str, default: int, lo: int, hi: int, help: str) -> Callable[[F], F]:
    return click.option(
        name, type=click.IntRange(lo, hi), default=default, show_default=True, help=help
    )


@cli.command()
@common_options
@_ms("--dead-after-ms", 5000, 100, 86_400_000, "Expire an engine with no report for this long.")
@_ms("--stall-ms", 250, 1, 86_400_000, "Force a snapshot when the barrier waited this long.")
@_ms("--tick-ms", 20, 1, 60_000, "Shared tick of independent (tick-mode) engines.")
@_ms("--join-grace-ms", 1000, 0, 600_000, "The first snapshot of an epoch waits this long.")
@_ms("--idle-publish-ms", 1000, 10, 3_600_000, "Republish a quiet deployment this often.")
@click.option(
    "--expect",
    metavar="N|ID,ID,...",
    callback=_parse_expect,
    help="Engines the first snapshot must wait for: a count N (ids 0..N-1) or a list of ids.",
)
@_ms("--lease-ttl-ms", 2000, 200, 600_000, "Coordinator lease TTL (a standby takes over after).")
@click.option("--id", "coordinator_id", metavar="NAME", help="Coordinator id (default host-pid).")
@click.option(
    "--duration",
    type=FiniteFloat(0, min_open=True),
    help="Stop after this many seconds (default: until SIGINT/SIGTERM).",
)
@click.option(
    "--metrics-port",
    type=click.IntRange(1, 65535),
    help="Serve Prometheus metrics on this port (needs redisbal[metrics]).",
)
@click.option(
    "--metrics-addr", default="127.0.0.1", show_default=True, help="Metrics bind address."
)
def coordinator(
    dead_after_ms: int,
    stall_ms: int,
    tick_ms: int,
    join_grace_ms: int,
    idle_publish_ms: int,
    expect: list[str],
    lease_ttl_ms: int,
    coordinator_id: str | None,
    duration: float | None,
    metrics_port: int | None,
    metrics_addr: str,
) -> None:
    """Keep a deployment in order: config, expiry, stall guard, idle heartbeat, lease.

    Not on the request path; run a second one as a hot standby. SIGINT/SIGTERM
    release the lease and exit 0.
    """
    from redisbal.coordinator import Coordinator, CoordinatorConfig

    s = settings()
    url = s.require_url()
    config = CoordinatorConfig(
        dead_after_ms=dead_after_ms,
        stall_ms=stall_ms,
        tick_ms=tick_ms,
        join_grace_ms=join_grace_ms,
        idle_publish_ms=idle_publish_ms,
        expected=expect,
    )
    try:
        config.check()
        if coordinator_id is not None:
            check_name(coordinator_id, "coordinator id")
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    check_reachable(url)
    coord = Coordinator(
        url, s.deployment, config, lease_ttl_ms=lease_ttl_ms, coordinator_id=coordinator_id
    )
    server = None
    if metrics_port is not None:
        try:
            from redisbal.metrics import serve_coordinator_metrics
        except ImportError as exc:
            if (exc.name or "").startswith("prometheus_client"):
                raise click.ClickException(
                    "--metrics-port needs prometheus_client: pip install 'redisbal[metrics]'"
                ) from None
            raise click.ClickException(f"metrics are unavailable: {exc}") from None
        server = serve_coordinator_metrics(coord, metrics_port, metrics_addr)
    try:
        with redis_errors(url), _signals_stop(coord.stop):
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


# -- engine-sim -------------------------------------------------------------------------------


def _parse_slow(values: tuple[str, ...]) -> dict[str, float]:
    out: dict[str, float] = {}
    for v in values:
        ids, sep, factor = v.rpartition(":")
        try:
            f = float(factor)
        except ValueError:
            f = -1.0
        if not sep or not ids or not 0 < f <= 100:
            raise click.BadParameter(
                f"{v!r}: use ID[,ID...]:FACTOR with FACTOR in (0, 100], e.g. 3,5:2.0",
                param_hint="'--slow'",
            )
        for i in ids.split(","):
            try:
                out[check_name(i.strip(), "engine id")] = f
            except InvalidName as exc:
                raise click.BadParameter(str(exc), param_hint="'--slow'") from None
    return out


@cli.command("engine-sim")
@common_options
@click.option(
    "--engines",
    "-n",
    type=click.IntRange(1, 1024),
    default=4,
    show_default=True,
    help="Number of simulated engines in this process.",
)
@click.option("--id-prefix", default="", show_default=True, help="Engine ids are PREFIX<number>.")
@click.option(
    "--first-id",
    type=click.IntRange(0, 10**9),
    default=0,
    show_default=True,
    help="Number of the first engine id.",
)
@click.option(
    "--mode",
    type=click.Choice(["lockstep", "tick"]),
    default="lockstep",
    show_default=True,
    help="lockstep: all engines step together (a step lasts as long as the slowest); "
    "tick: independent engines on the shared server tick.",
)
@click.option(
    "--running-cap",
    type=click.IntRange(1, 100_000),
    default=64,
    show_default=True,
    help="Running slots per engine (requests beyond wait).",
)
@click.option(
    "--base-step-ms",
    type=FiniteFloat(0.1, 10_000),
    default=12.0,
    show_default=True,
    help="Step time with an empty batch.",
)
@click.option(
    "--per-seq-ms",
    type=FiniteFloat(0, 1_000),
    default=0.15,
    show_default=True,
    help="Step time added per running request.",
)
@click.option(
    "--prefill-ms",
    type=FiniteFloat(0, 1_000),
    default=0.4,
    show_default=True,
    help="Step time added per request admitted in the step.",
)
@click.option(
    "--slow",
    multiple=True,
    metavar="ID[,ID...]:FACTOR",
    help="Make engines step FACTOR times slower (repeatable), e.g. 3,5:2.0.",
)
@click.option(
    "--duration",
    type=FiniteFloat(0, min_open=True),
    help="Stop after this many seconds (default: until SIGINT/SIGTERM).",
)
@click.option(
    "--stats-out",
    type=click.Path(dir_okay=False, writable=True),
    help="Write the run's per-engine figures as JSON here at the end.",
)
@click.option(
    "--summary/--no-summary",
    default=True,
    show_default=True,
    help="Print the per-engine table at the end.",
)
@click.option(
    "--report-before-step/--report-after-step-only",
    default=True,
    show_default=True,
    help="Also report right before each step, once the step has taken the requests "
    "that arrived (vLLM's engines do since PR 41626), not only after it.",
)
def engine_sim(
    engines: int,
    id_prefix: str,
    first_id: int,
    mode: str,
    running_cap: int,
    base_step_ms: float,
    per_seq_ms: float,
    prefill_ms: float,
    slow: tuple[str, ...],
    duration: float | None,
    stats_out: str | None,
    summary: bool,
    report_before_step: bool,
) -> None:
    """Run simulated continuous-batching engines that report to Redis for real.

    They take requests from `redisbal api` processes (Redis lists, see
    redisbal.simtransport) and leave the deployment gracefully on SIGINT/SIGTERM.
    """
    from redisbal.engine_sim import EngineSimRunner, engine_ids, format_engine_table
    from redisbal.sim import EngineParams

    s = settings()
    url = s.require_url()
    try:
        ids = engine_ids(engines, id_prefix, first_id)
    except InvalidName as exc:
        raise click.BadParameter(str(exc), param_hint="'--id-prefix' / '--first-id'") from None
    slow_map = _parse_slow(slow)
    params = EngineParams(
        running_cap=running_cap,
        base_step_s=base_step_ms / 1000,
        per_seq_s=per_seq_ms / 1000,
        prefill_s=prefill_ms / 1000,
    )
    try:
        runner = EngineSimRunner(
            url,
            s.deployment,
            ids,
            mode=mode,
            params=params,
            slow=slow_map,
            report_before_step=report_before_step,
        )
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    check_reachable(url)
    with redis_errors(url):
        stats = asyncio.run(_run_until_signal(runner.run(duration), runner.stop))
    data = stats.to_dict()
    _write_json(stats_out, data)
    if summary:
        click.echo(format_engine_table(data))


# -- api --------------------------------------------------------------------------------------


@cli.command()
@common_options
@click.option(
    "--client-index",
    type=click.IntRange(0, 4095),
    default=0,
    show_default=True,
    help="API-server index of the first router in this process.",
)
@click.option(
    "--client-count",
    type=click.IntRange(1, 4096),
    help="API servers in the deployment [default: client-index + routers].",
)
@click.option(
    "--routers",
    type=click.IntRange(1, 256),
    default=1,
    show_default=True,
    help="Router instances in this process (indexes client-index, +1, ...).",
)
@click.option(
    "--policy",
    type=click.Choice(sorted(POLICIES)),
    default="redisbal",
    show_default=True,
    help="Routing policy.",
)
@click.option(
    "--burst",
    type=click.IntRange(0, 10_000_000),
    default=0,
    show_default=True,
    help="Requests per burst over ALL API servers (each sends its share).",
)
@click.option(
    "--burst-window-ms",
    type=FiniteFloat(0, 60_000),
    default=50.0,
    show_default=True,
    help="A burst is sent within this window.",
)
@click.option(
    "--burst-every",
    type=FiniteFloat(0.01, 3600),
    default=2.0,
    show_default=True,
    help="Seconds between burst starts.",
)
@click.option(
    "--rate",
    type=FiniteFloat(0, 1_000_000),
    default=0.0,
    show_default=True,
    help="Poisson requests/s over ALL API servers (can be combined with bursts).",
)
@click.option(
    "--duration",
    type=FiniteFloat(0, 86_400, min_open=True),
    default=10.0,
    show_default=True,
    help="Seconds of load.",
)
@click.option(
    "--mean-output",
    type=FiniteFloat(1, 100_000),
    default=40.0,
    show_default=True,
    help="Mean output length in tokens (heavy-tailed).",
)
@click.option(
    "--max-output",
    type=click.IntRange(1, 1_000_000),
    default=2000,
    show_default=True,
    help="Cap on output lengths (tokens).",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the load.")
@click.option(
    "--start-at",
    type=float,
    metavar="UNIX_TIME",
    help="Wall-clock start, so several api processes burst together.",
)
@click.option(
    "--drain-timeout",
    type=FiniteFloat(0, 3600),
    default=10.0,
    show_default=True,
    help="After the load, wait this long for completions.",
)
@click.option(
    "--wait-engines",
    type=FiniteFloat(0, 3600),
    default=10.0,
    show_default=True,
    help="Wait this long for a first snapshot.",
)
@click.option(
    "--stats-out",
    type=click.Path(dir_okay=False, writable=True),
    help="Write per-router figures as JSON here at the end.",
)
@click.option("--quiet", "-q", is_flag=True, help="No progress lines.")
def api(
    client_index: int,
    client_count: int | None,
    routers: int,
    policy: str,
    burst: int,
    burst_window_ms: float,
    burst_every: float,
    rate: float,
    duration: float,
    mean_output: float,
    max_output: int,
    seed: int,
    start_at: float | None,
    drain_timeout: float,
    wait_engines: float,
    stats_out: str | None,
    quiet: bool,
) -> None:
    """Run API-server routers that send simulated load to `redisbal engine-sim` engines.

    Each request is routed by an AsyncRouter, sent to the chosen engine and
    reported finished() when the engine completes it.
    """
    from redisbal.api_sim import ApiSimRunner, LoadSpec
    from redisbal.policies import NoEngines

    s = settings()
    url = s.require_url()
    count = client_count if client_count is not None else client_index + routers
    if client_index + routers > count:
        raise click.BadParameter(
            f"routers {client_index}..{client_index + routers - 1} do not fit in "
            f"--client-count {count}",
            param_hint="'--client-count'",
        )
    if burst == 0 and rate == 0:
        raise click.UsageError("no load: give --burst N and/or --rate R")
    spec = LoadSpec(
        duration_s=duration,
        burst=burst,
        burst_window_ms=burst_window_ms,
        burst_every_s=burst_every,
        rate=rate,
        mean_output=mean_output,
        max_output=max_output,
        seed=seed,
    )
    check_reachable(url)
    runner = ApiSimRunner(
        url,
        s.deployment,
        list(range(client_index, client_index + routers)),
        count,
        spec,
        policy=policy,
        start_at=start_at,
        drain_timeout_s=drain_timeout,
        wait_engines_s=wait_engines,
        progress=None if quiet else sys.stdout,
    )
    try:
        with redis_errors(url):
            result = asyncio.run(_run_until_signal(runner.run(), runner.stop))
    except NoEngines as exc:
        raise click.ClickException(str(exc)) from None
    _write_json(stats_out, result)
    unfinished = sum(r["unfinished"] for r in result)
    unroutable = sum(r["unroutable"] for r in result)
    if unroutable:
        raise click.ClickException(f"{unroutable} requests found no engine to route to")
    if unfinished:
        raise click.ClickException(
            f"{unfinished} requests did not complete within --drain-timeout {drain_timeout:g}s"
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
    from redisbal.status import format_status, gather_status

    s = settings()
    url = s.require_url()
    client = make_client(url, socket_connect_timeout=2.0, socket_timeout=2.0)
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
    from redisbal.scripts import library, load_library

    s = settings()
    url = s.require_url()
    client = make_client(url, socket_connect_timeout=2.0, socket_timeout=5.0)
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


# -- demo -------------------------------------------------------------------------------------


@cli.command()
@common_options
@click.option(
    "--engines", type=click.IntRange(1, 64), default=8, show_default=True, help="Simulated engines."
)
@click.option(
    "--api-servers",
    type=click.IntRange(1, 16),
    default=3,
    show_default=True,
    help="API-server processes, one router each.",
)
@click.option(
    "--duration",
    type=FiniteFloat(0.5, 600),
    default=6.0,
    show_default=True,
    help="Seconds of load.",
)
@click.option(
    "--policy",
    type=click.Choice(sorted(POLICIES)),
    default="redisbal",
    show_default=True,
    help="Routing policy of the API servers.",
)
@click.option(
    "--mode",
    type=click.Choice(["lockstep", "tick"]),
    default="lockstep",
    show_default=True,
    help="Engine stepping (see engine-sim).",
)
@click.option(
    "--running-cap",
    type=click.IntRange(1, 10_000),
    default=16,
    show_default=True,
    help="Running slots per engine.",
)
@click.option(
    "--burst",
    type=click.IntRange(0, 1_000_000),
    help="Requests per burst [default: 1.5 x engines x running-cap].",
)
@click.option(
    "--burst-every",
    type=FiniteFloat(0.1, 600),
    default=2.0,
    show_default=True,
    help="Seconds between bursts.",
)
@click.option(
    "--rate",
    type=FiniteFloat(0, 100_000),
    default=0.0,
    show_default=True,
    help="Background Poisson requests/s.",
)
@click.option(
    "--slow",
    multiple=True,
    metavar="ID[,ID...]:FACTOR",
    help="Straggler engines, e.g. 0:2.0 (repeatable).",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the load.")
@click.option("--keep-logs", is_flag=True, help="Keep the processes' log directory.")
def demo(
    engines: int,
    api_servers: int,
    duration: float,
    policy: str,
    mode: str,
    running_cap: int,
    burst: int | None,
    burst_every: float,
    rate: float,
    slow: tuple[str, ...],
    seed: int,
    keep_logs: bool,
) -> None:
    """Run the whole system for a few seconds and print how balanced it was.

    Without --redis-url it starts its own redis-server (Debian's, or the one of
    `pip install 'redisbal[embedded]'`); then a coordinator, ENGINES simulated
    engines and API-SERVERS router processes under a bursty load. Every process
    it started is stopped at the end, also on Ctrl-C.
    """
    from redisbal.demo import DemoOptions, run_demo

    s = settings()
    _parse_slow(slow)
    if burst is None:
        burst = int(1.5 * engines * running_cap)
    if burst == 0 and rate == 0:
        raise click.UsageError("no load: --burst 0 needs --rate R")
    if s.redis_url:
        check_reachable(s.redis_url)
    opts = DemoOptions(
        redis_url=s.redis_url,
        deployment=s.deployment,
        log_level=s.log_level,
        engines=engines,
        api_servers=api_servers,
        duration=duration,
        policy=policy,
        mode=mode,
        running_cap=running_cap,
        burst=burst,
        burst_every=burst_every,
        rate=rate,
        slow=list(slow),
        seed=seed,
        keep_logs=keep_logs,
    )
    code = run_demo(opts, echo=click.echo)
    if code:
        sys.exit(code)


def main() -> None:
    """Console-script entry point."""
    cli(prog_name="redisbal")


if __name__ == "__main__":
    main()
