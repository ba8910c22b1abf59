"""``redisbal loadgen``: an open-loop load generator for any OpenAI-compatible URL.

Open loop: requests are sent on a schedule (Poisson arrivals at ``--rate``, or
bursts of ``--burst`` requests every ``--burst-every-s``), never waiting for
earlier answers, so a slow server sees its queue grow as it would in production.
Prompt and output lengths are heavy-tailed (lognormal); a trace file of JSON
lines ``{"t", "prompt_tokens", "output_tokens", "key"}`` replays a recorded
schedule instead. Reports TTFT, inter-token latency and end-to-end latency
(p50/p99), throughput, errors and, with ``--slo-ttft-ms``, goodput (requests per
second of load answered within that TTFT); ``--json`` for machines. Several ``--url``
(gateway replicas) share the requests in turn, and each gets its own figures too.
``--split S`` sends the first URL a share S of the requests instead (the others share
the rest in turn), drawn per request from ``--seed``. ``lag_p99_ms`` says how late
the generator itself sent requests (if it is large, the figures measure the
generator, not the server). The requests' schedule, sizes and prompts are drawn in
``redisbal.sim.load_plan``, which the demo reads too.
"""

from __future__ import annotations

import asyncio
import math
import random
import sys
from dataclasses import dataclass, field
from typing import Any

import click
import orjson

from redisbal.ops.cli_options import (
    FiniteFloat,
    common_options,
    run_until_signal,
    settings,
    stats_out_option,
    write_json,
)
from redisbal.sim.load_plan import Planned, plan, read_trace, session_prompts

# -- the figures of a run: each request's outcome, and the summary of many ----------------


@dataclass(slots=True)
class Result:
    ok: bool
    status: int
    lag: float  # how late it was sent, s
    ttft: float | None = None
    e2e: float = 0.0
    tokens: int = 0
    gaps: list[float] = field(default_factory=list)
    error: str | None = None
    target: int = 0  # which of the URLs it went to


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def summarize(
    results: list[Result],
    elapsed: float,
    slo_ttft_s: float | None = None,
    window_s: float | None = None,
) -> dict[str, Any]:
    ok = [r for r in results if r.ok]

    def ms(v: float | None) -> float | None:
        return None if v is None else round(v * 1000, 3)

    ttft = [r.ttft for r in ok if r.ttft is not None]
    gaps = [g for r in ok for g in r.gaps]
    e2e = [r.e2e for r in ok]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error or "?"] = errors.get(r.error or "?", 0) + 1
    return {
        "requests": len(results),
        "ok": len(ok),
        "errors": errors,
        "elapsed_s": round(elapsed, 3),
        "throughput_rps": round(len(ok) / elapsed, 2) if elapsed > 0 else None,
        "tokens_per_s": round(sum(r.tokens for r in ok) / elapsed, 1) if elapsed > 0 else None,
        "ttft_p50_ms": ms(percentile(ttft, 0.5)),
        "ttft_p99_ms": ms(percentile(ttft, 0.99)),
        "itl_p50_ms": ms(percentile(gaps, 0.5)),
        "itl_p99_ms": ms(percentile(gaps, 0.99)),
        "e2e_p50_ms": ms(percentile(e2e, 0.5)),
        "e2e_p99_ms": ms(percentile(e2e, 0.99)),
        "lag_p99_ms": ms(percentile([r.lag for r in results], 0.99)),
        **_goodput(ttft, len(results), window_s or elapsed, slo_ttft_s),
    }


def _goodput(
    ttft: list[float], requests: int, window: float, slo_ttft_s: float | None
) -> dict[str, Any]:
    """Requests answered with their first token within the TTFT objective: per second of
    the load's window (``--duration``; the same for every server given the same
    schedule, unlike the run's end, which one long answer moves) and as a share of all
    requests sent."""
    if slo_ttft_s is None:
        return {}
    good = sum(t <= slo_ttft_s for t in ttft)
    return {
        "slo_ttft_ms": round(slo_ttft_s * 1000, 3),
        "goodput_rps": round(good / window, 2) if window > 0 else None,
        "slo_attainment": round(good / requests, 4) if requests else None,
    }


# -- sending ---------------------------------------------------------------------------------


