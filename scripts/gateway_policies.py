#!/usr/bin/env python3
"""Routing policies compared on the HTTP path: what an OpenAI client of the gateways sees.

Each run is ``redisbal demo --http`` (redisbal.sim.demo_http) on one shared
redis-server, a deployment of its own per run: a coordinator, ``--engines`` HTTP
engine simulators, ``--gateways`` gateway replicas with the policy under test, and
``redisbal loadgen`` sending bursty, heavy-tailed (lognormal output lengths),
streamed requests to the gateways in turn. The same seed gives every policy the
same schedule; runs are interleaved (policy order rotates per seed) so that host
noise hits every policy alike. Reports TTFT p50/p99, end-to-end p99 and goodput
(requests per second whose first token came within ``--slo-ttft-ms``), mean
[min-max] over seeds.

    python scripts/gateway_policies.py --policies redisbal,round-robin,vllm-latest \
        --seeds 3 --json out.json

``--trace PATTERN`` (``{seed}`` replaced by the seed) replays a JSON-lines trace
instead (scripts/session_trace.py writes the simulator's sessions or Poisson
traffic as one) with ``loadgen --session-prompts``, on engines given
``--engine-args`` (e.g. a prefix cache and per-token prefill: ``--cache-blocks``,
``--prefill-token-us``); it adds the prefix-cache hit rate (cached / prompt tokens,
summed over the engines' /sim/state) and the prefill it saved (the cached tokens).

Policies are what ``redisbal gateway --policy`` accepts (redisbal.routing.policies.POLICIES)
and, with ``--trace``, the real peer routers (every policy of
redisbal.bench.peer_routers.POLICIES, e.g. ``vllm-router:cache_aware``,
``sglang-router:power_of_two``; the pinned versions are pip-installed into a venv of
their own on first use, ``--routers-venv``), ``--gateways`` replicas of each in front
of the same engines, every run checking in the router's /metrics and the engines'
/sim/peer_calls that the policy's prefix- or load-aware path ran; and the project's
emulations of peers that no real router here runs (redisbal.bench.peer_policies: llmd, chbl,
p2c, sglang-cache-aware), whose gateways are scripts/peer_gateway.py (the gateway
command takes no Policy object, and does not tell its router a prompt's block hashes,
which the prefix-aware emulations route by; that script does). Tables label them
"emulation".

Scenarios where state shared between the replicas should matter (redisbal.bench.
gateway_scenarios), composing with ``--trace`` and every policy: ``--gateways``
replicas; ``--split S`` (replica 0 takes a share S of the requests); ``--bypass
RATE:IDS`` (a client of its own sends traffic straight to some engines, which only
the engines' reports show); ``--slow`` (engines of two speeds); bursts (``--burst-*``,
or ``session_trace.py burst``); long prompts sharing prefixes (``session_trace.py
longprompt``); traffic where placement decides the hit rate, without session keys
(``session_trace.py prefixes`` and ``agentic``, on engines whose ``--cache-blocks`` hold a
few prefixes each). vllm-router's kv_aware runs on the engines' KV events: each run gives
every engine a ZMQ publisher of its own (engine-sim ``--kv-events``) and the router each
worker's (``--kv-event-source``). ``redisbal+kv`` is the default policy on the same events:
``redisbal kv-events`` keeps each engine's cache view in Redis and the gateways match
prompts with it (``--prefix-tokens sim``); ``<variant>+kv`` is a variant of the default
(``--policies redisbal-hold+kv``, say) on them. Each row records its scenario
(``scenario``, and a table column), the requests each replica was sent
(``sent_per_replica``) and the bypass client's own figures (``bypass``: never in the
routed requests'; the engines' served counts and cache hit rate include its traffic).

``--load-gate L``: before each run wait (up to ``--load-gate-wait-s``) for the 1-minute
load average to fall below L; each row records the load average at its start and end.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import click
import orjson

from redisbal import endpoints
from redisbal.bench import peer_routers
from redisbal.bench.gateway_scenarios import (
    Bypass,
    bypass_trace,
    cache_blocks,
    check_slow,
    check_split,
    kv_event_endpoints,
    kv_events_engine_args,
    kv_sources,
    kv_subscriber_args,
    parse_bypass,
    scenario,
)
from redisbal.bench.peer_policies import PEER_POLICIES
from redisbal.bench.plots import plot_policy_seeds, pyplot
from redisbal.bench.quality import ROUTES_VIEW, VARIANTS
from redisbal.keys import DeploymentKeys
from redisbal.routing.policies import POLICIES
from redisbal.sim.demo import Child, DemoError, DemoOptions, Echo
from redisbal.sim.demo_http import HttpDemo, _get
from redisbal.sim.embedded import RedisServer
from redisbal.sim.load_plan import Planned, read_trace

COLUMNS = (
    ("ttft_p50_ms", "TTFT p50 (ms)", ".0f"),
    ("ttft_p99_ms", "TTFT p99 (ms)", ".0f"),
    ("e2e_p99_ms", "e2e p99 (ms)", ".0f"),
    ("goodput_rps", "goodput (req/s)", ".1f"),
    ("slo_attainment", "within SLO", ".3f"),
)
# prefill saved: prompt tokens the engines found in their prefix caches (/sim/state)
CACHE_COLUMNS = (
    ("hit_rate", "cache hit rate", ".3f"),
    ("saved_mtok", "prefill saved (M tokens)", ".2f"),
)
MODEL = "redisbal-sim"  # the engines' model name (what kv_aware's event sources are for)
# the bypass client's own figures, kept apart from the routed requests'
BYPASS_KEYS = ("requests", "ok", "errors", "ttft_p50_ms", "ttft_p99_ms", "e2e_p99_ms")
# the default matching prompts with the engines' KV events (CacheViewDemo)
CACHE_VIEW_POLICY = "redisbal+kv"
# policies that stand for a peer without being it (the real routers run as themselves)
EMULATIONS = frozenset(PEER_POLICIES) | {"vllm-latest", "vllm-21617", "vllm-pre"}


class ScenarioDemo(HttpDemo):
    """The HTTP demo with the scenario options: the load split unevenly over the
    replicas (``split``), and a client sending ``bypass`` traffic straight to some
    engines while the load runs, whose figures it keeps apart (``bypassed``)."""

    split: float | None = None
    bypass: Bypass | None = None
    bypassed: dict[str, Any] | None = None

    def shapes(self) -> list[Planned]:
        """The load's requests, which the bypass traffic is shaped on."""
        return self.planned()

    def window(self) -> float:
        """Seconds of the load's arrivals, the bypass traffic's too."""
        return self.opts.duration

    def start_loadgen(self, args: list[str], total: int) -> Child:
        assert self.children is not None
        if self.split is not None:
            args = [*args, "--split", str(self.split)]
        side = self.start_bypass() if self.bypass is not None else None
        gen = super().start_loadgen(args, total)
        if side is not None:
            self.finish_bypass(side)
        return gen

    def start_bypass(self) -> Child:
        """A second loadgen, started just before the load's, to the bypass engines."""
        assert self.children is not None and self.bypass is not None
        o = self.opts
        window = self.window()
        lines = bypass_trace(self.bypass, window, o.seed, self.shapes())
        if not lines:
            raise DemoError(f"{self.bypass.label()}: no request falls within {window:g} s")
        path = self.logdir / "bypass.jsonl"
        path.write_bytes(b"".join(orjson.dumps(d) + b"\n" for d in lines))
        urls = endpoints.fetch_sync(self.client, DeploymentKeys(o.deployment))
        args = ["--trace", str(path), "--session-prompts", "--seed", str(o.seed)]
        args += ["--timeout-s", str(o.duration + o.drain_timeout + 30)]
        if o.slo_ttft_ms:
            args += ["--slo-ttft-ms", str(o.slo_ttft_ms)]
        for engine in self.bypass.engines:
            args += ["--url", urls[engine]]
        out = str(self.logdir / "bypass.json")
        return self.children.start("bypass", "loadgen", *args, "--stats-out", out, "--no-progress")

    def finish_bypass(self, side: Child) -> None:
        try:
            side.proc.wait(self.opts.drain_timeout + 30)
        except subprocess.TimeoutExpired:
            raise DemoError("the bypass client did not finish in time") from None
        self._check_children()
        self.bypassed = orjson.loads((self.logdir / "bypass.json").read_bytes())


