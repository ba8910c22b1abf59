"""The /metrics sidecar: page parsing on recorded and constructed vLLM / SGLang pages, and
the sidecar on real HTTP (an aiohttp server serving pages with counts the test sets)
against a real Redis, judged on the deployment's published snapshots."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import statistics
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import redis
from aiohttp import web
from click.testing import CliRunner
from support.helpers import Barrier, await_until, coordinator

from redisbal import running_caps
from redisbal.barrier.snapshot import Snapshot
from redisbal.integrations.metrics_page import EngineSample, PageError, parse_page, relevant_text
from redisbal.integrations.scrape import (
    Sidecar,
    SidecarError,
    Target,
    build,
    loads_caps,
    sanitise,
)
from redisbal.keys import DeploymentKeys
from redisbal.ops.cli import cli
from redisbal.sim.http_engine import HttpEngine
from redisbal.sim.model import EngineParams

DATA = Path(__file__).parent / "data"


def page(name: str) -> str:
    return (DATA / name).read_text()


# -- parsing ----------------------------------------------------------------------------------


def test_recorded_sglang_page_from_the_docs() -> None:
    assert parse_page(page("sglang_docs_production_metrics.txt")) == [
        # progress: its prompt + generation token counters
        EngineSample("0", waiting=2826, running=162, kv_usage=0.28, progress=8128902 + 7557572)
    ]


def test_recorded_vllm_excerpt_without_waiting_is_an_error_naming_it() -> None:
    with pytest.raises(PageError) as exc:
        parse_page(page("vllm_docs_design_metrics_excerpt.txt"))
    assert str(exc.value) == "vLLM page without vllm:num_requests_waiting"


def test_page_rendered_by_vllm_0_33_itself() -> None:
    """900 lines from vLLM 0.33.0's own PrometheusStatLogger (see the file's header)."""
    assert parse_page(page("vllm_0.33.0_stat_logger_generated.txt")) == [
        # the iteration and token counters are on the page (0: nothing ran yet)
        # and request_success_total, every finished_reason at 0: a total of the queues
        EngineSample("0", waiting=4, running=7, kv_usage=0.375, progress=0.0, finished=0),
        EngineSample("1", waiting=0, running=12, kv_usage=0.75, progress=0.0, finished=0),
    ]


def test_vllm_0_33_page_one_engine_per_engine_label() -> None:
    assert parse_page(page("vllm_0.33.0_two_engines_constructed.txt")) == [
        EngineSample("0", waiting=4, running=7, kv_usage=0.4375),
        EngineSample("1", waiting=0, running=12, kv_usage=0.8125),
    ]


def test_sglang_dp_page_one_engine_per_dp_rank_tp_ranks_not_summed() -> None:
    assert parse_page(page("sglang_dp_attention_constructed.txt")) == [
        EngineSample("0", waiting=5, running=9, kv_usage=0.5),
        EngineSample("1", waiting=0, running=3, kv_usage=0.25),
    ]


def test_older_vllm_gpu_cache_name_and_priority_aggregate() -> None:
    old = (
        'vllm:num_requests_running{model_name="m"} 2.0\n'
        'vllm:num_requests_waiting{model_name="m"} 1.0\n'
        'vllm:gpu_cache_usage_perc{model_name="m"} 0.25\n'
    )
    assert parse_page(old) == [EngineSample("0", 1, 2, 0.25)]
    prio = (
        'sglang:num_running_reqs{tp_rank="0",priority=""} 14.0\n'
        'sglang:num_running_reqs{tp_rank="0",priority="10"} 9.0\n'
        'sglang:num_queue_reqs{tp_rank="0",priority=""} 3.0\n'
    )
    assert parse_page(prio) == [EngineSample("0", 3, 14, None)]


def test_finished_counters_give_each_engine_its_admitted_total() -> None:
    """vLLM's request_success_total summed over finished_reason; SGLang's
    num_requests_total over is_streaming, its tp_ranks one count (not summed)."""
    vllm = (
        'vllm:num_requests_running{engine="0"} 2\nvllm:num_requests_waiting{engine="0"} 1\n'
        'vllm:request_success_total{engine="0",finished_reason="stop"} 5\n'
        'vllm:request_success_total{engine="0",finished_reason="length"} 3\n'
        'vllm:request_success_total{engine="0",finished_reason="abort"} 1\n'
    )
    [e0] = parse_page(vllm)
    assert (e0.finished, e0.admitted_total) == (9, 12)
    sglang = "".join(
        f'sglang:num_queue_reqs{{dp_rank="{d}",tp_rank="{t}"}} {d}\n'
        f'sglang:num_running_reqs{{dp_rank="{d}",tp_rank="{t}"}} 4\n'
        f'sglang:num_requests_total{{dp_rank="{d}",tp_rank="{t}",is_streaming="true"}} {7 + d}\n'
        f'sglang:num_requests_total{{dp_rank="{d}",tp_rank="{t}",is_streaming="false"}} 2\n'
        for d in (0, 1)
        for t in (0, 1)
    )
    assert [(e.engine, e.finished, e.admitted_total) for e in parse_page(sglang)] == [
        ("0", 9, 13),
        ("1", 10, 15),
    ]


@pytest.mark.parametrize(
    "counter",
    [
        'sglang:num_requests_total{tp_rank="0"} 9\n',  # no dp_rank next to per-rank gauges
        'sglang:num_requests_total{dp_rank="0"} 9\n',  # not for every engine
        'sglang:num_requests_total{dp_rank="0"} 9\nsglang:num_requests_total{dp_rank="1"} NaN\n',
        'sglang:num_requests_total{dp_rank="0"} 9\nsglang:num_requests_total{dp_rank="1"} 1e15\n',
    ],
)
def test_a_finished_counter_not_for_every_engine_or_no_count_gives_no_total(
    counter: str,
) -> None:
    gauges = "".join(
        f'sglang:num_queue_reqs{{dp_rank="{d}"}} 0\nsglang:num_running_reqs{{dp_rank="{d}"}} 1\n'
        for d in (0, 1)
    )
    assert [(e.running, e.admitted_total) for e in parse_page(gauges + counter)] == [
        (1, None),
        (1, None),
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("process_cpu_seconds_total 12.5\n", "no engine counts on the page"),
        ('sglang:num_running_reqs{dp_rank="0"} 1\n', "SGLang page without sglang:num_queue_reqs"),
        (
            'vllm:num_requests_running{engine="0"} 1\nvllm:num_requests_running{engine="1"} 1\n'
            'vllm:num_requests_waiting{engine="0"} 1\n',
            "vLLM page without vllm:num_requests_waiting for engine=1",
        ),
        (
            "vllm:num_requests_running -1\nvllm:num_requests_waiting 0\n",
            "vllm:num_requests_running for engine=0 is -1: not a count",
        ),
        ("vllm:num_requests_running{engine=0 1\n", "not Prometheus text"),
    ],
)
def test_bad_pages_are_one_line_errors(text: str, message: str) -> None:
    with pytest.raises(PageError) as exc:
        parse_page(text)
    assert message in str(exc.value)
    assert "\n" not in str(exc.value)


def test_engine_ids_are_valid_names() -> None:
    assert sanitise("::1") == "--1"
    t = Target.make(0, "http://[::1]:8000/metrics")
    assert (t.host, t.port, t.engine_url) == ("::1", "8000", "http://[::1]:8000")
    sc = Sidecar.__new__(Sidecar)  # only the id logic, no sender
    sc.template, sc.targets, sc._owners = "{host}-{port}-{engine}", [t], {}
    assert sc.engine_id(t, "3") == "1-8000-3"
    sc.template = "{host}:{port}/{engine}"
    with pytest.raises(SidecarError, match="invalid engine id"):
        sc.engine_id(t, "4")


# -- a metrics server with counts the test controls -----------------------------------------


def _vllm_padding() -> str:
    """Every line of vLLM 0.33.0's own page except the series the sidecar reads: served
    around the test's counts, so that each scrape fetches and filters a real-size page."""
    lines = [
        ln
        for ln in page("vllm_0.33.0_stat_logger_generated.txt").splitlines()
        if not ln.startswith("# ") or ln.startswith(("# HELP", "# TYPE"))
    ]
    ours = set(relevant_text("\n".join(lines)).splitlines())
    return "\n".join(ln for ln in lines if ln not in ours) + "\n"