def split_targets(n: int, urls: int, share: float | None, seed: int) -> list[int]:
    """Which URL each of ``n`` requests goes to: in turn, or with ``share`` the first URL
    with that probability (drawn per request index from ``seed``) and the others in turn
    with the rest; the same seed gives every server under test the same assignment."""
    if share is None or urls < 2:
        return [k % urls for k in range(n)]
    rng = random.Random(f"split-{seed}")
    out, rest = [], 0
    for _ in range(n):
        if rng.random() < share:
            out.append(0)
        else:
            out.append(1 + rest % (urls - 1))
            rest += 1
    return out


def request_body(p: Planned, opts: dict[str, Any]) -> dict[str, Any]:
    """The OpenAI body of one request: its text (or filler of its length), and its key
    as ``user`` if it has one (a trace's ``thread`` is never sent)."""
    body: dict[str, Any] = {
        "model": opts["model"],
        "max_tokens": p.output_tokens,
        "stream": opts["stream"],
        "ignore_eos": opts["ignore_eos"],
    }
    text = p.text if p.text is not None else "x" * (4 * p.prompt_tokens - 1)
    if opts["chat"]:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    if p.key is not None:
        body["user"] = p.key
    return body


async def _one(session: Any, url: str, p: Planned, start: float, opts: dict[str, Any]) -> Result:
    import aiohttp

    loop = asyncio.get_running_loop()
    delay = start + p.t - loop.time()
    if delay > 0:
        await asyncio.sleep(delay)
    t0 = loop.time()
    lag = max(0.0, t0 - (start + p.t))
    body = request_body(p, opts)
    try:
        async with session.post(url, data=orjson.dumps(body), headers=opts["headers"]) as r:
            if r.status != 200:
                await r.read()
                return Result(False, r.status, lag, e2e=loop.time() - t0, error=f"http {r.status}")
            if not opts["stream"]:
                data = orjson.loads(await r.read())
                e2e = loop.time() - t0
                usage = data.get("usage") or {}
                return Result(
                    True, 200, lag, ttft=e2e, e2e=e2e, tokens=int(usage.get("completion_tokens", 0))
                )
            res = Result(True, 200, lag)
            last = None
            async for line in r.content:
                if not line.startswith(b"data: "):
                    continue
                now = loop.time()
                payload = line[6:].strip()
                if payload == b"[DONE]":
                    break
                if b'"error"' in payload and b'"choices"' not in payload:
                    res.ok, res.error = False, "error event"
                    break
                if b'"choices":[]' in payload:  # the usage chunk
                    continue
                res.tokens += 1
                if last is None:
                    res.ttft = now - t0
                else:
                    res.gaps.append(now - last)
                last = now
            res.e2e = loop.time() - t0
            return res
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return Result(False, 0, lag, e2e=loop.time() - t0, error=type(exc).__name__)


async def _sent(
    session: Any, url: str, p: Planned, start: float, opts: dict[str, Any], i: int
) -> Result:
    res = await _one(session, url, p, start, opts)
    res.target = i
    return res


async def run(url: str | list[str], planned: list[Planned], opts: dict[str, Any]) -> dict[str, Any]:
    """Send ``planned`` open loop, request k to ``urls[opts["targets"][k]]`` (default: in
    turn); the summary."""
    import aiohttp

    urls = [url] if isinstance(url, str) else url
    path = "/v1/chat/completions" if opts["chat"] else "/v1/completions"
    targets = [u.rstrip("/") + path for u in urls]
    timeout = aiohttp.ClientTimeout(total=opts["timeout"])
    conn = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
    loop = asyncio.get_running_loop()
    results: list[Result] = []
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        start = loop.time() + 0.05
        to = opts.get("targets") or [k % len(targets) for k in range(len(planned))]
        tasks = [
            loop.create_task(_sent(session, targets[to[k]], p, start, opts, to[k]))
            for k, p in enumerate(planned)
        ]
        total = len(tasks)
        pending = set(tasks)
        next_progress = loop.time() + 5
        stop: asyncio.Event | None = opts.get("stop")
        while pending and not (stop is not None and stop.is_set()):
            done, pending = await asyncio.wait(pending, timeout=0.25)
            results += [t.result() for t in done]
            if opts["progress"] and loop.time() >= next_progress:
                next_progress = loop.time() + 5
                errs = sum(not r.ok for r in results)
                print(
                    f"loadgen: {len(results)}/{total} done, {errs} errors",
                    file=sys.stderr,
                    flush=True,
                )
        elapsed = loop.time() - start
        for t in pending:  # interrupted: requests not sent or not answered yet
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    slo, window = opts.get("slo_ttft_s"), opts.get("window_s")
    summary = summarize(results, elapsed, slo, window)
    if pending:
        summary["unfinished"] = len(pending)
    if len(urls) > 1:
        summary["per_url"] = {
            u: summarize([r for r in results if r.target == i], elapsed, slo, window)
            for i, u in enumerate(urls)
        }
    return summary