class TraceDemo(ScenarioDemo):
    """The HTTP demo replaying a trace with conversation-shaped prompts, on engines
    with more options; records the engines' prefix-cache figures before they stop."""

    def __init__(
        self,
        opts: DemoOptions,
        echo: Echo,
        trace: str,
        engine_args: list[str],
        peer: str | None = None,
    ) -> None:
        super().__init__(opts, echo)
        self.trace = trace
        self.extra = engine_args
        self.peer = peer
        self.cache: dict[str, int] = {}
        self.peer_calls: dict[str, int] = {}
        self.steps: dict[str, float] = {}  # the engines' steps, planned and taken
        self.held = 0  # requests the redisbal gateways held (none for the peers)
        # the engines' KV-event publishers, one per engine (publish_kv_events), if any
        self.kv_endpoints: list[str] = []

    def publish_kv_events(self) -> None:
        """Every engine publishes its KV events, on a block of ports free now."""
        n = self.opts.engines
        self.kv_endpoints = kv_event_endpoints(peer_routers.free_port_block(n), n)

    def start_gateways(self) -> None:
        """A peer's gateways are scripts/peer_gateway.py processes; then as the demo's."""
        if self.peer is None:
            return super().start_gateways()
        assert self.children is not None
        kv = None  # the peers' prefix indexes are sized for the engines' cache (as bench's)
        if "--cache-blocks" in self.extra:
            kv = max(1, int(self.extra[self.extra.index("--cache-blocks") + 1]))
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peer_gateway.py")
        started = []
        for i in range(self.opts.api_servers):
            log = self.logdir / f"gateway-{i}.log"
            cmd = [sys.executable, script, "--policy", self.peer, "--lease-ttl-s", "1.5"]
            cmd += ["--refresh-s", "0.5"] + (["--kv-blocks", str(kv)] if kv else [])
            cmd += self.gateway_args  # (a variant on the cache views: its hashing)
            with open(log, "wb") as fh:
                proc = subprocess.Popen(
                    cmd,
                    stdin=subprocess.DEVNULL,
                    stdout=fh,
                    stderr=subprocess.STDOUT,
                    env=self.children.env,
                    start_new_session=True,
                )
            child = Child(f"gateway-{i}", proc, log)
            self.children.children.append(child)
            started.append(child)
        deadline = time.monotonic() + self.opts.startup_timeout
        self.gateways = [(c, self._gateway_url(c, deadline)) for c in started]
        while not all(self._client_count(u) == self.opts.api_servers for _, u in self.gateways):
            if time.monotonic() > deadline:
                raise RuntimeError("the peer gateways did not all see each other")
            self._check_children()
            time.sleep(0.1)

    def engine_args(self) -> list[str]:
        return super().engine_args() + self.extra + kv_events_engine_args(self.kv_endpoints)

    def shapes(self) -> list[Planned]:
        return read_trace(self.trace)

    def window(self) -> float:
        return max((p.t for p in self.shapes()), default=0.0)

    def run_load(self) -> list[Child]:
        assert self.children is not None
        o = self.opts
        self.start_gateways()
        total = len(read_trace(self.trace))
        args = ["--trace", self.trace, "--session-prompts", "--seed", str(o.seed)]
        gen = self.start_loadgen(args, total)
        prompt = cached = 0
        for url in self.engine_urls():
            st = orjson.loads(_get(url + "/sim/state"))
            prompt += st["prompt_tokens"]
            cached += st["cached_tokens"]
            for k in ("steps", "step_planned_s", "step_taken_s"):
                self.steps[k] = self.steps.get(k, 0) + st[k]
            for path, n in orjson.loads(_get(url + "/sim/peer_calls")).items():
                self.peer_calls[path] = self.peer_calls.get(path, 0) + n
        self.cache = {"prompt_tokens": prompt, "cached_tokens": cached}
        if self.peer is None and not isinstance(self, RouterDemo):
            for _, url in self.gateways:
                rows = peer_routers.parse_metrics(_get(url + "/metrics").decode())
                self.held += int(peer_routers.total(rows, "redisbal_gateway_hold_seconds_count"))
        return [gen]

    def engine_urls(self) -> list[str]:
        keys = DeploymentKeys(self.opts.deployment)
        return sorted(endpoints.fetch_sync(self.client, keys).values())