VLLM_PADDING = _vllm_padding()


class MetricsServer:
    """A real HTTP server serving vLLM-format (or SGLang) pages of the given counts; the
    vLLM pages carry the rest of a real vLLM 0.33.0 page (79 kB) around them."""

    def __init__(self, engines: int = 1, flavour: str = "vllm") -> None:
        self.counts = {str(e): (0, 0) for e in range(engines)}  # label -> (waiting, running)
        self.tokens: float | None = None  # vLLM's generation token counter, when served
        self.finished: dict[str, int] | None = None  # label -> finished requests, when served
        self.flavour = flavour
        self.hang = False
        self.runner: web.AppRunner | None = None
        self.port = 0
        self.hits = 0
        self.loads: Any = None  # SGLang's GET /v1/loads answer, when it serves one

    def text(self) -> str:
        lines = []
        for label, (w, r) in self.counts.items():
            if self.flavour == "vllm":
                lab = f'{{engine="{label}",model_name="m"}}'
                lines += [
                    f"vllm:num_requests_waiting{lab} {w}.0",
                    f"vllm:num_requests_running{lab} {r}.0",
                    f"vllm:kv_cache_usage_perc{lab} 0.5",
                ]
                if self.tokens is not None:
                    lines.append(f"vllm:generation_tokens_total{lab} {self.tokens}")
                if self.finished is not None:  # split over two reasons, as vLLM's
                    n, why = self.finished[label], 'finished_reason="'
                    lines.append(f'vllm:request_success_total{lab[:-1]},{why}stop"}} {n - 1}.0')
                    lines.append(f'vllm:request_success_total{lab[:-1]},{why}abort"}} 1.0')
            else:
                lab = f'{{dp_rank="{label}",tp_rank="0"}}'
                lines += [f"sglang:num_queue_reqs{lab} {w}", f"sglang:num_running_reqs{lab} {r}"]
                if self.finished is not None:
                    lines.append(f"sglang:num_requests_total{lab} {self.finished[label]}")
        body = "\n".join(lines) + "\n"
        return VLLM_PADDING + body if self.flavour == "vllm" else body

    async def handle(self, request: web.Request) -> web.Response:
        self.hits += 1
        if self.hang:
            await asyncio.sleep(30)
        return web.Response(text=self.text(), content_type="text/plain")

    async def handle_loads(self, request: web.Request) -> web.Response:
        return web.json_response(self.loads)

    async def start(self, port: int = 0) -> MetricsServer:
        app = web.Application()
        app.router.add_get("/metrics", self.handle)
        if self.loads is not None:
            app.router.add_get("/v1/loads", self.handle_loads)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/metrics"


