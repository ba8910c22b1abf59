"""``redisbal demo``: the whole system as real processes, for a few seconds.

1. a redis-server (embedded: ``redisbal.sim.embedded.RedisServer``) unless a URL is given;
2. ``redisbal coordinator`` expecting the engines (the first snapshot waits for all);
3. ``redisbal engine-sim`` with N simulated engines;
4. K ``redisbal api`` processes, one router each, sending bursts on one shared
   wall-clock schedule;
5. a progress line while the load runs, then the per-engine and per-API-server
   tables, what users would feel (TTFT, end-to-end latency, goodput: measured by the
   API servers) and the balance figures (diagnostics).

``redisbal demo --compare`` runs it again with a baseline policy
(redisbal.sim.demo_compare).

Every child runs in its own process group and is stopped (SIGTERM, then
SIGKILL) in a ``finally`` block, on Ctrl-C, on SIGTERM and, as a backstop, at
interpreter exit. Children get the Redis URL through the environment, not
argv, so that a password never shows up in ``ps``.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
import orjson

from redisbal.barrier.snapshot import Snapshot
from redisbal.connection import make_client, redact
from redisbal.errors import DemoError as DemoError
from redisbal.keys import DeploymentKeys
from redisbal.ops.cli import EXIT_WITH_PARENT_ENV
from redisbal.ops.cli_options import signals_handled
from redisbal.ops.table import render_table
from redisbal.routing.policies import DEFAULT_POLICY
from redisbal.sim.api_sim import LoadSpec, latency_figures, schedule
from redisbal.sim.embedded import RedisServer
from redisbal.sim.engine_sim import format_engine_table
from redisbal.sim.transport import SimKeys

Echo = Callable[..., Any]


@dataclass
class DemoOptions:
    redis_url: str | None = None
    deployment: str = "default"
    log_level: str = "info"
    engines: int = 8
    api_servers: int = 3
    duration: float = 6.0
    policy: str = DEFAULT_POLICY
    mode: str = "lockstep"
    running_cap: int = 16
    burst: int = 192
    burst_every: float = 2.0
    burst_window_ms: float = 50.0
    rate: float = 0.0
    mean_output: float = 40.0
    max_output: int = 200  # keeps the demo's tail (and run time) short
    slow: list[str] = field(default_factory=list)
    seed: int = 0
    slo_ttft_ms: float | None = None  # goodput's TTFT objective
    sigma: float = 1.0  # lognormal sigma of output lengths (the tail)
    keep_logs: bool = False
    drain_timeout: float = 15.0
    startup_timeout: float = 30.0

    def load(self) -> LoadSpec:
        return LoadSpec(
            duration_s=self.duration,
            burst=self.burst,
            burst_window_ms=self.burst_window_ms,
            burst_every_s=self.burst_every,
            rate=self.rate,
            mean_output=self.mean_output,
            max_output=self.max_output,
            sigma=self.sigma,
            seed=self.seed,
        )


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def tail(self, chars: int = 1500) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


class Children:
    """The subprocesses of one demo, each in its own process group."""

    def __init__(self, logdir: Path, env: dict[str, str]) -> None:
        self.logdir = logdir
        self.env = env
        self.children: list[Child] = []

    def start(self, name: str, *args: str) -> Child:
        log = self.logdir / f"{name}.log"
        with open(log, "wb") as fh:
            proc = subprocess.Popen(
                [sys.executable, "-m", "redisbal", *args],
                stdin=subprocess.DEVNULL,
                stdout=fh,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )
        child = Child(name, proc, log)
        self.children.append(child)
        return child

    @staticmethod
    def stop(child: Child, timeout: float = 10.0) -> int | None:
        """SIGTERM the child's process group, wait, then SIGKILL. Returns its exit code."""
        proc = child.proc
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
        return proc.returncode

    def stop_all(self) -> None:
        for child in reversed(self.children):
            self.stop(child, timeout=5.0)

    def failed(self) -> Child | None:
        """A child that exited on its own with an error."""
        for child in self.children:
            code = child.proc.poll()
            if code not in (None, 0):
                return child
        return None


def _raise_on_sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def stops_as_ctrl_c() -> Iterator[None]:
    """Within it SIGTERM and SIGHUP (its terminal closed) raise KeyboardInterrupt, so a
    demo stops as on Ctrl-C, every process it started too; the old handlers come back
    after."""
    with signals_handled(_raise_on_sigterm, signal.SIGTERM, signal.SIGHUP):
        yield


def _natural(name: str) -> tuple[int, str]:
    return (int(name), "") if name.isdigit() else (1 << 62, name)