class CacheViewDemo(TraceDemo):
    """The trace demo with the default policy matching prompts with what the engines
    cache, as users run it: every engine publishes its KV events (engine-sim
    ``--kv-events``), ``redisbal kv-events`` keeps their views in Redis, and the
    gateways hash prompts with engine-sim's tokens (``--prefix-tokens sim``)."""

    gateway_args = ("--prefix-tokens", "sim")

    def __init__(
        self,
        opts: DemoOptions,
        echo: Echo,
        trace: str,
        engine_args: list[str],
        variant: str | None = None,
    ) -> None:
        super().__init__(opts, echo, trace, engine_args, variant)
        self.publish_kv_events()

    def start_gateways(self) -> None:
        assert self.children is not None
        self.children.start("kv-events", "kv-events", *kv_subscriber_args(self.kv_endpoints))
        super().start_gateways()


class RouterDemo(TraceDemo):
    """The trace demo with ``--gateways`` replicas of a real peer router (ROUTER:POLICY)
    in front of the engines instead of redisbal gateways; their /metrics are kept
    before they stop."""

    def __init__(
        self,
        opts: DemoOptions,
        echo: Echo,
        trace: str,
        engine_args: list[str],
        router: str,
        venv: str,
    ) -> None:
        super().__init__(opts, echo, trace, engine_args)
        self.router = router
        self.venv = venv
        self.replicas: list[peer_routers.RouterProcess] = []
        if peer_routers.needs_kv_events(router):  # a policy on the engines' KV events
            self.publish_kv_events()

    def start_gateways(self) -> None:
        name, _ = peer_routers.split_name(self.router)
        exe = peer_routers.binary(name, Path(self.venv))
        if exe is None:
            raise DemoError(f"{name} {peer_routers.PINNED[name]} is not installed in {self.venv}")
        workers = self.engine_urls()
        if len(workers) != self.opts.engines:
            raise DemoError(f"{len(workers)} engine URLs registered, not {self.opts.engines}")
        args: list[str] = []
        if self.kv_endpoints:
            urls = endpoints.fetch_sync(self.client, DeploymentKeys(self.opts.deployment))
            try:
                sources = kv_sources(urls, self.kv_endpoints)
                args = peer_routers.kv_event_args(sources, MODEL)
            except (ValueError, peer_routers.RouterError) as exc:
                raise DemoError(str(exc)) from None
        ports = peer_routers.free_ports(2 * self.opts.api_servers)
        for i in range(self.opts.api_servers):
            rp = peer_routers.RouterProcess(
                self.router, exe, ports[2 * i], ports[2 * i + 1], workers,
                self.logdir / f"router-{i}.log", args=args,
            )  # fmt: skip
            rp.start()
            self.replicas.append(rp)
        try:
            for rp in self.replicas:
                rp.wait_ready(self.opts.startup_timeout)
        except peer_routers.RouterError as exc:
            raise DemoError(str(exc)) from None
        self.gateways = [
            (Child(f"router-{i}", rp.proc, rp.log), rp.url)  # type: ignore[arg-type]
            for i, rp in enumerate(self.replicas)
        ]

    def stop_front_ends(self) -> int:
        for rp in self.replicas:
            rp.scrape()
        return super().stop_front_ends()

    def cleanup(self) -> None:
        for rp in self.replicas:  # a failed run may not have reached stop_front_ends
            rp.stop()
        super().cleanup()