@pytest.fixture
async def servers() -> AsyncIterator[list[MetricsServer]]:
    made: list[MetricsServer] = []
    yield made
    for s in made:
        await s.stop()


def latest(r: redis.Redis, keys: DeploymentKeys) -> Snapshot | None:
    raw = r.get(keys.snapshot)
    return Snapshot.from_json(raw) if raw else None


async def start_sidecar(
    redis_url: str, deployment: str, urls: list[str], running_cap: int | None = None, **kw: Any
) -> tuple[Sidecar, asyncio.Event, asyncio.Task[None]]:
    sc = build(
        redis_url,
        deployment,
        urls,
        [],
        str(kw.get("template", "{host}-{port}-{engine}")),
        float(kw.get("interval", 0.05)),
        float(kw.get("timeout", 0.5)),
        running_cap,
    )
    stop = asyncio.Event()
    return sc, stop, asyncio.create_task(sc.run(stop))


def bar_meta(r: redis.Redis, keys: DeploymentKeys) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in r.hgetall(keys.meta).items()}


def counts_of(snap: Snapshot | None) -> dict[str, tuple[int, int]]:
    return {} if snap is None else {e: (c.waiting, c.running) for e, c in snap.engines.items()}


async def test_snapshot_follows_served_counts_of_several_engines(
    redis_url: str, r: redis.Redis, keys: DeploymentKeys, servers: list[MetricsServer]
) -> None:
    Barrier(r, keys).configure()
    a = await MetricsServer(engines=2).start()
    b = await MetricsServer(engines=1, flavour="sglang").start()
    servers += [a, b]
    sc, stop, task = await start_sidecar(redis_url, keys.deployment, [a.url, b.url])
    try:
        ids = {f"127.0.0.1-{a.port}-0", f"127.0.0.1-{a.port}-1", f"127.0.0.1-{b.port}-0"}
        await await_until(lambda: set(counts_of(latest(r, keys))) == ids)
        a.counts = {"0": (3, 5), "1": (0, 8)}
        b.counts = {"0": (7, 1)}
        want = {
            f"127.0.0.1-{a.port}-0": (3, 5),
            f"127.0.0.1-{a.port}-1": (0, 8),
            f"127.0.0.1-{b.port}-0": (7, 1),
        }
        await await_until(lambda: counts_of(latest(r, keys)) == want, timeout=2.0)
        snap = latest(r, keys)
        assert snap is not None and snap.engines[f"127.0.0.1-{a.port}-0"].kv_usage == 0.5
    finally:
        stop.set()
        await task
        sc.sender.close()


