"""``redisbal gateway``: the OpenAI-compatible gateway as a command (click)."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

import click

from redisbal.errors import InvalidArgument
from redisbal.gateway.observability import observability, observability_options
from redisbal.gateway.options import check_model, exposure, exposure_options, warn_if_open
from redisbal.ops.cli_options import (
    FiniteFloat,
    check_reachable,
    common_options,
    redis_errors,
    settings,
)
from redisbal.routing.admission import DEFAULT_MAX_S
from redisbal.routing.cache_view import LEARNED_TOKENS, learned_anchors
from redisbal.routing.policies import DEFAULT_POLICY, POLICIES

if TYPE_CHECKING:
    from redisbal.gateway.server import Gateway

log = logging.getLogger("redisbal.gateway")

T = TypeVar("T")
EXTRA_HINT = "pip install 'redisbal[gateway]'"


def require_extra() -> None:
    """One clear line when the gateway extra is missing (no traceback)."""
    try:
        import aiohttp  # noqa: F401
        import prometheus_client  # noqa: F401
    except ImportError as exc:
        raise click.ClickException(
            f"the gateway needs the 'gateway' extra ({exc.name} is missing): {EXTRA_HINT}"
        ) from None


def run_loop(main: Coroutine[Any, Any, T], kind: str = "auto") -> T:
    """asyncio.run on uvloop when asked for or (auto) installed."""
    if kind != "asyncio":
        try:
            import uvloop  # type: ignore[import-not-found, unused-ignore]
        except ImportError:
            if kind == "uvloop":
                main.close()  # never run
                raise click.ClickException(
                    "--event-loop uvloop: uvloop is not installed (pip install uvloop), "
                    "or use --event-loop asyncio"
                ) from None
        else:
            result: T = uvloop.run(main)
            return result
    return asyncio.run(main)


def _client_index(ctx: click.Context, param: click.Parameter, value: str) -> int | str:
    if value == "auto":
        return "auto"
    if value.isascii() and value.isdigit() and int(value) < 4096:  # not "³": int() refuses it
        return int(value)
    raise click.BadParameter(f"must be 'auto' or a whole number in 0..4095, got {value!r}")


def _engines(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> dict[str, str]:
    from redisbal.endpoints import InvalidURL, parse_engine_arg

    out: dict[str, str] = {}
    for v in values:
        try:
            eid, url = parse_engine_arg(v)
        except InvalidURL as exc:
            raise click.BadParameter(str(exc)) from None
        if eid in out:
            raise click.BadParameter(f"engine {eid!r} is given twice ({out[eid]} and {url})")
        out[eid] = url
    return out


def _models(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> dict[str, str]:
    from redisbal.keys import InvalidName, check_name

    out: dict[str, str] = {}
    for item in (x.strip() for v in values for x in v.split(",")):
        if not item:
            continue
        name, eq, dep = item.rpartition("=")
        if not eq or not name:
            raise click.BadParameter(f"{item!r} is not NAME=DEPLOYMENT")
        try:
            out_name = check_model(name)
            check_name(dep, "deployment name")
        except (ValueError, InvalidName) as exc:
            raise click.BadParameter(str(exc)) from None
        if out_name in out:
            raise click.BadParameter(f"model {name!r} is given twice")
        out[out_name] = dep
    return out


@click.command("gateway")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=8310,
    show_default=True,
    metavar="PORT",
    help="Port to listen on (0: one the system picks, printed at start).",
)
@click.option(
    "--engine",
    "engines",
    multiple=True,
    callback=_engines,
    metavar="ID=URL",
    help="An engine and its base URL (repeatable); engines also register theirs in Redis.",
)
@click.option(
    "--model",
    "models",
    multiple=True,
    callback=_models,
    envvar="REDISBAL_MODELS",
    show_envvar=True,
    metavar="NAME=DEPLOYMENT",
    help="Serve the model NAME (what requests send as 'model') from DEPLOYMENT "
    "(repeatable; the env var takes several separated by commas or spaces). With "
    "models, each request goes to its model's deployment, an unknown model gets a "
    "404, and --deployment is not used. Without, every request goes to --deployment.",
)
@click.option(
    "--client-index",
    default="auto",
    show_default=True,
    callback=_client_index,
    help="This API server's index, or 'auto' to lease the lowest free one in Redis.",
)
@click.option(
    "--lease-ttl-s",
    type=FiniteFloat(0.3, 3600),
    default=10.0,
    show_default=True,
    help="With --client-index auto: the index lease's TTL (renewed every third of it).",
)
@click.option(
    "--client-count",
    type=click.IntRange(1, 4096),
    default=1,
    show_default=True,
    help="API servers of the deployment (with a fixed --client-index).",
)
@click.option(
    "--policy",
    type=click.Choice(sorted(POLICIES)),
    default=DEFAULT_POLICY,
    show_default=True,
    help="Routing policy (the others are baselines for comparison).",
)
@click.option(
    "--timeout-s",
    type=FiniteFloat(0.1, 86400),
    default=600.0,
    show_default=True,
    help="Per-request timeout (whole response).",
)
@click.option(
    "--connect-timeout-s",
    type=FiniteFloat(0.01, 60),
    default=2.0,
    show_default=True,
    help="How long to wait for the TCP connection to an engine; a connect error (this "
    "timeout too) is retried on another engine.",
)
@click.option(
    "--first-byte-timeout-s",
    type=FiniteFloat(0.01, 86400),
    default=30.0,
    show_default=True,
    envvar="REDISBAL_FIRST_BYTE_TIMEOUT_S",
    show_envvar=True,
    help="Streamed requests: the longest wait for an engine's first token; they wait "
    "--first-byte-factor times what the engine usually takes, at least "
    "--first-byte-min-s (10 s until the engine answered one: a fresh server's first "
    "answer is its slowest). Past it the request goes to another engine; when it could "
    "go nowhere else (its last try, every other engine tried, the retry budget spent) "
    "it waits again that long while the engine says requests wait there (queued for "
    "room). Requests not streamed wait for the whole answer (--timeout-s). Either "
    "way, a request to an engine whose reports stopped for longer than they usually "
    "pause (0.5 s at least; 2 s until it answered a request) is given up after 0.25 s.",
)
@click.option(
    "--first-byte-factor",
    type=FiniteFloat(0, 1000),
    default=8.0,
    show_default=True,
    envvar="REDISBAL_FIRST_BYTE_FACTOR",
    show_envvar=True,
    help="Streamed: the first-byte bound as a multiple of the engine's usual time to "
    "its first token (0: always --first-byte-timeout-s).",
)
@click.option(
    "--first-byte-min-s",
    type=FiniteFloat(0.01, 86400),
    default=3.0,
    show_default=True,
    envvar="REDISBAL_FIRST_BYTE_MIN_S",
    show_envvar=True,
    help="Streamed: the first-byte bound is never shorter than this.",
)
@click.option(
    "--idle-timeout-s",
    type=FiniteFloat(0.01, 86400),
    default=10.0,
    show_default=True,
    envvar="REDISBAL_IDLE_TIMEOUT_S",
    show_envvar=True,
    help="A stream with no token for this long ends with an error event (the engine is "
    "ejected); again this long, up to --timeout-s, while the engine says requests wait "
    "there (a request it preempted gets no token until it runs again).",
)
@click.option(
    "--max-attempts",
    type=click.IntRange(1, 10),
    default=3,
    show_default=True,
    envvar="REDISBAL_MAX_ATTEMPTS",
    show_envvar=True,
    help="Engines one request may try before its first byte (1: no retries).",
)
@click.option(
    "--retry-budget",
    type=FiniteFloat(0, 10),
    default=0.2,
    show_default=True,
    envvar="REDISBAL_RETRY_BUDGET",
    show_envvar=True,
    help="Retries at most this share of the requests of the last 10 s (at least 10), so "
    "a deployment-wide problem is not amplified.",
)
@click.option(
    "--eject-max-s",
    type=FiniteFloat(0.05, 3600),
    default=1.0,
    show_default=True,
    envvar="REDISBAL_EJECT_MAX_S",
    show_envvar=True,
    help="Longest back-off of an engine this gateway ejected (the first is an eighth of "
    "it, doubling while its probes fail).",
)
@click.option(
    "--user-key/--no-user-key",
    default=True,
    show_default=True,
    envvar="REDISBAL_USER_KEY",
    show_envvar=True,
    help="Without an X-Redisbal-Key header, the body's user is the request's key: a "
    "user's requests go to one engine while its load allows, for its prefix cache. "
    "The default policy follows users only while users come back (a client that sends "
    "a new user with every request is routed by load); the header is always followed.",
)
@click.option(
    "--prefix-tokens",
    default="off",
    show_default=True,
    envvar="REDISBAL_PREFIX_TOKENS",
    show_envvar=True,
    metavar="off|text|PATH",
    help="Match each request's prompt with what the engines hold in their prefix caches: "
    "what `redisbal kv-events` reports of an engine, else what this gateway sent it "
    "(--prefix-cache-tokens). Name its leading blocks by its text (text: chat and "
    "completions, no tokenizer; matched with what this gateway sent only), by "
    "engine-sim's tokens (sim) or by a Hugging Face tokenizer.json (PATH: completions "
    "only, chat templates are not applied; needs the tokenizers package). off: route "
    "on load and keys alone.",
)
@click.option(
    "--prefix-cache-tokens",
    type=click.IntRange(0, 1 << 30),
    default=LEARNED_TOKENS,
    show_default=True,
    envvar="REDISBAL_PREFIX_CACHE_TOKENS",
    show_envvar=True,
    help="With --prefix-tokens, for an engine without a KV-events view this gateway takes "
    "the prompts it sent there as its cache, remembering this many tokens of them per "
    "engine, least recently sent forgotten first: about an engine's KV cache or more "
    "(vLLM logs its size at start as 'GPU KV cache size'). 0: match KV-events views only.",
)
@click.option(
    "--prefix-max-tokens",
    type=click.IntRange(64, 1 << 20),
    default=8192,
    show_default=True,
    envvar="REDISBAL_PREFIX_MAX_TOKENS",
    show_envvar=True,
    help="--prefix-tokens hashes at most this many leading tokens of a prompt (a real "
    "tokenizer's cost grows with them: docs/GATEWAY.md).",
)
@click.option(
    "--tell-routes/--no-tell-routes",
    default=True,
    show_default=True,
    envvar="REDISBAL_TELL_ROUTES",
    show_envvar=True,
    help="With 2 to 8 gateways, tell the others each route at once (one message per 2 ms "
    "at most, to every other gateway) and count theirs as told between snapshots. Each "
    "message costs its teller and every hearer about 0.06 ms of CPU; without it (on any "
    "gateway: the others fall back too), each counts its own routes by its share.",
)
@click.option(
    "--hold-s",
    type=FiniteFloat(0, 600),
    default=DEFAULT_MAX_S,
    show_default=True,
    envvar="REDISBAL_HOLD_S",
    show_envvar=True,
    help="With the default policy: while every engine is full (at its running cap, "
    "learned from a queue that outlived its report, or its KV cache without room), hold "
    "a request here, at most this long, and send it to the first engine that frees room "
    "(not into one engine's queue). 0: never hold.",
)
@click.option(
    "--max-body-bytes",
    type=click.IntRange(1024, 1 << 30),
    default=4 << 20,
    show_default=True,
    help="Larger request bodies get a 413.",
)
@click.option(
    "--drain-s",
    type=FiniteFloat(0, 3600),
    default=30.0,
    show_default=True,
    help="On SIGTERM: how long to let in-flight requests finish.",
)
@click.option(
    "--refresh-s",
    type=FiniteFloat(0.05, 3600),
    default=1.0,
    show_default=True,
    help="How often to re-read the engine URLs from Redis.",
)
@click.option(
    "--wait-s",
    type=FiniteFloat(0, 3600),
    default=5.0,
    show_default=True,
    help="At start, wait this long for a first snapshot.",
)
@click.option(
    "--event-loop",
    type=click.Choice(["auto", "uvloop", "asyncio"]),
    default="auto",
    show_default=True,
    help="auto: uvloop when installed, else asyncio's own loop.",
)
@exposure_options
@observability_options
@common_options
def gateway(**kw: Any) -> None:
    """OpenAI-compatible gateway: route every request with the shared snapshot.

    Proxies POST /v1/completions and /v1/chat/completions (streamed or not) to
    the chosen engine, serves GET /v1/models, /health and /metrics. Pin with the
    X-data-parallel-rank (rank) or X-Redisbal-Engine (engine id) header. SIGTERM
    stops accepting, drains in-flight requests for --drain-s, then exits 0; a
    second signal stops at once (exit 1 if requests were cut).
    """
    require_extra()
    from redisbal.gateway.guard import raise_nofile

    s = settings()
    nofile = raise_nofile()
    served = exposure(kw, nofile)  # option errors before anything connects
    served["prefix_blocks"] = _prefix_blocks(kw.pop("prefix_tokens"), kw.pop("prefix_max_tokens"))
    cache_tokens = kw.pop("prefix_cache_tokens")
    if served["prefix_blocks"] is not None:
        served["learn_routes"] = learned_anchors(cache_tokens)
    served |= observability(kw)
    url = s.require_url()
    if kw["models"] and kw["engines"]:
        raise click.UsageError(
            "--engine is for one deployment: with --model, engines register their URLs in Redis"
        )
    check_reachable(url)  # a wrong URL or password: one line now, not retries forever
    with redis_errors(url):
        loop = kw.pop("event_loop")
        ok = run_loop(_serve(url, s.deployment, **kw, nofile=nofile, **served), loop)
    if not ok:
        raise click.ClickException("stopped at once with requests in flight")


async def _serve(
    url: str,
    deployment: str,
    *,
    host: str,
    port: int,
    engines: dict[str, str],
    models: dict[str, str],
    client_index: int | str,
    client_count: int,
    lease_ttl_s: float,
    policy: str,
    timeout_s: float,
    connect_timeout_s: float,
    max_body_bytes: int,
    drain_s: float,
    refresh_s: float,
    wait_s: float,
    first_byte_timeout_s: float,
    first_byte_factor: float,
    first_byte_min_s: float,
    idle_timeout_s: float,
    max_attempts: int,
    retry_budget: float,
    eject_max_s: float,
    user_key: bool = True,
    tell_routes: bool = True,
    hold_s: float = DEFAULT_MAX_S,
    learn_routes: int = 0,
    nofile: int = 0,
    **served: Any,
) -> bool:
    from redisbal.connection import make_client
    from redisbal.gateway.deployments import Deployment
    from redisbal.gateway.server import Gateway
    from redisbal.routing.cache_sync import sync_view
    from redisbal.routing.outcomes import OutcomeTracker
    from redisbal.routing.router import AsyncRouter

    # the engines' cache views are read only where prompts are hashed to match them
    events = getattr(served.get("prefix_blocks"), "matches_kv_events", False)
    cache_sync = sync_view if events else None
    if client_index != "auto" and not int(client_index) < client_count:
        raise click.BadParameter(
            f"--client-index {client_index} must be below --client-count {client_count}"
        )

    common: dict[str, Any] = {
        "timeout_s": timeout_s,
        "connect_timeout_s": connect_timeout_s,
        "max_body": max_body_bytes,
        "idle_timeout_s": idle_timeout_s,
        "first_byte_timeout_s": first_byte_timeout_s,
        "max_attempts": max_attempts,
        "user_key": user_key,
    }

    def make_router(name: str) -> AsyncRouter:
        return AsyncRouter(
            url,
            name,
            client_index,
            client_count,
            policy=policy,
            engines=sorted(engines) or None,
            lease_ttl_s=lease_ttl_s,
            suspect_s=eject_max_s,
            tell_routes=tell_routes,
            hold_s=hold_s,
            cache_sync=cache_sync,
            learn_routes=learn_routes,
            outcomes=OutcomeTracker(
                base_s=eject_max_s / 8,
                max_s=eject_max_s,
                first_byte_factor=first_byte_factor,
                first_byte_min_s=min(first_byte_min_s, first_byte_timeout_s),
                first_byte_max_s=first_byte_timeout_s,
            ),
        )

    def make_redis() -> Any:
        return make_client(url, asyncio=True, socket_connect_timeout=1.0, socket_timeout=5.0)

    # each deployment: its own router (its own Redis client inside) and its own client
    # for the engines' URLs, so one deployment's slow Redis never waits another's
    routers: dict[str, AsyncRouter] = {}
    redis_clients: list[Any] = []
    by_model: dict[str, Deployment] | None = None
    if models:
        by_model, by_name = {}, {}
        for model, name in models.items():
            if name not in by_name:
                routers[name] = make_router(name)
                redis_clients.append(make_redis())
                by_name[name] = Deployment(
                    routers[name],
                    redis_client=redis_clients[-1],
                    refresh_s=refresh_s,
                    retry_budget=retry_budget,
                )
            by_model[model] = by_name[name]
        gw = Gateway(models=by_model, **common, **served)
    else:
        routers[deployment] = make_router(deployment)
        redis_clients.append(make_redis())
        gw = Gateway(
            routers[deployment],
            redis_client=redis_clients[0],
            static_urls=engines,
            refresh_s=refresh_s,
            retry_budget=retry_budget,
            **common,
            **served,
        )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await asyncio.gather(*(r.start(wait=wait_s) for r in routers.values()))
        try:
            await gw.start(host, port)
        except OSError as exc:
            raise click.ClickException(f"cannot listen on {host}:{port}: {exc.strerror}") from None
        core = gw.router.core
        scheme = "https" if gw.ssl_context is not None else "http"
        click.echo(
            f"gateway listening on {scheme}://{host}:{gw.ports[0] if gw.ports else port} "
            f"(client {core.client_index} of {core.client_count}, "
            f"{_engines_line(gw)}; open-file limit {nofile}, "
            f"at most {gw.guard.limits.max_connections} client connections)",
            err=True,
        )
        warn_if_open(host, served)
        # What startup made (modules, the app, metrics) lives as long as the process:
        # frozen, a full collection walks only what serving made since (measured at
        # 500 requests/s: 3-19 ms, against 32-83 ms stalling every request in flight).
        gc.collect()
        gc.freeze()
        await stop.wait()
        stop.clear()  # a second signal cuts the drain short
        log.info(
            "gateway: draining %d in-flight requests (up to %.0fs; a second Ctrl-C stops now)",
            gw.inflight, drain_s,
        )  # fmt: skip
        drain, again = asyncio.ensure_future(gw.drain(drain_s)), asyncio.ensure_future(stop.wait())
        await asyncio.wait([drain, again], return_when=asyncio.FIRST_COMPLETED)
        again.cancel()
        if not drain.done():
            drain.cancel()
            log.warning("gateway: stopping now with %d requests in flight", gw.inflight)
            return False
        if not drain.result():
            log.warning(
                "gateway: %d requests still in flight after --drain-s %gs: closing them",
                gw.inflight, drain_s,
            )  # fmt: skip
        return True
    finally:
        await gw.close()
        for r in routers.values():
            await r.aclose()
        for c in redis_clients:
            await c.aclose()


def _prefix_blocks(spec: str, max_tokens: int) -> Any:
    """``--prefix-tokens``'s block hasher (redisbal.gateway.prefix), or a usage error."""
    from redisbal.gateway.prefix import block_hasher

    try:
        return block_hasher(spec, max_tokens)
    except InvalidArgument as exc:
        raise click.BadParameter(str(exc), param_hint="--prefix-tokens") from None


def _engines_line(gw: Gateway) -> str:
    """The engines with URLs at start, per model's deployment when there are models."""
    by_model = gw.models.by_model
    if by_model is None:
        return f"{len(gw.live_engines())} engines with URLs"
    return "models " + ", ".join(
        f"{m} ({d.name}: {len(d.live_engines())} engines)" for m, d in by_model.items()
    )