def wait_for_load(gate: float | None, wait_s: float) -> bool:
    """Wait until the 1-minute load average is below ``gate``; False if it never was."""
    if gate is None:
        return True
    deadline = time.monotonic() + wait_s
    while os.getloadavg()[0] >= gate:
        if time.monotonic() > deadline:
            return False
        time.sleep(5)
    return True


def cache_view_variant(policy: str) -> str | None:
    """The variant of ``<variant>+kv`` (a default-policy variant on the cache views)."""
    name = policy.removesuffix("+kv")
    return name if policy.endswith("+kv") and name in VARIANTS else None


def one_run(args: argparse.Namespace, url: str, policy: str, seed: int, n: int) -> dict[str, Any]:
    variant = cache_view_variant(policy)
    peer = policy if policy in PEER_POLICIES or policy in VARIANTS else variant
    views = policy == CACHE_VIEW_POLICY or variant is not None
    if views and not args.trace:
        sys.exit(f"{policy} needs --trace (and engines with --cache-blocks)")
    real = policy in peer_routers.NAMES
    opts = DemoOptions(
        redis_url=url,
        deployment=f"gwpol{n}",
        log_level="warning",
        engines=args.engines,
        api_servers=args.gateways,
        duration=args.duration,
        policy="redisbal" if peer or real or views or policy == ROUTES_VIEW else policy,
        mode="tick",
        running_cap=args.running_cap,
        burst=int(args.burst_factor * args.engines * args.running_cap),
        burst_every=args.burst_every,
        mean_output=args.mean_output,
        max_output=args.max_output,
        sigma=args.sigma,
        slow=args.slow,
        seed=seed,
        slo_ttft_ms=args.slo_ttft_ms,
        drain_timeout=args.drain_timeout,
        keep_logs=args.keep_logs is not None,
    )
    lines: list[str] = []
    echo: Echo = lambda msg="", **kw: lines.append(str(msg))  # noqa: E731
    demo: ScenarioDemo
    if args.trace:
        trace = args.trace.replace("{seed}", str(seed))
        extra = shlex.split(args.engine_args)
        if real:
            demo = RouterDemo(opts, echo, trace, extra, policy, args.routers_venv)
        elif views:
            demo = CacheViewDemo(opts, echo, trace, extra, variant)
        else:
            demo = TraceDemo(opts, echo, trace, extra, peer)
            if policy == ROUTES_VIEW:
                demo.gateway_args = ("--prefix-tokens", "text", *args.prefix_cache_tokens)
    else:
        demo = ScenarioDemo(opts, echo)
    demo.split, demo.bypass = args.split, args.bypass_spec
    gated = wait_for_load(args.load_gate, args.load_gate_wait_s)
    load = os.getloadavg()[0]
    code = demo.run()
    if args.keep_logs is not None:  # each process's log, the gateways' access lines too
        kept = Path(args.keep_logs) / f"{policy.replace(':', '_')}-{seed}"
        shutil.rmtree(kept, ignore_errors=True)
        shutil.move(demo.logdir, kept)
    if code != 0:
        sys.exit(f"{policy} seed {seed} failed:\n" + "\n".join(lines[-30:]))
    lg = demo.results["loadgen"]
    est = demo.results["engines"]
    row = {k: lg[k] for k, _, _ in COLUMNS}
    row.update(
        policy=policy,
        seed=seed,
        requests=lg["requests"],
        ok=lg["ok"],
        lag_p99_ms=lg["lag_p99_ms"],
        load_imbalance=est["load_imbalance"],
        served=[e["served"] for e in est["engines"]],
        loadavg=load,
        loadavg_end=os.getloadavg()[0],
        load_gate_met=gated,
        scenario=scenario(
            args.gateways, args.engines, args.split, args.bypass_spec, args.slow, args.cache_blocks
        ),
        sent_per_replica=[d["requests"] for d in (lg.get("per_url") or {"": lg}).values()],
    )
    if demo.bypassed is not None:  # apart: never in the routed requests' figures
        row["bypass"] = {k: demo.bypassed.get(k) for k in BYPASS_KEYS}
    if isinstance(demo, TraceDemo):
        c = demo.cache
        row["hit_rate"] = c["cached_tokens"] / max(1, c["prompt_tokens"])
        row["saved_mtok"] = c["cached_tokens"] / 1e6
        row.update(c)
        row["peer_calls"] = demo.peer_calls
        row["held"] = demo.held
        st = demo.steps  # what the host added to each engine step (the simulator's knob)
        over = (st["step_taken_s"] - st["step_planned_s"]) / max(1, st["steps"])
        row["step_overshoot_ms"] = round(1000 * over, 3)
    if isinstance(demo, RouterDemo):
        row["paths"] = peer_routers.check_paths(
            policy, demo.replicas, demo.peer_calls, int(lg["requests"])
        )
    return row