async def test_the_sidecar_sends_each_engines_admitted_total(
    redis_url: str, r: redis.Redis, keys: DeploymentKeys, servers: list[MetricsServer]
) -> None:
    """Where the page gives finished requests (vLLM's request_success_total, SGLang's
    num_requests_total) each report carries finished + waiting + running; a page
    without them, none."""
    Barrier(r, keys).configure()
    a = await MetricsServer(engines=2).start()
    b = await MetricsServer(engines=1, flavour="sglang").start()
    c = await MetricsServer(engines=1).start()  # no finished counter
    servers += [a, b, c]
    a.finished, b.finished = {"0": 10, "1": 4}, {"0": 7}
    a.counts, b.counts, c.counts = {"0": (3, 5), "1": (0, 8)}, {"0": (2, 1)}, {"0": (1, 1)}
    sc, stop, task = await start_sidecar(redis_url, keys.deployment, [a.url, b.url, c.url])
    want = {
        f"127.0.0.1-{a.port}-0": 18,
        f"127.0.0.1-{a.port}-1": 12,
        f"127.0.0.1-{b.port}-0": 10,
        f"127.0.0.1-{c.port}-0": None,
    }

    def totals() -> dict[str, int | None]:
        snap = latest(r, keys)
        return {} if snap is None else {e: x.admitted_total for e, x in snap.engines.items()}

    try:
        await await_until(lambda: totals() == want, timeout=5.0, what="the totals")
    finally:
        stop.set()
        await task
        sc.sender.close()


