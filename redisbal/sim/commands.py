"""The simulator's commands: ``redisbal engine-sim``, ``redisbal api``, ``redisbal demo``.

The operator CLI registers them by name (``redisbal.cli.EXTERNAL_COMMANDS``), so
that ``redisbal --help`` and ``redisbal status`` never import the simulator.
"""

from __future__ import annotations

import asyncio
import sys

import click

from redisbal.cli_common import (
    DURATION_UNTIL_SIGNAL,
    SEED,
    FiniteFloat,
    check_reachable,
    common_options,
    mode_option,
    option,
    policy_option,
    redis_errors,
    run_until_signal,
    settings,
    slow_option,
    stats_out_option,
    write_json,
)
from redisbal.keys import InvalidName, check_name
from redisbal.policies import NoEngines
from redisbal.sim.api_sim import ApiSimRunner, LoadSpec
from redisbal.sim.demo import DemoOptions, run_demo
from redisbal.sim.engine_sim import EngineSimRunner, engine_ids, format_engine_table
from redisbal.sim.model import EngineParams


def parse_slow(values: tuple[str, ...]) -> dict[str, float]:
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


@click.command("engine-sim")
@common_options
@option(
    "--engines",
    "-n",
    type=click.IntRange(1, 1024),
    default=4,
    help="Number of simulated engines in this process.",
)
@option("--id-prefix", default="", help="Engine ids are PREFIX<number>.")
@option(
    "--first-id", type=click.IntRange(0, 10**9), default=0, help="Number of the first engine id."
)
@mode_option(
    "lockstep: all engines step together (a step lasts as long as the slowest); "
    "tick: independent engines on the shared server tick."
)
@option(
    "--running-cap",
    type=click.IntRange(1, 100_000),
    default=64,
    help="Running slots per engine (requests beyond wait).",
)
@option(
    "--base-step-ms",
    type=FiniteFloat(0.1, 10_000),
    default=12.0,
    help="Step time with an empty batch.",
)
@option(
    "--per-seq-ms",
    type=FiniteFloat(0, 1_000),
    default=0.15,
    help="Step time added per running request.",
)
@option(
    "--prefill-ms",
    type=FiniteFloat(0, 1_000),
    default=0.4,
    help="Step time added per request admitted in the step.",
)
@slow_option("Make engines step FACTOR times slower (repeatable), e.g. 3,5:2.0.")
@DURATION_UNTIL_SIGNAL
@stats_out_option("Write the run's per-engine figures as JSON here at the end.")
@option("--summary/--no-summary", default=True, help="Print the per-engine table at the end.")
@option(
    "--report-before-step/--report-after-step-only",
    default=True,
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
    redisbal.sim.transport) and leave the deployment gracefully on SIGINT/SIGTERM.
    """
    s = settings()
    url = s.require_url()
    try:
        ids = engine_ids(engines, id_prefix, first_id)
    except InvalidName as exc:
        raise click.BadParameter(str(exc), param_hint="'--id-prefix' / '--first-id'") from None
    slow_map = parse_slow(slow)
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
        stats = asyncio.run(run_until_signal(runner.run(duration), runner.stop))
    data = stats.to_dict()
    write_json(stats_out, data)
    if summary:
        click.echo(format_engine_table(data))


@click.command()
@common_options
@option(
    "--client-index",
    type=click.IntRange(0, 4095),
    default=0,
    help="API-server index of the first router in this process.",
)
@option(
    "--client-count",
    type=click.IntRange(1, 4096),
    help="API servers in the deployment [default: client-index + routers].",
)
@option(
    "--routers",
    type=click.IntRange(1, 256),
    default=1,
    help="Router instances in this process (indexes client-index, +1, ...).",
)
@policy_option("Routing policy.")
@option(
    "--burst",
    type=click.IntRange(0, 10_000_000),
    default=0,
    help="Requests per burst over ALL API servers (each sends its share).",
)
@option(
    "--burst-window-ms",
    type=FiniteFloat(0, 60_000),
    default=50.0,
    help="A burst is sent within this window.",
)
@option(
    "--burst-every", type=FiniteFloat(0.01, 3600), default=2.0, help="Seconds between burst starts."
)
@option(
    "--rate",
    type=FiniteFloat(0, 1_000_000),
    default=0.0,
    help="Poisson requests/s over ALL API servers (can be combined with bursts).",
)
@option(
    "--duration", type=FiniteFloat(0, 86_400, min_open=True), default=10.0, help="Seconds of load."
)
@option(
    "--mean-output",
    type=FiniteFloat(1, 100_000),
    default=40.0,
    help="Mean output length in tokens (heavy-tailed).",
)
@option(
    "--max-output",
    type=click.IntRange(1, 1_000_000),
    default=2000,
    help="Cap on output lengths (tokens).",
)
@SEED
@click.option(
    "--start-at",
    type=float,
    metavar="UNIX_TIME",
    help="Wall-clock start, so several api processes burst together.",
)
@option(
    "--drain-timeout",
    type=FiniteFloat(0, 3600),
    default=10.0,
    help="After the load, wait this long for completions.",
)
@option(
    "--wait-engines",
    type=FiniteFloat(0, 3600),
    default=10.0,
    help="Wait this long for a first snapshot.",
)
@stats_out_option("Write per-router figures as JSON here at the end.")
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
            result = asyncio.run(run_until_signal(runner.run(), runner.stop))
    except NoEngines as exc:
        raise click.ClickException(str(exc)) from None
    write_json(stats_out, result)
    unfinished = sum(r["unfinished"] for r in result)
    unroutable = sum(r["unroutable"] for r in result)
    if unroutable:
        raise click.ClickException(f"{unroutable} requests found no engine to route to")
    if unfinished:
        raise click.ClickException(
            f"{unfinished} requests did not complete within --drain-timeout {drain_timeout:g}s"
        )


@click.command()
@common_options
@option("--engines", type=click.IntRange(1, 64), default=8, help="Simulated engines.")
@option(
    "--api-servers",
    type=click.IntRange(1, 16),
    default=3,
    help="API-server processes, one router each.",
)
@option("--duration", type=FiniteFloat(0.5, 600), default=6.0, help="Seconds of load.")
@policy_option("Routing policy of the API servers.")
@mode_option("Engine stepping (see engine-sim).")
@option(
    "--running-cap", type=click.IntRange(1, 10_000), default=16, help="Running slots per engine."
)
@option(
    "--burst",
    type=click.IntRange(0, 1_000_000),
    help="Requests per burst [default: 1.5 x engines x running-cap].",
)
@option("--burst-every", type=FiniteFloat(0.1, 600), default=2.0, help="Seconds between bursts.")
@option("--rate", type=FiniteFloat(0, 100_000), default=0.0, help="Background Poisson requests/s.")
@slow_option("Straggler engines, e.g. 0:2.0 (repeatable).")
@SEED
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
    s = settings()
    parse_slow(slow)
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
