"""``redisbal bench``: the click command (registered lazily by the operator CLI)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, replace

import click
from click.core import ParameterSource

from redisbal.bench.balance import percentile
from redisbal.bench.latency import QUALITY_METRICS
from redisbal.bench.plots import pyplot, write_plots
from redisbal.bench.quality import ROUTES_VIEW, VARIANTS, available_policies
from redisbal.bench.quality_report import (
    QualityConfig,
    quality_markdown,
    quality_tables,
    run_quality,
)
from redisbal.bench.report import finite, markdown, summarize, tables
from redisbal.bench.run import LAG_LIMIT_S, RunResult
from redisbal.bench.scale import run_scale, scale_table
from redisbal.bench.scenarios import BENCH_POLICIES, OUT_CAP, OUT_MEAN, OUT_SIGMA, SCENARIO_NAMES
from redisbal.bench.suite import BenchConfig, bench_scenarios, run_all, run_all_simulated
from redisbal.bench.traffic import QUALITY_ENGINE, QUALITY_SCENARIOS, SIZES
from redisbal.ops.cli_options import common_options, settings
from redisbal.routing.cache_view import BLOCK_TOKENS
from redisbal.sim.model import EngineParams
from redisbal.sim.report_as import FEEDS, LOAD_ONLY
from redisbal.sim.workload import Request, TraceError, read_trace


def _csv(value: str | None, allowed: Sequence[str], what: str) -> list[str]:
    if not value:
        return list(allowed)
    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in allowed]
    if bad:
        raise click.BadParameter(
            f"unknown {what}: {', '.join(bad)}; choose from {', '.join(allowed)}"
        )
    return items


def _seeds(value: str | None, quick: bool) -> list[int]:
    if not value:
        return [1] if quick else [1, 2, 3]
    try:
        if value.isdigit() and "," not in value:
            seeds = list(range(1, int(value) + 1))
        else:
            seeds = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        seeds = []
    if not seeds:
        raise click.BadParameter(
            "--seeds takes a count (3) or a list (1,2,5)", param_hint="'--seeds'"
        )
    return seeds


def _metric_help() -> str:
    return "\b\nMetrics (routing quality):\n" + "\n".join(
        f"  {m}: {d}" for m, d in QUALITY_METRICS.items()
    )


@click.command("bench", epilog=_metric_help())
@common_options
@click.option(
    "--real-time",
    is_flag=True,
    help="Run the balance benchmark in real time on Redis (load_imbalance, burst evenness) "
    "instead of the routing-quality benchmark.",
)
@click.option(
    "--sizes",
    default=None,
    help=f"Quality: comma list from {','.join(SIZES)} (API servers x engines). Default all; "
    "64x1024 runs one seed of the poisson scenario unless --scenarios is given.",
)
@click.option(
    "--trace",
    "trace_path",
    default=None,
    help='Quality: replay a JSON-lines trace ({"t": s, "prompt_tokens": n, "output_tokens": n, '
    '"key": optional}) instead of the scenarios.',
)
@click.option(
    "--running-cap",
    type=click.IntRange(1, 100_000),
    default=None,
    help=f"Quality, with --trace: each engine's running slots (default "
    f"{QUALITY_ENGINE.running_cap}; vLLM's max_num_seqs is 256 or more).",
)
@click.option(
    "--kv-tokens",
    type=click.IntRange(1024, 10**9),
    default=None,
    help=f"Quality, with --trace: each engine's KV cache in tokens, its prefix cache in "
    f"the same memory (default {QUALITY_ENGINE.kv_capacity_tokens:,}): smaller, and the "
    "KV cache, not the slots, bounds what an engine runs.",
)
@click.option(
    "--pass-output",
    is_flag=True,
    help="Quality: tell the router each request's output length (default: unknown to it).",
)
@click.option(
    "--report-as",
    type=click.Choice(FEEDS),
    default=None,
    help="Quality: what the engines feed the routers, as engine-sim's --report-as: full "
    "(admitted counts per router, the default), vllm-plugin (the admitted total, the cap "
    "declared), vllm-metrics (the total), sglang (the total, the cap declared), or "
    "load-only (running, waiting and KV usage alone: compact snapshots).",
)
@click.option(
    "--no-admitted",
    is_flag=True,
    help="Quality, deprecated: --report-as load-only, which it meant (no admitted counts, "
    "no total, no cap); vLLM's and SGLang's paths now send a total: --report-as vllm-metrics.",
)
@click.option(
    "--quick",
    is_flag=True,
    help="Balance benchmark: 1 seed, shorter runs (2 bursts, 2 s of Poisson).",
)
@click.option(
    "--seeds",
    default=None,
    help="Seed count (5) or list (1,2,3). Default 5 (balance benchmark: 3, quick: 1).",
)
@click.option(
    "--scenarios",
    default=None,
    help=f"Comma list; quality: {','.join(QUALITY_SCENARIOS)}; "
    f"balance: {','.join(SCENARIO_NAMES)}.",
)
@click.option(
    "--policies",
    default=None,
    help="Comma list; default every policy (the peers' too when present). Quality also "
    "takes the default with one option flipped: redisbal-age, redisbal+speed, redisbal+p2c; "
    "and redisbal+routes, the default matching prompts with what each router sent each "
    "engine (the gateway's --prefix-tokens text without KV events).",
)
@click.option(
    "--router-processes",
    default="",
    help="Scenarios whose routers run in separate processes (e.g. skew).",
)
@click.option(
    "--scale/--no-scale",
    default=None,
    help="With --real-time: also run the 1024 x 64 projection on a simulated clock "
    "(default: on unless --quick).",
)
@click.option(
    "--scale-only", is_flag=True, help="Run only the 1024 x 64 projection (simulated clock)."
)
@click.option(
    "--sim-clock",
    is_flag=True,
    help="Run the scenarios on the discrete-event simulator instead of real time on Redis "
    "(deterministic; no churn). For policy experiments, not for the record.",
)
@click.option(
    "--json", "json_path", metavar="FILE", default=None, help="Write results as JSON here."
)
@click.option(
    "--markdown", "md_path", metavar="FILE", default=None, help="Write the tables as Markdown here."
)
@click.option(
    "--plot",
    "plot_dir",
    metavar="DIR",
    default=None,
    help="Write PNG plots into this directory (needs the plot extra: "
    "pip install 'redisbal[plot]').",
)
def bench_command(
    real_time: bool,
    sizes: str | None,
    trace_path: str | None,
    running_cap: int | None,
    kv_tokens: int | None,
    pass_output: bool,
    report_as: str | None,
    no_admitted: bool,
    quick: bool,
    seeds: str | None,
    scenarios: str | None,
    policies: str | None,
    router_processes: str,
    scale: bool | None,
    scale_only: bool,
    sim_clock: bool,
    json_path: str | None,
    md_path: str | None,
    plot_dir: str | None,
) -> None:
    """Routing quality: every policy on the same LLM-like traffic, on a simulated clock.

    By default: TTFT, latency, goodput and prefix-cache hits of every policy on
    heavy-tailed Poisson, bursts, stragglers and multi-turn sessions, at each size
    (discrete-event simulation, deterministic per seed; progress on stderr).

    With --real-time (or --sim-clock, --scale-only): the balance benchmark on a
    real Redis. Without --redis-url it starts its own redis-server. Each run gets
    a fresh deployment named <prefix>-<scenario>-<policy>-<seed>-<hex>, where the
    prefix is --deployment ("bench" when left at "default").
    """
    balance = real_time or sim_clock or scale_only
    if not balance:
        for flag, given in (
            ("--quick", quick),
            ("--router-processes", bool(router_processes)),
            ("--scale/--no-scale", scale is not None),
            ("--plot", bool(plot_dir)),
        ):
            if given:
                raise click.UsageError(f"{flag} applies to the balance benchmark (--real-time)")
        if (running_cap or kv_tokens) and not trace_path:
            flag = "--running-cap" if running_cap else "--kv-tokens"
            raise click.UsageError(f"{flag} applies to --trace (the scenarios set their engines)")
        kv = kv_tokens or QUALITY_ENGINE.kv_capacity_tokens
        engine = replace(
            QUALITY_ENGINE,
            running_cap=running_cap or QUALITY_ENGINE.running_cap,
            kv_capacity_tokens=kv,
            cache_blocks=kv // BLOCK_TOKENS,
        )
        _quality(
            sizes,
            trace_path,
            pass_output,
            seeds,
            scenarios,
            policies,
            json_path,
            md_path,
            report_as=_feed(report_as, no_admitted),
            engine=engine,
        )
        return
    for flag, used in (
        ("--sizes", bool(sizes)),
        ("--trace", bool(trace_path)),
        ("--running-cap", running_cap is not None),
        ("--kv-tokens", kv_tokens is not None),
        ("--pass-output", pass_output),
        ("--report-as", report_as is not None),
        ("--no-admitted", no_admitted),
    ):
        if used:
            raise click.UsageError(f"{flag} applies to the routing-quality benchmark")
    ctx = click.get_current_context()
    level_given = any(
        c.get_parameter_source("log_level") not in (None, ParameterSource.DEFAULT)
        for c in (ctx, ctx.parent)
        if c is not None
    )
    opts = settings()
    if not level_given:  # dozens of coordinators start and stop: only warnings by default
        logging.getLogger().setLevel(logging.WARNING)
    redis_url = opts.redis_url
    prefix = "bench" if opts.deployment == "default" else opts.deployment
    if len(prefix) > 24:
        raise click.BadParameter(
            f"bench uses it as a prefix of its runs' deployment names: at most 24 characters, "
            f"got {len(prefix)}",
            param_hint="--deployment",
        )
    if plot_dir:
        pyplot()  # fail early with the install hint
    chosen = _csv(scenarios, SCENARIO_NAMES, "scenario")
    if sim_clock and not scenarios and "churn" in chosen:
        chosen.remove("churn")  # the simulated clock has no membership model
        click.echo("--sim-clock: skipping churn (it needs real membership)", err=True)
    cfg = BenchConfig(
        scenarios=chosen,
        policies=_csv(policies, BENCH_POLICIES, "policy"),
        seeds=_seeds(seeds, quick),
        quick=quick,
        redis_url=redis_url,
        prefix=prefix,
        router_processes=_csv(router_processes, SCENARIO_NAMES, "scenario")
        if router_processes
        else [],
    )
    t0 = time.monotonic()
    load0 = os.getloadavg()[0]
    if scale_only:
        results: list[RunResult] = []
    elif sim_clock:
        results = run_all_simulated(cfg)
    else:
        results = asyncio.run(run_all(cfg))
    elapsed = time.monotonic() - t0
    doc = summarize(results, cfg.policies)
    scen = bench_scenarios(cfg)
    lags = [r.health["lag_p99_s"] for r in results]
    bad = [r for r in results if r.health["lag_p99_s"] > LAG_LIMIT_S]
    doc["meta"] = {
        "argv": ["redisbal", *sys.argv[1:]],  # (not where this install lives)
        "clock": "simulated (discrete-event), no Redis" if sim_clock else "real time on Redis",
        "quick": quick,
        "seeds": cfg.seeds,
        "elapsed_s": round(elapsed, 1),
        "nproc": os.cpu_count(),
        "loadavg_start": load0,
        "loadavg_end": os.getloadavg()[0],
        "lag_p99_s_median": percentile(lags, 50),
        "lag_p99_s_max": max(lags) if lags else 0.0,
        "runs_over_lag_limit": len(bad),
        "lag_limit_s": LAG_LIMIT_S,
        "scenarios": {s: asdict(sc) for s, sc in scen.items()},
        "output_len": {"mean": OUT_MEAN, "sigma": OUT_SIGMA, "cap": OUT_CAP},
        "engine": asdict(EngineParams()),
    }
    do_scale = scale_only or ((not quick) if scale is None else scale)
    if do_scale:
        click.echo("scale projection: 1024 engines x 64 routers on a SIMULATED clock", err=True)
        doc["scale"] = run_scale(cfg.policies, cfg.seeds[:1])
    click.echo(tables(doc, scen))
    if "scale" in doc:
        click.echo(scale_table(doc["scale"]))
    click.echo(
        f"\nharness: {len(results)} runs in {elapsed:.0f} s; event-loop lag p99 median "
        f"{doc['meta']['lag_p99_s_median'] * 1000:.1f} ms, "
        f"max {doc['meta']['lag_p99_s_max'] * 1000:.1f} ms; "
        f"load average {load0:.2f} -> {doc['meta']['loadavg_end']:.2f} on {os.cpu_count()} cores"
    )
    if bad:
        click.echo(
            f"WARNING: {len(bad)} of {len(results)} runs had event-loop lag p99 above "
            f"{LAG_LIMIT_S * 1000:.0f} ms (marked '!'): the machine was too loaded for those "
            "real-time runs to be fully trusted."
        )
    if json_path:
        with open(json_path, "w") as f:
            json.dump(finite(doc), f, indent=1, allow_nan=False)
        click.echo(f"wrote {json_path}")
    if md_path:
        with open(md_path, "w") as f:
            f.write(markdown(doc))
        click.echo(f"wrote {md_path}")
    if plot_dir:
        for p in write_plots(results, doc, plot_dir):
            click.echo(f"wrote {p}")


def _feed(report_as: str | None, no_admitted: bool) -> str:
    """The quality benchmark's feed: ``--report-as``, or ``--no-admitted``'s (deprecated)."""
    if no_admitted:
        if report_as is not None:
            raise click.UsageError("--no-admitted is --report-as load-only: give one of them")
        click.echo(
            "--no-admitted is deprecated: it is --report-as load-only (no admitted total "
            "either); vLLM's and SGLang's paths feed more (--report-as vllm-metrics)",
            err=True,
        )
        return LOAD_ONLY
    return report_as or "full"


def _read_trace(path: str, clients: int) -> list[Request]:
    try:
        return read_trace(path, clients)
    except TraceError as e:
        raise click.ClickException(f"{path}: {e}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise click.ClickException(f"cannot read trace {path}: {e}") from None


def _quality(
    sizes: str | None,
    trace_path: str | None,
    pass_output: bool,
    seeds: str | None,
    scenarios: str | None,
    policies: str | None,
    json_path: str | None,
    md_path: str | None,
    report_as: str = "full",
    engine: EngineParams = QUALITY_ENGINE,
) -> None:
    """The routing-quality benchmark (``redisbal.bench.quality_report``)."""
    if trace_path:
        if scenarios:
            raise click.UsageError("--trace replaces the scenarios: give one or the other")
        _read_trace(trace_path, 1)  # a bad file fails here, before any run
    size_list = _csv(sizes, list(SIZES), "size")
    if trace_path and not sizes:
        size_list = ["8x32"]
    cfg = QualityConfig(
        policies=(
            _csv(policies, [*available_policies(), *VARIANTS, ROUTES_VIEW], "policy")
            if policies
            else available_policies()
        ),
        seeds=_seeds(seeds, False) if seeds else [1, 2, 3, 4, 5],
        sizes=size_list,
        scenarios=_csv(scenarios, QUALITY_SCENARIOS, "scenario") if scenarios else None,
        trace_name=trace_path or "",
        pass_output=pass_output,
        report_as=report_as,
        engine=engine,
    )
    t0 = time.monotonic()
    load0 = os.getloadavg()[0]
    if trace_path:
        # each request's API server is drawn among the size's API servers
        docs = [
            run_quality(replace(cfg, sizes=[s], trace=_read_trace(trace_path, SIZES[s][0])))
            for s in cfg.sizes
        ]
        doc = docs[0]
        for d in docs[1:]:
            doc["runs"] += d["runs"]
            doc["scenarios"].update(d["scenarios"])
            doc["summary"].update(d["summary"])
    else:
        doc = run_quality(cfg)
    doc["elapsed_s"] = round(time.monotonic() - t0, 1)
    doc["loadavg_start"] = load0
    doc["meta"] = {
        "argv": ["redisbal", *sys.argv[1:]],  # (not where this install lives)
        "seeds": cfg.seeds,
        "policies": cfg.policies,
        "pass_output": pass_output,
        "report_as": report_as,
        "trace": trace_path,
        "nproc": os.cpu_count(),
        "loadavg_end": os.getloadavg()[0],
        "engine": asdict(engine),
    }
    click.echo(quality_tables(doc))
    click.echo(
        f"\n{len(doc['runs'])} runs in {doc['elapsed_s']:.0f} s; load average "
        f"{doc.get('loadavg_start', float('nan')):.2f} -> {doc['meta']['loadavg_end']:.2f} "
        f"on {os.cpu_count()} cores"
    )
    if json_path:
        with open(json_path, "w") as f:
            json.dump(finite(doc), f, indent=1, allow_nan=False)
        click.echo(f"wrote {json_path}")
    if md_path:
        with open(md_path, "w") as f:
            f.write(quality_markdown(doc))
        click.echo(f"wrote {md_path}")


def main() -> None:
    bench_command(prog_name="redisbal bench")


if __name__ == "__main__":
    main()