async def test_the_cap_comes_from_sglangs_v1_loads_or_from_the_flag(
    redis_url: str, r: redis.Redis, keys: DeploymentKeys, servers: list[MetricsServer]
) -> None:
    """SGLang's /v1/loads gives each dp_rank's max_running_requests, declared once per
    engine; vLLM has no /v1/loads (404) and its page no cap: none is declared, unless
    the sidecar is given --max-num-seqs, which then wins for every engine."""
    Barrier(r, keys).configure()
    a = await MetricsServer(engines=1).start()
    b = MetricsServer(engines=2, flavour="sglang")
    b.loads = {
        "loads": [
            {"dp_rank": 0, "max_running_requests": 48},
            {"dp_rank": 1, "max_running_requests": 32},
        ]
    }
    await b.start()
    servers += [a, b]
    sc, stop, task = await start_sidecar(redis_url, keys.deployment, [a.url, b.url])
    try:
        want = {f"127.0.0.1-{b.port}-0": 48, f"127.0.0.1-{b.port}-1": 32}
        await await_until(lambda: len(counts_of(latest(r, keys))) == 3)
        assert running_caps.fetch_sync(r, keys) == want
    finally:
        stop.set()
        await task
        sc.sender.close()
    assert r.hlen(keys.running_caps) == 0  # the engines left: their caps with them
    sc, stop, task = await start_sidecar(redis_url, keys.deployment, [a.url, b.url], 16)
    try:
        await await_until(lambda: len(running_caps.fetch_sync(r, keys)) == 3)
        assert set(running_caps.fetch_sync(r, keys).values()) == {16}
    finally:
        stop.set()
        await task
        sc.sender.close()


def test_v1_loads_answers_give_each_dp_ranks_cap() -> None:
    assert loads_caps({"loads": [{"dp_rank": 1, "max_running_requests": 8}]}) == {"1": 8}
    assert loads_caps([{"max_running_requests": 4}]) == {"0": 4}  # no dp_rank: rank 0
    bad = [
        {"dp_rank": 0, "max_running_requests": 0},
        {"dp_rank": 1, "max_running_requests": 2.5},
        {"dp_rank": -1, "max_running_requests": 8},
        {"dp_rank": "2", "max_running_requests": 8},
        "x",
    ]
    assert loads_caps({"loads": bad}) == {} == loads_caps({"error": "x"}) == loads_caps(None)


async def test_the_sidecar_takes_engine_sims_cap_as_sglangs(
    redis_url: str, r: redis.Redis, keys: DeploymentKeys
) -> None:
    """engine-sim --report-as sglang serves SGLang's /metrics and /v1/loads; a sidecar
    on it declares the engine's cap. --report-as vllm-metrics serves neither: no cap.
    Both pages carry the finished counter: the sidecar sends their totals."""
    Barrier(r, keys).configure()
    params = EngineParams(running_cap=6)
    engines = {
        form: HttpEngine(
            form, redis_url=None, deployment="-", port=0, params=params, report_as=form
        )
        for form in ("sglang", "vllm-metrics")
    }
    for e in engines.values():
        await e.start()
    urls = [f"{e.url}/metrics" for e in engines.values()]
    sc, stop, task = await start_sidecar(
        redis_url, keys.deployment, urls, template="{index}-{engine}"
    )
    try:
        await await_until(lambda: len(counts_of(latest(r, keys))) == 2)
        assert running_caps.fetch_sync(r, keys) == {"0-0": 6}  # the sglang one's dp_rank 0
        for e in engines.values():  # one request each, finished
            e.model.finished += 1
        await await_until(
            lambda: (
                (s := latest(r, keys)) is not None
                and [c.admitted_total for c in s.engines.values()] == [1, 1]
            ),
            what="the totals",
        )
    finally:
        stop.set()
        await task
        sc.sender.close()
        for e in engines.values():
            await e.stop()