def _fmt(v: float | None, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def user_lines(overall: dict[str, Any], slo_ttft_ms: float | None) -> list[str]:
    """The figures users feel, from ``results["overall"]``, as the summary says them."""
    lines = [
        f"TTFT p50 {_fmt(overall['ttft_p50_ms'], '.1f')} ms, "
        f"p99 {_fmt(overall['ttft_p99_ms'], '.1f')} ms; "
        f"end-to-end p99 {_fmt(overall['e2e_p99_ms'], '.1f')} ms"
    ]
    if slo_ttft_ms is not None and overall.get("goodput_rps") is not None:
        lines.append(
            f"goodput {_fmt(overall['goodput_rps'])} req/s of load within TTFT "
            f"{slo_ttft_ms:g} ms ({_fmt(overall['slo_attainment'] * 100, '.1f')} % of requests)"
        )
    return lines


class Demo:
    """One run. ``logdir_parent``: make the log directory there (a comparison's runs
    share one); ``brief``: print the figures users feel, not the per-engine and
    per-API-server tables."""

    def __init__(
        self,
        opts: DemoOptions,
        echo: Echo,
        *,
        logdir_parent: Path | None = None,
        brief: bool = False,
    ) -> None:
        self.opts = opts
        self.echo = echo
        self.brief = brief
        self.logdir = Path(tempfile.mkdtemp(prefix="redisbal-demo-", dir=logdir_parent))
        self.server: Any = None
        self.children: Children | None = None
        self.client: Any = None
        self.url = ""
        self.failed = False
        self.results: dict[str, Any] = {}  # the summary's figures, for scripts
        self.part = logdir_parent is not None  # one run of a comparison, which says the rest

    # -- steps ------------------------------------------------------------------------------

    def start_redis(self) -> None:
        if self.opts.redis_url:
            self.url = self.opts.redis_url
            if not self.part:
                self.echo(f"using Redis at {redact(self.url)}")
            return
        self.server = RedisServer(workdir=str(self.logdir / "redis"))
        Path(self.server.dir).mkdir(exist_ok=True)
        self.server.start()
        self.url = self.server.url
        v = ".".join(map(str, self.server.version))
        self.echo(f"started redis-server {v} ({self.server.binary}) on {self.url}")

    def start_processes(self) -> None:
        o = self.opts
        env = {
            **os.environ,
            "REDISBAL_REDIS_URL": self.url,
            "REDISBAL_DEPLOYMENT": o.deployment,
            "REDISBAL_LOG_LEVEL": o.log_level,
            "PYTHONUNBUFFERED": "1",
            EXIT_WITH_PARENT_ENV: str(os.getpid()),  # they stop when the demo is gone
        }
        self.children = Children(self.logdir, env)
        self.client = make_client(self.url, socket_connect_timeout=2.0, socket_timeout=5.0)
        self.client.delete(SimKeys(o.deployment).progress)
        self.children.start(
            "coordinator",
            "coordinator",
            "--expect",
            str(o.engines),
            "--stall-ms",
            "100",
            "--dead-after-ms",
            "3000",
            "--join-grace-ms",
            "300",
            "--idle-publish-ms",
            "500",
        )
        self.children.start(
            "engine-sim",
            "engine-sim",
            "--engines",
            str(o.engines),
            "--mode",
            o.mode,
            "--running-cap",
            str(o.running_cap),
            "--stats-out",
            str(self.logdir / "engines.json"),
            *[a for s in o.slow for a in ("--slow", s)],
            *self.engine_args(),
        )
        self.echo(
            f"started coordinator and {o.engines} {o.mode} engines x {o.running_cap} slots; "
            "waiting for the first snapshot with every engine ..."
        )
        snap = self.wait_first_snapshot()
        ids = ", ".join(sorted(snap.engines, key=_natural))
        self.echo(f"first snapshot v{snap.version}: engines {ids}")

    def engine_args(self) -> list[str]:
        """More engine-sim arguments (the HTTP demo's)."""
        return []

    def wait_first_snapshot(self) -> Snapshot:
        assert self.children is not None
        keys = DeploymentKeys(self.opts.deployment)
        deadline = time.monotonic() + self.opts.startup_timeout
        while time.monotonic() < deadline:
            self._check_children()
            raw = self.client.get(keys.snapshot)
            if raw:
                snap = Snapshot.from_json(raw)
                if len(snap.engines) >= self.opts.engines:
                    return snap
            time.sleep(0.05)
        raise DemoError(
            f"no snapshot with all {self.opts.engines} engines after {self.opts.startup_timeout:g}s"
        )

    def _check_children(self) -> None:
        assert self.children is not None
        bad = self.children.failed()
        if bad is not None:
            raise DemoError(
                f"{bad.name} exited with {bad.proc.returncode}; its log ends with:\n{bad.tail()}"
            )

    def run_load(self) -> list[Child]:
        assert self.children is not None
        o = self.opts
        spec = o.load()
        total = sum(len(schedule(spec, i, o.api_servers)) for i in range(o.api_servers))
        start_at = time.time() + 1.0 + 0.3 * o.api_servers
        load = (
            f"bursts of {o.burst} requests within {o.burst_window_ms:g} ms every "
            f"{o.burst_every:g} s"
            if o.burst
            else ""
        )
        if o.rate:
            load += (" plus " if load else "") + f"Poisson {o.rate:g} req/s"
        self.echo(
            f"starting {o.api_servers} API servers (policy {o.policy}): {load} "
            f"for {o.duration:g} s, {total} requests"
        )
        apis = []
        for i in range(o.api_servers):
            apis.append(
                self.children.start(
                    f"api-{i}",
                    "api",
                    "--client-index",
                    str(i),
                    "--client-count",
                    str(o.api_servers),
                    "--policy",
                    o.policy,
                    "--burst",
                    str(o.burst),
                    "--burst-window-ms",
                    str(o.burst_window_ms),
                    "--burst-every",
                    str(o.burst_every),
                    "--rate",
                    str(o.rate),
                    "--duration",
                    str(o.duration),
                    "--mean-output",
                    str(o.mean_output),
                    "--max-output",
                    str(o.max_output),
                    "--sigma",
                    str(o.sigma),
                    "--seed",
                    str(o.seed),
                    "--start-at",
                    f"{start_at:.3f}",
                    "--drain-timeout",
                    str(o.drain_timeout),
                    "--stats-out",
                    str(self.logdir / f"api-{i}.json"),
                )
            )
        self.progress(apis, total, start_at)
        return apis

    def progress(self, apis: list[Child], total: int, start_at: float) -> None:
        keys = SimKeys(self.opts.deployment)

        def counts() -> str:
            got = {k.decode(): int(v) for k, v in self.client.hgetall(keys.progress).items()}
            sent = sum(v for k, v in got.items() if k.startswith("sent:"))
            done = sum(v for k, v in got.items() if k.startswith("done:"))
            return f"sent {sent}/{total}  done {done}  in flight {sent - done}"

        self.show_progress(apis, start_at, "API servers", counts)

    def show_progress(
        self, apis: list[Child], start_at: float, who: str, counts: Callable[[], str]
    ) -> None:
        """Until the load processes end: a progress line every 0.2 s (rewritten in
        place on a terminal, once a second otherwise) of ``counts()`` and the latest
        snapshot's loads."""
        dkeys = DeploymentKeys(self.opts.deployment)
        tty = sys.stdout.isatty()
        deadline = start_at + self.opts.duration + self.opts.drain_timeout + 30
        last_print = 0.0
        while any(a.proc.poll() is None for a in apis):
            if time.time() > deadline:
                raise DemoError(f"{who} did not finish in time")
            self._check_children()
            t = time.time() - start_at
            if t < 0:
                time.sleep(0.1)
                continue
            line = f"[{t:5.1f}s] {counts()}"
            raw = self.client.get(dkeys.snapshot)
            snap = Snapshot.from_json(raw) if raw else None
            if snap is not None and snap.engines:
                loads = [c.load for c in snap.engines.values()]
                mean = sum(loads) / len(loads)
                line += (
                    f"  snapshot v{snap.version}  engine load max {max(loads)} / mean {mean:.1f}"
                )
            if tty:
                self.echo("\r" + line + "\x1b[K", nl=False)
            elif time.monotonic() - last_print >= 1.0:
                self.echo(line)
                last_print = time.monotonic()
            time.sleep(0.2)
        if tty:
            self.echo("")

    def finish(self, apis: list[Child]) -> int:
        assert self.children is not None
        code = 0
        for a in apis:
            if a.proc.returncode != 0:
                self.echo(
                    f"{a.name} exited with {a.proc.returncode}; its log ends with:\n{a.tail()}"
                )
                code = 1
        by_name = {c.name: c for c in self.children.children}
        code = max(code, self.stop_front_ends())
        rc = Children.stop(by_name["engine-sim"])
        if rc not in (0, None):
            self.echo(f"engine-sim exited with {rc}:\n{by_name['engine-sim'].tail()}")
            code = 1
        Children.stop(by_name["coordinator"])
        status = self.client.hgetall(DeploymentKeys(self.opts.deployment).meta)
        meta = {k.decode(): v.decode() for k, v in status.items()}
        self.summary(meta)
        return code

    def stop_front_ends(self) -> int:
        """Stop what stands between the load and the engines (the HTTP demo's gateways)
        before the engines; 1 if one of them failed."""
        return 0

    def summary(self, meta: dict[str, str]) -> None:
        engines_file = self.logdir / "engines.json"
        if not engines_file.exists():
            raise DemoError("engine-sim wrote no figures")
        est = orjson.loads(engines_file.read_bytes())
        self.results = {"engines": est, "barrier": meta}
        self.echo("")
        if not self.brief:
            self.echo("per engine:")
            self.echo(format_engine_table(est))
            self.echo("")
        sent, lines = self.client_summary()
        self.results.setdefault("overall", {})["load_imbalance"] = est["load_imbalance"]
        served = sum(e["served"] for e in est["engines"])
        self.echo(f"what users feel (policy {self.opts.policy}):")
        for line in [*lines, f"requests: {sent} sent, {served} served"]:
            self.echo("  " + line)
        if self.brief:
            return
        self.echo("balance (diagnostics):")
        self.echo(
            "  load imbalance, time-averaged (max-mean)/mean:  "
            f"{_fmt(est['load_imbalance'])}   (0 = even)"
        )
        if est["bursts"]:
            self.echo(
                "  per-burst max/mean of assignments:              "
                f"{_fmt(est['burst_max_over_mean'])}   (1.00 = even; {est['bursts']} bursts)"
            )
        if est["mode"] == "lockstep":
            self.echo(
                "  lockstep efficiency (mean/max running):         "
                f"{_fmt(est['lockstep_efficiency'])}   (1.00 = even batches)"
            )
        self.echo(
            "  barrier: "
            + ", ".join(
                f"{k} {meta.get(k, '0')}"
                for k in ("published", "forced", "stale", "late", "expired")
            )
        )

    def client_summary(self) -> tuple[int, list[str]]:
        """Print the table of the load's senders (unless brief), put the figures users
        feel into ``results["overall"]`` (ms, req/s); returns the requests sent and the
        lines that say those figures."""
        o = self.opts
        apis = []
        for i in range(o.api_servers):
            f = self.logdir / f"api-{i}.json"
            if f.exists():
                apis.extend(orjson.loads(f.read_bytes()))
        self.results["api_servers"] = apis
        slo = o.slo_ttft_ms

        def figures(ttft_ms: list[float], e2e_ms: list[float]) -> dict[str, Any]:
            return latency_figures(ttft_ms, e2e_ms, o.slo_ttft_ms, o.duration)

        rows: list[tuple[str, ...]] = [
            ("api", "sent", "completed", "degraded", "snapshots", "TTFT p50", "TTFT p99")
        ]
        rows[0] += ("e2e p99",) + (("goodput",) if slo is not None else ())
        for a in apis:
            fig = figures(a["ttft_ms"], a["e2e_ms"])
            row = (
                str(a["client_index"]),
                str(a["sent"]),
                str(a["completed"]),
                str(a["degraded_routes"]),
                str(a["snapshots"]),
                _fmt(fig["ttft_p50_ms"], ".1f") + "ms",
                _fmt(fig["ttft_p99_ms"], ".1f") + "ms",
                _fmt(fig["e2e_p99_ms"], ".1f") + "ms",
            )
            rows.append(row + ((_fmt(fig["goodput_rps"]) + "/s",) if slo is not None else ()))
        if not self.brief:
            self.echo("per API server (TTFT = queue delay + prefill, as the API server saw it):")
            self.echo(render_table(rows))
            self.echo("")
        overall = figures(
            [t for a in apis for t in a["ttft_ms"]], [t for a in apis for t in a["e2e_ms"]]
        )
        self.results["overall"] = overall
        return sum(a["sent"] for a in apis), user_lines(overall, o.slo_ttft_ms)

    # -- all of it --------------------------------------------------------------------------

    def cleanup(self) -> None:
        if self.children is not None:
            self.children.stop_all()
        if self.client is not None:
            with contextlib.suppress(Exception):
                self.client.close()
            self.client = None
        if self.server is not None:
            self.server.stop()
            self.server = None
        if self.opts.keep_logs or self.failed:
            self.echo(f"logs: {self.logdir}")
        else:
            shutil.rmtree(self.logdir, ignore_errors=True)

    def run(self) -> int:
        t0 = time.monotonic()
        atexit.register(self.cleanup)
        with stops_as_ctrl_c():
            code = self._run()
        if code == 0 and not self.part:
            self.echo(f"demo finished in {time.monotonic() - t0:.1f} s; all its processes stopped")
        return code

    def _run(self) -> int:
        """The demo's steps; its processes stopped at the end, however it ends."""
        try:
            self.start_redis()
            self.start_processes()
            apis = self.run_load()
            code = self.finish(apis)
            self.failed = code != 0
        except DemoError as exc:
            self.failed = True
            self.echo(f"\ndemo failed: {exc}", err=True)
            code = 1
        except KeyboardInterrupt:
            self.echo("\ninterrupted: stopping every process the demo started", err=True)
            code = 130
        finally:
            self.cleanup()
            atexit.unregister(self.cleanup)
        return code


def run_demo(opts: DemoOptions, echo: Echo = click.echo) -> int:
    """Run the demo; returns the exit code (0 on success)."""
    return Demo(opts, echo).run()
