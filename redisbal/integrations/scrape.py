"""``redisbal scrape``: a sidecar that turns engines' Prometheus /metrics into reports.

Every ``--interval`` it reads each ``--metrics-url`` (concurrently, one task per
URL), takes every engine on the page (vLLM: one per ``engine`` label, SGLang: one
per ``dp_rank``) and hands its counts to one :class:`CountsRelay`, which reports
them in tick mode: a page has no step tag, so the barrier tags each report with
the server's tick.

Each report carries the engine's admitted total where the page gives its finished
requests (vLLM's ``vllm:request_success_total``, SGLang's ``sglang:num_requests_total``;
``metrics_page``): finished + waiting + running, which routers reconcile their routes
with (routing/admit_total.py).

Progress, not pulse: a page whose progress counters (vLLM's iteration and token
counters, SGLang's token counters) did not move since the last scrape is
reported as "no progress", so an engine whose loop hangs while its API server
still serves /metrics stalls (not routed to) once it has work and
``stall_after_ms`` pass. A page without those counters counts as progress.

The engines' running cap (how many requests each runs at once) is declared once
per engine (``redisbal.running_caps``): from ``--max-num-seqs`` (what ``vllm serve``
was given: vLLM's /metrics carries no cap), else from SGLang's ``GET /v1/loads``
(``max_running_requests`` per ``dp_rank``), asked once per server before its engines
are first added (vLLM answers 404 there: no cap, learned from queues as before; a
server that does not answer it is not asked again).

A scrape that fails (refused, HTTP error, timeout, a page without the counts) is
never reported as idle: the engines of that URL are paused, so they stop
reporting, the barrier stops waiting for them once the stall guard runs, and
they expire after ``dead_after_ms``; a rate-limited warning says why. They come
back with the next good scrape. A refused or wrong answer also marks them
suspect, so routers keep to probes until a request is answered there. A slow
page does not: a busy engine can serve /metrics late (vLLM on CPU, under load)
and still answer its requests; its silence keeps new requests away meanwhile,
and the requests it answers, or fails, say the rest.
"""

from __future__ import annotations

import asyncio
import logging
import re
import string
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import click

try:
    import aiohttp
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "redisbal scrape needs the 'scrape' extra: pip install 'redisbal[scrape]' "
        f"(missing {exc.name})"
    ) from exc

from redisbal.connection import redact
from redisbal.endpoints import InvalidURL, check_url
from redisbal.errors import InvalidArgument
from redisbal.errors import SidecarError as SidecarError
from redisbal.integrations.metrics_page import EngineSample, PageError, parse_page
from redisbal.integrations.relay import CountsRelay, RateLimitedLog, sanitise
from redisbal.keys import InvalidName, check_name
from redisbal.ops.cli_options import check_reachable, common_options, run_until_signal, settings
from redisbal.reporting.counts import Counts
from redisbal.running_caps import MAX_RUNNING_CAP, check_running_cap

log = logging.getLogger("redisbal.scrape")

DEFAULT_TEMPLATE = "{host}-{port}-{engine}"
FIELDS = ("host", "port", "engine", "index")


def check_template(template: str) -> str:
    """Raise SidecarError unless ``template`` uses only the known fields."""
    try:
        names = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as exc:
        raise SidecarError(f"bad --engine-id template {template!r}: {exc}") from None
    unknown = [n for n in names if n not in FIELDS]
    if unknown:
        raise SidecarError(
            f"unknown field {{{unknown[0]}}} in --engine-id {template!r}; "
            f"use {', '.join('{' + f + '}' for f in FIELDS)}"
        )
    # with every field at its shortest ("0"), a template that gives no valid name never
    # will (its own text is not name characters, or too long): say so now, not at the
    # first engine a page shows
    try:
        check_name(template.format(**dict.fromkeys(FIELDS, "0")).lstrip("-_."), "engine id")
    except InvalidName as exc:
        raise SidecarError(f"--engine-id {template!r} never gives a valid name: {exc}") from None
    return template