async def test_killed_metrics_server_leaves_routing_not_reported_idle(
    redis_url: str, r: redis.Redis, keys: DeploymentKeys, servers: list[MetricsServer]
) -> None:
    """A dead /metrics is never an idle engine: the engine stops reporting, the barrier is
    forced past it (stall guard), and it expires after dead_after_ms."""
    stack = contextlib.ExitStack()
    stack.enter_context(coordinator(redis_url, keys.deployment, dead_after_ms=800, stall_ms=100))
    a = await MetricsServer().start()
    b = await MetricsServer().start()
    servers += [a, b]
    a.counts, b.counts = {"0": (4, 6)}, {"0": (1, 2)}
    sc, stop, task = await start_sidecar(redis_url, keys.deployment, [a.url, b.url])
    ea, eb = f"127.0.0.1-{a.port}-0", f"127.0.0.1-{b.port}-0"
    forced: list[Snapshot] = []
    try:
        await await_until(lambda: counts_of(latest(r, keys)) == {ea: (4, 6), eb: (1, 2)})
        await a.stop()
        killed = time.monotonic()
        saw_zero = False
        suspect_after, marked_by = None, ""
        while time.monotonic() - killed < 30.0:  # a hang guard: it goes in about a second
            snap = latest(r, keys)
            c = counts_of(snap)
            if c.get(ea) == (0, 0):
                saw_zero = True
            if snap is not None and snap.forced:
                forced.append(snap)
            if suspect_after is None and snap is not None and ea in snap.suspect:
                suspect_after = time.monotonic() - killed
                marked_by = bar_meta(r, keys)[f"suspect:{ea}"].split(" ", 2)[1]
            if ea not in c:
                break
            await asyncio.sleep(0.02)
        assert not saw_zero, "a dead engine was reported idle"
        # routers avoid it (suspect) before it expires: marked while still in the snapshot
        assert suspect_after is not None, "never suspect before it expired"
        assert marked_by == "-"  # the sidecar, not a router
        assert ea not in counts_of(latest(r, keys)), "the dead engine is still routed to"
        assert any(ea in s.laggards for s in forced), "the stall guard never named it"
        # the live engine kept reporting through all of it
        b.counts = {"0": (9, 9)}
        await await_until(lambda: counts_of(latest(r, keys)).get(eb) == (9, 9), timeout=2.0)
        assert sc.failures > 0
    finally:
        stop.set()
        await task
        sc.sender.close()
        stack.close()


async def test_engine_whose_counters_stand_still_stalls_and_comes_back(
    redis_url: str, r: redis.Redis, keys: DeploymentKeys, servers: list[MetricsServer]
) -> None:
    """Progress, not pulse: /metrics keeps answering (the API server lives) but the
    engine's token counter stands still while it has work: stalled, then back when the
    counter moves."""
    stack = contextlib.ExitStack()
    stack.enter_context(coordinator(redis_url, keys.deployment, stall_after_ms=300))
    a = await MetricsServer().start()
    b = await MetricsServer().start()
    servers += [a, b]
    a.counts, b.counts = {"0": (6, 2)}, {"0": (1, 2)}
    a.tokens = b.tokens = 10.0
    sc, stop, task = await start_sidecar(redis_url, keys.deployment, [a.url, b.url])
    ea, eb = f"127.0.0.1-{a.port}-0", f"127.0.0.1-{b.port}-0"

    def stalled() -> set[str]:
        snap = latest(r, keys)
        return set() if snap is None else set(snap.stalled)

    async def tick_b() -> None:  # b keeps generating
        while True:
            b.tokens = (b.tokens or 0) + 1
            await asyncio.sleep(0.02)

    ticker = asyncio.create_task(tick_b())
    try:
        await await_until(lambda: set(counts_of(latest(r, keys))) == {ea, eb})
        await await_until(lambda: stalled() == {ea}, timeout=5.0)  # a's counter stood still
        a.tokens = 11.0  # it decodes again
        await await_until(lambda: stalled() == set(), timeout=5.0)
    finally:
        ticker.cancel()
        stop.set()
        await task
        sc.sender.close()
        stack.close()