@click.command("loadgen")
@click.option(
    "--url",
    "urls",
    required=True,
    multiple=True,
    help="Base URL of an OpenAI-compatible server (repeat: requests take the URLs in turn).",
)
@click.option(
    "--rate",
    type=FiniteFloat(0.01, 100000),
    default=50.0,
    show_default=True,
    help="Mean requests per second (Poisson).",
)
@click.option(
    "--duration",
    type=FiniteFloat(0.1, 86400),
    default=10.0,
    show_default=True,
    help="Seconds of arrivals (then it waits for the requests still running).",
)
@click.option(
    "--arrival",
    type=click.Choice(["poisson", "bursts"]),
    default="poisson",
    show_default=True,
    help="poisson: --rate on average; bursts: --burst requests at once every --burst-every-s.",
)
@click.option(
    "--burst",
    type=click.IntRange(1, 100000),
    default=100,
    show_default=True,
    help="With --arrival bursts: requests per burst.",
)
@click.option(
    "--burst-every-s",
    type=FiniteFloat(0.001, 3600),
    default=1.0,
    show_default=True,
    help="With --arrival bursts: seconds between bursts.",
)
@click.option(
    "--prompt-mean",
    type=FiniteFloat(1, 100000),
    default=200.0,
    show_default=True,
    help="Mean prompt length (tokens).",
)
@click.option(
    "--output-mean",
    type=FiniteFloat(1, 100000),
    default=40.0,
    show_default=True,
    help="Mean output length (tokens, the request's max_tokens).",
)
@click.option(
    "--max-output",
    type=click.IntRange(1, 1_000_000),
    default=8192,
    show_default=True,
    help="Cap on output lengths (tokens).",
)
@click.option(
    "--sigma",
    type=FiniteFloat(0, 3),
    default=1.0,
    show_default=True,
    help="Lognormal sigma of both lengths (0: fixed lengths).",
)
@click.option(
    "--trace",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help='JSON lines {"t", "prompt_tokens", "output_tokens", "key"} to replay.',
)
@click.option(
    "--session-prompts",
    is_flag=True,
    help="With --trace: prompts shaped like conversations (a key's prompts share its "
    "history as prefix, starting with the shared system prompt the trace's optional "
    '"system" and "system_tokens" name), so engines with a prefix cache reuse it.',
)
@click.option(
    "--split",
    type=FiniteFloat(0, 1),
    default=None,
    help="The first --url's share of the requests (drawn per request from --seed); the "
    "others share the rest in turn [default: every URL in turn].",
)
@click.option(
    "--stream/--no-stream",
    default=True,
    show_default=True,
    help="Streamed responses (SSE); without, TTFT is the whole response's time and ITL "
    "is not measured.",
)
@click.option(
    "--chat/--completions",
    default=False,
    show_default=True,
    help="POST /v1/chat/completions or /v1/completions.",
)
@click.option(
    "--model", default="redisbal-sim", show_default=True, help="The model name requests carry."
)
@click.option(
    "--ignore-eos/--no-ignore-eos",
    default=True,
    show_default=True,
    help="Ask for exactly the output length (vLLM's ignore_eos).",
)
@click.option(
    "--api-key",
    envvar="OPENAI_API_KEY",
    show_envvar=True,
    default=None,
    help="Bearer token sent with every request.",
)
@click.option(
    "--timeout-s",
    type=FiniteFloat(0.1, 86400),
    default=600.0,
    show_default=True,
    help="Per-request timeout (whole response); a request past it counts as an error.",
)
@click.option(
    "--seed", type=int, default=0, show_default=True, help="Seed of arrivals and lengths."
)
@click.option(
    "--slo-ttft-ms",
    type=FiniteFloat(0.001, 86_400_000),
    default=None,
    help="TTFT objective: also report goodput, the requests per second of load "
    "(--duration) answered within it.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@stats_out_option("Also write the summary as JSON here.")
@click.option(
    "--progress/--no-progress",
    default=True,
    show_default=True,
    help="A line on stderr every 5 s: requests done and errors so far.",
)
@common_options
def loadgen(**kw: Any) -> None:
    """Open-loop load against an OpenAI-compatible URL; TTFT, ITL, latency, errors.

    Needs no Redis: the shared --redis-url / --deployment options are accepted
    (every redisbal command takes them) and unused.
    """
    settings()  # logging
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        raise click.ClickException(
            "loadgen needs the 'gateway' extra (aiohttp is missing): "
            "pip install 'redisbal[gateway]'"
        ) from None
    from redisbal.endpoints import InvalidURL, check_url

    try:
        urls = [check_url(u, "--url") for u in kw["urls"]]
    except InvalidURL as exc:
        raise click.BadParameter(str(exc)) from None
    if kw["trace"]:
        planned = read_trace(kw["trace"])
        if kw["session_prompts"]:
            session_prompts(planned, kw["seed"])
    else:
        planned = plan(
            rate=kw["rate"],
            duration=kw["duration"],
            arrival=kw["arrival"],
            burst=kw["burst"],
            burst_every=kw["burst_every_s"],
            prompt_mean=kw["prompt_mean"],
            output_mean=kw["output_mean"],
            sigma=kw["sigma"],
            seed=kw["seed"],
            output_cap=kw["max_output"],
        )
    if not planned:
        raise click.UsageError(
            f"nothing to send: {kw['trace']} has no requests"
            if kw["trace"]
            else "nothing to send: no request falls within --duration at this --rate"
        )
    if kw["split"] is not None and len(urls) < 2:
        raise click.BadParameter("needs two --url or more", param_hint="'--split'")
    headers = {"Content-Type": "application/json"}
    if kw["api_key"]:
        headers["Authorization"] = f"Bearer {kw['api_key']}"
    opts = {
        "model": kw["model"],
        "stream": kw["stream"],
        "chat": kw["chat"],
        "ignore_eos": kw["ignore_eos"],
        "headers": headers,
        "timeout": kw["timeout_s"],
        "progress": kw["progress"] and not kw["as_json"],
        "slo_ttft_s": None if kw["slo_ttft_ms"] is None else kw["slo_ttft_ms"] / 1000,
        "window_s": max((p.t for p in planned), default=0.0) if kw["trace"] else kw["duration"],
        "targets": split_targets(len(planned), len(urls), kw["split"], kw["seed"]),
    }

    async def main() -> dict[str, Any]:
        opts["stop"] = stop = asyncio.Event()
        return await run_until_signal(run(urls, planned, opts), stop.set)

    summary = asyncio.run(main())
    summary["url"] = urls[0] if len(urls) == 1 else urls
    write_json(kw["stats_out"], summary)
    if kw["as_json"]:
        click.echo(orjson.dumps(summary, option=orjson.OPT_INDENT_2).decode())
    else:
        per_url = summary.pop("per_url", {})
        for k, v in summary.items():
            click.echo(f"{k:>16}: {v}")
        for u, d in per_url.items():
            click.echo(
                f"{u}: {d['ok']}/{d['requests']} ok, TTFT p50 {d['ttft_p50_ms']} ms, "
                f"p99 {d['ttft_p99_ms']} ms"
            )
    if summary.get("unfinished"):  # SIGINT/SIGTERM: the figures are of a partial run
        click.echo(
            f"loadgen: interrupted: figures of the {summary['requests']} finished requests; "
            f"{summary['unfinished']} of {len(planned)} unfinished (not counted)",
            err=True,
        )
        raise SystemExit(130)
    if summary["requests"] and not summary["ok"]:  # the figures above say why
        raise click.ClickException(f"none of the {summary['requests']} requests succeeded")