@dataclass
class Target:
    """One /metrics URL and where the gateway sends that server's requests."""

    index: int
    metrics_url: str
    engine_url: str
    host: str = ""
    port: str = ""
    engines: dict[str, str] = field(default_factory=dict)  # label value -> engine id
    caps: dict[str, int] | None = None  # label -> SGLang's max_running_requests (None: unasked)

    @classmethod
    def make(cls, index: int, metrics_url: str, engine_url: str | None = None) -> Target:
        parts = urlsplit(metrics_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise SidecarError(
                f"--metrics-url {metrics_url!r}: expected http(s)://host:port/metrics"
            )
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            raise SidecarError(f"--metrics-url {metrics_url!r}: bad port") from None
        origin = f"{parts.scheme}://{parts.netloc}"
        try:  # checked now: the sender would refuse it when it first registers the engine
            url = check_url(engine_url or origin, "--engine-url" if engine_url else "engine url")
        except InvalidURL as exc:
            raise SidecarError(f"{exc} (for --metrics-url {redact(metrics_url)})") from None
        return cls(index, metrics_url, url, parts.hostname, str(port))


class Sidecar:
    """Scrapes several /metrics URLs and reports their engines through one sender."""

    def __init__(
        self,
        sender: CountsRelay,
        targets: list[Target],
        *,
        template: str = DEFAULT_TEMPLATE,
        interval_s: float = 0.05,
        timeout_s: float = 1.0,
        running_cap: int | None = None,
    ) -> None:
        self.sender = sender
        # every engine's declared cap (--max-num-seqs); None: SGLang's /v1/loads, if any
        self.running_cap = None if running_cap is None else check_running_cap(running_cap)
        self.targets = targets
        self.template = check_template(template)
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.warn = RateLimitedLog(log)
        self._owners: dict[str, tuple[int, str]] = {}  # engine id -> (target, label)
        self._progress: dict[str, float | None] = {}  # engine id -> its progress counters
        self.scrapes = 0
        self.failures = 0

    def engine_id(self, target: Target, label: str) -> str:
        eid = self.template.format(
            host=sanitise(target.host),
            port=sanitise(target.port),
            engine=sanitise(label),
            index=target.index,
        ).lstrip("-_.")  # a name starts with a letter or digit ("::1" -> "1")
        try:
            check_name(eid, "engine id")
        except InvalidName as exc:
            raise SidecarError(f"--engine-id {self.template!r} gives {exc}") from None
        owner = self._owners.setdefault(eid, (target.index, label))
        if owner != (target.index, label):
            other = self.targets[owner[0]].metrics_url
            raise SidecarError(
                f"--engine-id {self.template!r} gives {eid!r} to two engines ({other} "
                f"engine {owner[1]} and {target.metrics_url} engine {label}); "
                "add {engine}, {host}-{port} or {index}"
            )
        return eid

    async def fetch(self, session: aiohttp.ClientSession, target: Target) -> list[EngineSample]:
        """One scrape; raises PageError, aiohttp.ClientError or asyncio.TimeoutError."""
        async with session.get(target.metrics_url) as resp:
            if resp.status != 200:
                raise PageError(f"HTTP {resp.status}")
            text = await resp.text()
        return parse_page(text)

    async def fetch_caps(self, session: aiohttp.ClientSession, target: Target) -> None:
        """Once per target, before its engines are first added, and only without
        ``--max-num-seqs``: SGLang's ``max_running_requests`` per ``dp_rank`` from
        ``GET /v1/loads`` at the metrics URL's server into ``target.caps``; none where
        there is none (vLLM: 404), or where it did not answer (a slow server is not
        asked again: its engines are reported meanwhile, and a cap is declared when an
        engine is added)."""
        if self.running_cap is not None or target.caps is not None:
            return
        target.caps = {}
        parts = urlsplit(target.metrics_url)
        url = f"{parts.scheme}://{parts.netloc}/v1/loads"
        try:
            async with session.get(url) as resp:
                if resp.status != 200:
                    return
                data = await resp.json(content_type=None)
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError) as exc:
            log.info("scrape: no running caps from %s: %s", url, type(exc).__name__)
            return
        target.caps = loads_caps(data)
        if target.caps:
            log.info("scrape: %s declares running caps %s", url, target.caps)

    def cap_for(self, target: Target, label: str) -> int | None:
        """The running cap declared for the engine ``label`` of ``target``."""
        if self.running_cap is not None:
            return self.running_cap
        return (target.caps or {}).get(label)

    def apply(self, target: Target, samples: list[EngineSample]) -> None:
        """Hand a good scrape's counts to the sender; engines gone from the page pause."""
        seen = set()
        for s in samples:
            eid = target.engines.get(s.engine)
            if eid is None:
                eid = target.engines[s.engine] = self.engine_id(target, s.engine)
                self.sender.add(eid, target.engine_url, self.cap_for(target, s.engine))
                log.info("scrape: %s engine %s reports as %s", target.metrics_url, s.engine, eid)
            seen.add(s.engine)
            # progress: the page's progress counters moved (unknown without them)
            last, self._progress[eid] = self._progress.get(eid), s.progress
            progress = s.progress is None or s.progress != last
            counts = Counts(
                None,
                s.waiting,
                s.running,
                kv_usage=s.kv_usage,
                progress=progress,
                admitted_total=s.admitted_total,
            )
            self.sender.submit(eid, counts)
        for label, eid in target.engines.items():
            if label not in seen:
                self.sender.pause(eid)
                self.warn.warning(
                    f"gone:{eid}",
                    "scrape: %s no longer shows engine %s (%s): not reporting it",
                    target.metrics_url,
                    label,
                    eid,
                )

    def fail(self, target: Target, reason: str, suspect: bool = True) -> None:
        """A failed scrape: silence the target's engines and never report them idle;
        with ``suspect``, have routers avoid them (but for probes) until they answer."""
        self.failures += 1
        for eid in target.engines.values():
            self.sender.pause(eid)
            if suspect:
                self.sender.suspect(eid, f"scrape of {target.metrics_url} failed: {reason}")
        self.warn.warning(
            f"fail:{target.index}",
            "scrape: %s failed (%s): its engines %s stop reporting until it answers again",
            target.metrics_url,
            reason,
            ", ".join(target.engines.values()) or "(none seen yet)",
        )

    async def scrape_once(self, session: aiohttp.ClientSession, target: Target) -> bool:
        self.scrapes += 1
        try:
            samples = await self.fetch(session, target)
        except PageError as exc:
            self.fail(target, str(exc))
            return False
        except asyncio.TimeoutError:  # slow, not refused: no evidence against requests
            self.fail(target, f"no answer within {self.timeout_s:g}s", suspect=False)
            return False
        except (aiohttp.ClientError, OSError) as exc:
            self.fail(target, f"{type(exc).__name__}: {exc}")
            return False
        if not target.engines:  # its engines are about to be added: their caps first
            await self.fetch_caps(session, target)
        self.apply(target, samples)
        return True

    async def _watch(self, session: aiohttp.ClientSession, target: Target) -> None:
        next_at = time.monotonic()
        while True:
            await self.scrape_once(session, target)
            next_at += self.interval_s
            now = time.monotonic()
            if next_at < now:  # a slow scrape: skip the missed slots, never burst
                next_at = now
            await asyncio.sleep(next_at - now)

    def session(self) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.timeout_s),
            connector=aiohttp.TCPConnector(limit_per_host=2),
        )

    async def check_pages(self) -> None:
        """At start: a reachable page without engine counts is a configuration error."""
        async with self.session() as session:
            for t in self.targets:
                try:
                    samples = await self.fetch(session, t)
                except PageError as exc:
                    raise SidecarError(f"{t.metrics_url}: {exc}") from None
                except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
                    reason = f"{type(exc).__name__}: {exc}"
                    log.warning("scrape: %s not answering yet (%s)", t.metrics_url, reason)
                    continue
                await self.fetch_caps(session, t)
                for s in samples:  # known now: they register together, before any reports
                    eid = t.engines[s.engine] = self.engine_id(t, s.engine)
                    self.sender.add(eid, t.engine_url, self.cap_for(t, s.engine))
                ids = ", ".join(t.engines.values()) or "none yet"
                log.info("scrape: %s: reporting engines %s", t.metrics_url, ids)

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Scrape until ``stop`` is set (forever without one)."""
        stop = stop or asyncio.Event()
        async with self.session() as session:
            tasks = [asyncio.create_task(self._watch(session, t)) for t in self.targets]
            waiter = asyncio.create_task(stop.wait())
            try:
                done, _ = await asyncio.wait([waiter, *tasks], return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    if t is not waiter:
                        t.result()  # a SidecarError from a watcher ends the run
            finally:
                for t in [waiter, *tasks]:
                    t.cancel()
                await asyncio.gather(waiter, *tasks, return_exceptions=True)


def loads_caps(data: Any) -> dict[str, int]:
    """``max_running_requests`` per ``dp_rank`` (as the /metrics label: "0", "1", ...) from
    SGLang's /v1/loads answer: ``{"loads": [{"dp_rank", "max_running_requests", ...}]}``
    (or the bare list); entries without a whole cap >= 1 are left out."""
    loads = data.get("loads") if isinstance(data, dict) else data
    caps: dict[str, int] = {}
    for entry in loads if isinstance(loads, list) else []:
        if not isinstance(entry, dict):
            continue
        rank = entry.get("dp_rank")
        rank = 0 if rank is None else rank
        try:
            cap = check_running_cap(entry.get("max_running_requests"), "max_running_requests")
        except InvalidArgument:
            continue
        if isinstance(rank, int) and not isinstance(rank, bool) and rank >= 0:
            caps[str(rank)] = cap
    return caps


# -- the command ------------------------------------------------------------------------------


# not click.ParamType[...]: the floor in pyproject (click 8.1) may predate the generic
class Duration(click.ParamType):  # type: ignore[type-arg]
    """50ms, 0.05s or 0.05 (seconds)."""

    name = "duration"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> float:
        if isinstance(value, int | float):
            return float(value)
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(ms|s)?\s*", str(value))
        if not m:
            self.fail(f"{value!r} is not a duration like 50ms or 0.5s", param, ctx)
        secs = float(m.group(1)) / (1000.0 if m.group(2) == "ms" else 1.0)
        if not 0.001 <= secs <= 3600:
            self.fail(f"{value!r} is out of range (1ms..1h)", param, ctx)
        return secs


def make_targets(metrics_urls: list[str], engine_urls: list[str], template: str) -> list[Target]:
    """The checked targets (SidecarError names a bad option); no I/O."""
    if engine_urls and len(engine_urls) != len(metrics_urls):
        raise SidecarError(
            f"give one --engine-url per --metrics-url ({len(metrics_urls)}), got {len(engine_urls)}"
        )
    check_template(template)
    return [
        Target.make(i, m, engine_urls[i] if engine_urls else None)
        for i, m in enumerate(metrics_urls)
    ]


def build(
    redis_url: str,
    deployment: str,
    metrics_urls: list[str],
    engine_urls: list[str],
    template: str,
    interval_s: float,
    timeout_s: float,
    running_cap: int | None = None,
) -> Sidecar:
    """The sidecar for these options (SidecarError names a bad one); starts the sender."""
    targets = make_targets(metrics_urls, engine_urls, template)
    sender = CountsRelay(
        redis_url,
        deployment,
        mode="tick",
        max_age_s=interval_s + timeout_s + 0.1,
        idle_forever=False,
    )
    return Sidecar(
        sender,
        targets,
        template=template,
        interval_s=interval_s,
        timeout_s=timeout_s,
        running_cap=running_cap,
    )


@click.command("scrape")
@common_options
@click.option(
    "--metrics-url",
    "metrics_urls",
    multiple=True,
    required=True,
    metavar="URL",
    help="An engine server's Prometheus page (repeat for several servers).",
)
@click.option(
    "--engine-url",
    "engine_urls",
    multiple=True,
    metavar="URL",
    help="Where gateways send that server's requests, one per --metrics-url "
    "[default: the metrics URL's scheme://host:port].",
)
@click.option(
    "--engine-id",
    "template",
    default=DEFAULT_TEMPLATE,
    show_default=True,
    help="Engine id template: {host} {port} {engine} (engine / dp_rank label) "
    "{index} (position of the --metrics-url); the result must be a valid name.",
)
@click.option(
    "--interval",
    type=Duration(),
    default="50ms",
    show_default=True,
    help="Time between two scrapes of one URL.",
)
@click.option(
    "--timeout",
    type=Duration(),
    default="1s",
    show_default=True,
    help="A scrape slower than this fails: its engines stop reporting until the next "
    "good one (not marked suspect: a busy engine may serve its page late).",
)
@click.option(
    "--max-num-seqs",
    "running_cap",
    type=click.IntRange(1, MAX_RUNNING_CAP),
    default=None,
    metavar="N",
    help="How many requests each engine runs at once, as `vllm serve --max-num-seqs` "
    "(or --max-num-active-seqs) was given: declared to routers, which hold requests by it "
    "from the first report [default: SGLang's max_running_requests from its /v1/loads; "
    "none for vLLM, whose /metrics carries no cap].",
)
def scrape_command(
    metrics_urls: tuple[str, ...],
    engine_urls: tuple[str, ...],
    template: str,
    interval: float,
    timeout: float,
    running_cap: int | None,
) -> None:
    """Report engines from their Prometheus /metrics (vLLM, SGLang), in tick mode."""
    s = settings()
    url = s.require_url()
    try:  # options first: nothing connects before they are known to be good
        make_targets(list(metrics_urls), list(engine_urls), template)
    except SidecarError as exc:
        raise click.ClickException(str(exc)) from None
    check_reachable(url)
    try:
        sidecar = build(
            url,
            s.deployment,
            list(metrics_urls),
            list(engine_urls),
            template,
            interval,
            timeout,
            running_cap,
        )
    except SidecarError as exc:
        raise click.ClickException(str(exc)) from None
    stop = asyncio.Event()

    async def main() -> None:
        await sidecar.check_pages()
        await sidecar.run(stop)

    try:
        asyncio.run(run_until_signal(main(), stop.set))
    except SidecarError as exc:
        raise click.ClickException(str(exc)) from None
    finally:
        sidecar.sender.close(leave=True)