async def test_hung_metrics_server_times_out_and_recovers(
    redis_url: str, r: redis.Redis, keys: DeploymentKeys, servers: list[MetricsServer]
) -> None:
    """A page slower than --timeout pauses its engine (named a laggard, so routers keep
    away, then gone) without a suspect mark: a slow page is no evidence that requests
    fail there. It reports again with the next good scrape."""
    stack = contextlib.ExitStack()
    stack.enter_context(coordinator(redis_url, keys.deployment, dead_after_ms=600, stall_ms=100))
    a = await MetricsServer().start()
    b = await MetricsServer().start()
    servers += [a, b]
    a.counts, b.counts = {"0": (2, 3)}, {"0": (1, 1)}
    sc, stop, task = await start_sidecar(redis_url, keys.deployment, [a.url, b.url], timeout=0.2)
    ea, eb = f"127.0.0.1-{a.port}-0", f"127.0.0.1-{b.port}-0"
    try:
        await await_until(lambda: counts_of(latest(r, keys)) == {ea: (2, 3), eb: (1, 1)})
        a.hang = True
        named_laggard = False

        def gone() -> bool:
            nonlocal named_laggard
            snap = latest(r, keys)
            if snap is None or ea not in snap.engines:
                return True
            assert ea not in snap.suspect, "a slow page marked its engine suspect"
            named_laggard = named_laggard or ea in snap.laggards
            return False

        await await_until(gone, 30.0, "the hung page's engine to go")
        assert named_laggard, "the silent engine was never named a laggard"
        assert sc.failures > 0 and f"suspect:{ea}" not in bar_meta(r, keys)
        a.hang = False
        a.counts = {"0": (5, 5)}
        await await_until(lambda: counts_of(latest(r, keys)).get(ea) == (5, 5), timeout=3.0)
    finally:
        stop.set()
        await task
        sc.sender.close()
        stack.close()


@pytest.mark.slow
async def test_lag_from_served_change_to_snapshot(
    redis_url: str, r: redis.Redis, keys: DeploymentKeys, servers: list[MetricsServer]
) -> None:
    """Lag from a change of the served counts to the first snapshot showing it, over
    SCRAPE_LAG_CHANGES changes (default 40; the docs' figure used 200), at a 50 ms interval:
    every change arrives; the lag is printed (``pytest -s``), a figure, not a bound."""
    n = int(os.environ.get("SCRAPE_LAG_CHANGES", "40"))
    Barrier(r, keys).configure()
    a = await MetricsServer(engines=2).start()
    servers.append(a)
    sc, stop, task = await start_sidecar(redis_url, keys.deployment, [a.url], interval=0.05)
    e0 = f"127.0.0.1-{a.port}-0"
    pubsub = r.pubsub()
    lags: list[float] = []
    try:
        await await_until(lambda: e0 in counts_of(latest(r, keys)))
        for i in range(1, n + 1):
            await asyncio.sleep(0.01 + (i % 7) * 0.007)  # changes at every phase of a scrape
            a.counts = {"0": (i, i % 5), "1": (0, 1)}
            t0 = time.monotonic()
            await await_until(lambda i=i: counts_of(latest(r, keys)).get(e0) == (i, i % 5))  # type: ignore[misc]
            lags.append(time.monotonic() - t0)
    finally:
        pubsub.close()
        stop.set()
        await task
        sc.sender.close()
    lags.sort()
    p50 = statistics.median(lags)
    p99 = lags[min(len(lags) - 1, round(0.99 * (len(lags) - 1)))]
    # every change reached a snapshot (each wait above); how fast is a figure, printed
    print(f"\nscrape lag over {n} changes: p50 {p50 * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms")
    assert len(lags) == n


# -- the command ------------------------------------------------------------------------------