def bypass_line(b: dict[str, Any]) -> str:
    p99 = b["ttft_p99_ms"]
    return f"{b['ok']}/{b['requests']} ok, TTFT p99 " + ("-" if p99 is None else f"{p99:.0f} ms")


def cell(values: list[float], spec: str) -> str:
    if len(values) == 1:
        return format(values[0], spec)
    mean = statistics.fmean(values)
    return f"{mean:{spec}} [{min(values):{spec}}-{max(values):{spec}}]"


def table(rows: list[dict[str, Any]], policies: list[str]) -> str:
    """One row per policy (mean [min-max] over seeds), saying the scenario that ran;
    the bypass client's figures in columns of their own."""
    cols = COLUMNS + (CACHE_COLUMNS if rows and "hit_rate" in rows[0] else ())
    bypass = bool(rows) and "bypass" in rows[0]
    extra = ["bypass TTFT p99 (ms)", "bypass ok / sent"] if bypass else []
    heads = ["policy", "scenario", *(h for _, h, _ in cols), "ok / sent", *extra]
    out = ["| " + " | ".join(heads) + " |", "|---" * len(heads) + "|"]
    notes = []
    for p in policies:
        mine = [r for r in rows if r["policy"] == p]
        cells = [cell([r[k] for r in mine], spec) for k, _, spec in cols]
        cells.append(f"{sum(r['ok'] for r in mine)} / {sum(r['requests'] for r in mine)}")
        if bypass:
            by = [r["bypass"] for r in mine]
            p99 = [b["ttft_p99_ms"] for b in by if b["ttft_p99_ms"] is not None]
            cells.append(cell(p99, ".0f") if p99 else "-")
            cells.append(f"{sum(b['ok'] for b in by)} / {sum(b['requests'] for b in by)}")
        label = f"{p} (emulation)" if p in EMULATIONS else p
        if p in peer_routers.NAMES:
            ran = sum(bool(r["paths"]["ok"]) for r in mine)
            label = f"{p} (real, path ran {ran}/{len(mine)})"
            notes += [f"- {p} seed {r['seed']}: {r['paths']['note']}" for r in mine]
        what = mine[0]["scenario"]["label"] if mine else ""
        out.append(f"| {label} | {what} | " + " | ".join(cells) + " |")
    return "\n".join(out + (["", *notes] if notes else []))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policies", default="redisbal,round-robin,vllm-latest,random")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--gateways", type=int, default=2, help="router replicas of each policy")
    ap.add_argument("--running-cap", type=int, default=16)
    ap.add_argument("--burst-factor", type=float, default=1.5, help="x engines x running cap")
    ap.add_argument("--burst-every", type=float, default=2.0)
    ap.add_argument("--duration", type=float, default=8.0)
    ap.add_argument("--mean-output", type=float, default=40.0)
    ap.add_argument("--max-output", type=int, default=400)
    ap.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma of output lengths")
    ap.add_argument(
        "--slow",
        action="append",
        default=[],
        metavar="ID[,ID...]:FACTOR",
        help="engines that step FACTOR times slower (repeatable; as demo --slow): "
        "heterogeneous engines, e.g. --slow 0,1,2,3:2",
    )
    ap.add_argument(
        "--split",
        type=float,
        default=None,
        help="replica 0's share of the requests (drawn per request from the seed: the same "
        "for every policy); the other replicas share the rest in turn [default: all in turn]",
    )
    ap.add_argument(
        "--bypass",
        default=None,
        metavar="RATE:ID[,ID...]",
        help="a client of its own sending Poisson RATE req/s straight to these engines (no "
        "router sees it) while the load runs, each request the lengths of a load request "
        "drawn at random; its figures are reported apart",
    )
    ap.add_argument("--slo-ttft-ms", type=float, default=500.0)
    ap.add_argument("--trace", default=None, help="replay this trace ({seed}: the seed)")
    ap.add_argument(
        "--engine-args",
        default="",
        help="more engine-sim arguments with --trace, e.g. '--cache-blocks 2048'",
    )
    ap.add_argument(
        "--drain-timeout",
        type=float,
        default=None,
        help="s after the load for the last answers [15; 90 with --trace: a long answer "
        "on a slow engine takes longer]",
    )
    ap.add_argument(
        "--prefix-cache-tokens",
        type=int,
        default=None,
        help=f"{ROUTES_VIEW}'s gateways' --prefix-cache-tokens [the gateway's default]",
    )
    ap.add_argument("--first-seed", type=int, default=1, help="seeds first-seed .. +seeds-1")
    ap.add_argument(
        "--routers-venv",
        default=str(peer_routers.default_venv()),
        help="venv the pinned peer routers are installed into (made on first use)",
    )
    ap.add_argument("--load-gate", type=float, default=None, help="wait for load avg below this")
    ap.add_argument("--load-gate-wait-s", type=float, default=600.0)
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--keep-logs",
        default=None,
        metavar="DIR",
        help="keep each run's logs in DIR/<policy>-<seed> (the gateways' access lines: "
        "each request's engine, hold and first-byte time)",
    )
    ap.add_argument("--plot", default=None, help="a PNG of each policy's TTFT p99 per seed")
    args = ap.parse_args()
    try:
        check_slow(args.slow, args.engines)
        check_split(args.split, args.gateways)
        args.bypass_spec = None if args.bypass is None else parse_bypass(args.bypass, args.engines)
        args.cache_blocks = cache_blocks(shlex.split(args.engine_args))
    except ValueError as exc:
        ap.error(str(exc))
    if args.plot:  # matplotlib is there before the runs, not after them
        try:
            pyplot()
        except click.ClickException as exc:
            ap.error(exc.message)
    if args.drain_timeout is None:
        args.drain_timeout = 90.0 if args.trace else 15.0
    cache_tokens = args.prefix_cache_tokens
    args.prefix_cache_tokens = (
        () if cache_tokens is None else ("--prefix-cache-tokens", str(cache_tokens))
    )
    if args.trace:
        spans = []
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            path = args.trace.replace("{seed}", str(seed))
            if not os.path.isfile(path):
                ap.error(f"--trace: no file {path}")
            spans.append(max((p.t for p in read_trace(path)), default=0.0))
        args.duration = max(spans) + 1.0
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    peers = [*sorted(PEER_POLICIES), *peer_routers.NAMES, *VARIANTS, CACHE_VIEW_POLICY, ROUTES_VIEW]
    known = sorted(POLICIES) + (peers if args.trace else [])
    bad = [p for p in policies if p not in known and not (args.trace and cache_view_variant(p))]
    if bad:
        ap.error(f"unknown policies {bad}; choose from {known} (peers need --trace)")
    if any(p in peer_routers.NAMES for p in policies):
        try:
            peer_routers.install(Path(args.routers_venv))
        except (peer_routers.RouterError, OSError, subprocess.CalledProcessError) as exc:
            sys.exit(f"gateway_policies: {exc}")
    server = RedisServer()
    server.start()
    rows: list[dict[str, Any]] = []
    t0 = time.monotonic()
    load0 = os.getloadavg()
    try:
        n = 0
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            k = (seed - 1) % len(policies)
            for policy in policies[k:] + policies[:k]:
                n += 1
                r = one_run(args, server.url, policy, seed, n)
                rows.append(r)
                print(
                    f"seed {seed} {policy:12s} TTFT p50 {r['ttft_p50_ms']:.0f} p99 "
                    f"{r['ttft_p99_ms']:.0f} ms, e2e p99 {r['e2e_p99_ms']:.0f} ms, goodput "
                    f"{r['goodput_rps']:.1f} req/s, hit {r.get('hit_rate', 0):.3f}, "
                    f"{r['ok']}/{r['requests']} ok, served "
                    f"{r['served']}, lag p99 {r['lag_p99_ms']:.1f} ms, load {r['loadavg']:.2f}"
                    + (f"; {r['paths']['note']}" if "paths" in r else "")
                    + (f"; bypass {bypass_line(r['bypass'])}" if "bypass" in r else ""),
                    flush=True,
                )
    finally:
        server.stop()
    took = time.monotonic() - t0
    load1 = os.getloadavg()
    print(
        f"\n{len(rows)} runs in {took:.0f} s; load average {load0[0]:.2f} -> {load1[0]:.2f}; "
        f"lag p99 max {max(r['lag_p99_ms'] for r in rows):.1f} ms\n"
    )
    print(table(rows, policies))
    drop = ("routers_venv", "bypass_spec", "cache_blocks")  # a machine path; in the scenario
    doc = {"args": {k: v for k, v in vars(args).items() if k not in drop}, "runs": rows}
    if args.json:
        with open(args.json, "wb") as fh:
            fh.write(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    if args.plot:
        print(f"plot: {plot_policy_seeds(doc, args.plot)}")


if __name__ == "__main__":
    main()