def test_cli_bad_template_and_page_are_one_line_errors(redis_url: str, tmp_path: Path) -> None:
    runner = CliRunner()
    res = runner.invoke(
        cli,
        [
            "scrape",
            "--redis-url",
            redis_url,
            "--metrics-url",
            "http://127.0.0.1:9/metrics",
            "--engine-id",
            "{host}/{gpu}",
        ],
    )
    assert res.exit_code == 1
    assert "unknown field {gpu}" in res.output and "Traceback" not in res.output
    res = runner.invoke(
        cli,
        ["scrape", "--redis-url", redis_url, "--metrics-url", "ftp://x/metrics"],
    )
    assert res.exit_code == 1 and "expected http(s)://host:port/metrics" in res.output
    res = runner.invoke(
        cli, ["scrape", "--redis-url", redis_url, "--metrics-url", "http://h/m", "--interval", "x"]
    )
    assert res.exit_code == 2 and "not a duration" in res.output
    for bad in ("0", "x", "2.5"):
        res = runner.invoke(
            cli, ["scrape", "--redis-url", redis_url, "--metrics-url", "http://h/m",
                  "--max-num-seqs", bad],
        )  # fmt: skip
        assert res.exit_code == 2 and "--max-num-seqs" in res.output, res.output
    # options are checked before anything connects: this Redis does not exist
    res = runner.invoke(
        cli,
        ["scrape", "--redis-url", "redis://127.0.0.1:9/0", "--metrics-url", "http://h:1/m",
         "--metrics-url", "http://h:2/m", "--engine-url", "http://h:1"],
    )  # fmt: skip
    assert res.exit_code == 1
    assert res.output.strip() == "Error: give one --engine-url per --metrics-url (2), got 1"


async def test_command_reports_then_leaves_on_sigterm(
    redis_url: str, r: redis.Redis, keys: DeploymentKeys, servers: list[MetricsServer]
) -> None:
    """The real `redisbal scrape` process: it reports the served counts, and a SIGTERM makes
    its engines leave the deployment (no report means no knowledge of them)."""
    Barrier(r, keys).configure()
    a = await MetricsServer(engines=2).start()
    servers.append(a)
    a.counts = {"0": (1, 2), "1": (3, 4)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "redisbal", "scrape", "--redis-url", redis_url,
        "--deployment", keys.deployment, "--metrics-url", a.url, "--interval", "50ms",
        "--engine-id", "node-{index}-{engine}", "--max-num-seqs", "32",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        want = {"node-0-0": (1, 2), "node-0-1": (3, 4)}
        await await_until(lambda: counts_of(latest(r, keys)) == want, timeout=10.0)
        assert running_caps.fetch_sync(r, keys) == {"node-0-0": 32, "node-0-1": 32}
        proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(proc.communicate(), 10)
        assert proc.returncode == 0, err.decode()
        assert "Traceback" not in err.decode()
        await await_until(lambda: counts_of(latest(r, keys)) == {}, timeout=3.0)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_command_refuses_a_page_without_counts(
    redis_url: str, keys: DeploymentKeys, servers: list[MetricsServer]
) -> None:
    a = await MetricsServer(engines=0).start()  # a page with no engine series at all
    servers.append(a)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "redisbal", "scrape", "--redis-url", redis_url,
        "--deployment", keys.deployment, "--metrics-url", a.url,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, err = await asyncio.wait_for(proc.communicate(), 20)
    lines = [ln for ln in err.decode().splitlines() if ln.startswith("Error")]
    assert proc.returncode == 1
    assert lines == [
        f"Error: {a.url}: no engine counts on the page: expected vLLM series "
        "(vllm:num_requests_waiting, vllm:num_requests_running) or SGLang series "
        "(sglang:num_queue_reqs, sglang:num_running_reqs)"
    ]
    assert "Traceback" not in err.decode()


def test_missing_extra_is_one_line_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "aiohttp", None)  # import aiohttp -> ImportError
    monkeypatch.delitem(sys.modules, "redisbal.integrations.scrape", raising=False)
    res = CliRunner().invoke(cli, ["scrape", "--metrics-url", "http://h/metrics"])
    assert res.exit_code == 1
    assert res.output.strip() == (
        "Error: scrape is unavailable: redisbal scrape needs the 'scrape' extra: "
        "pip install 'redisbal[scrape]' (missing aiohttp)"
    )
