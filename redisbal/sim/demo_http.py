"""``redisbal demo --http``: the demo on the real HTTP path.

The same Redis, coordinator and summary as the plain demo (redisbal.sim.demo),
but the engines serve the OpenAI API (``engine-sim --http-port 0``: ports the
system picks, registered in Redis), K ``redisbal gateway`` replicas lease their
client indexes (``--client-index auto``) and route, and one ``redisbal loadgen``
sends streamed requests to the gateways in turn. The summary adds what a client
of the gateways saw: TTFT and end-to-end latency per gateway and overall.
"""

from __future__ import annotations

import re
import time
import urllib.request
from typing import TYPE_CHECKING, Any

import orjson

from redisbal import endpoints
from redisbal.keys import DeploymentKeys
from redisbal.ops.table import render_table
from redisbal.sim.demo import Child, Children, Demo, DemoError, _fmt, user_lines

if TYPE_CHECKING:
    from redisbal.sim.load_plan import Planned

LISTENING = re.compile(rb"gateway listening on (http://\S+) \(client (\d+) of (\d+)")
PROMPT_MEAN = 64.0  # tokens; the simulated engines do not charge for prompts
# what a comparison reads (redisbal.sim.demo_compare): the keys loadgen and the API servers share
OVERALL = ("ttft_p50_ms", "ttft_p99_ms", "e2e_p50_ms", "e2e_p99_ms", "goodput_rps")


def _get(url: str, timeout: float = 2.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        body: bytes = resp.read()
        return body


class HttpDemo(Demo):
    """The demo with HTTP engines, gateways and an HTTP load generator."""

    gateways: list[tuple[Child, str]]
    gateway_args: tuple[str, ...] = ()  # more arguments for every gateway

    def engine_args(self) -> list[str]:
        return ["--http-port", "0"]

    def _gateway_url(self, child: Child, deadline: float) -> str:
        while time.monotonic() < deadline:
            self._check_children()
            m = LISTENING.search(child.log.read_bytes())
            if m:
                return m.group(1).decode()
            time.sleep(0.05)
        raise DemoError(f"{child.name} did not start listening; its log ends with:\n{child.tail()}")

    def _client_count(self, url: str) -> int:
        """The client count a gateway's router uses now (its /metrics gauge)."""
        text = _get(url + "/metrics").decode()
        m = re.search(r"^redisbal_gateway_client_count(?:\{[^}]*\})? (\S+)$", text, re.M)
        return int(float(m.group(1))) if m else 0

    def start_gateways(self) -> None:
        """K gateways on ports the system picks; returns once every one of them routes as
        one of K (leases taken and seen), so that no gateway starts as the only one."""
        assert self.children is not None
        o = self.opts
        started = [
            self.children.start(
                f"gateway-{i}",
                "gateway",
                "--port",
                "0",
                "--client-index",
                "auto",
                "--lease-ttl-s",
                "1.5",
                "--policy",
                o.policy,
                "--refresh-s",
                "0.5",
                *self.gateway_args,
            )
            for i in range(o.api_servers)
        ]
        deadline = time.monotonic() + o.startup_timeout
        self.gateways = [(c, self._gateway_url(c, deadline)) for c in started]
        while not all(self._client_count(u) == o.api_servers for _, u in self.gateways):
            if time.monotonic() > deadline:
                raise DemoError(f"the gateways did not all see {o.api_servers} API servers")
            self._check_children()
            time.sleep(0.1)
        urls = ", ".join(u for _, u in self.gateways)
        self.echo(f"{o.api_servers} gateways (policy {o.policy}) leased their indexes: {urls}")

    def planned(self) -> list[Planned]:
        """The load's requests (what loadgen will draw from the same options and seed)."""
        from redisbal.sim.load_plan import plan

        o = self.opts
        return plan(
            rate=o.rate or 1.0,
            duration=o.duration,
            arrival="bursts" if o.burst else "poisson",
            burst=o.burst,
            burst_every=o.burst_every,
            prompt_mean=PROMPT_MEAN,
            output_mean=o.mean_output,
            sigma=o.sigma,
            seed=o.seed,
            output_cap=o.max_output,
        )

    def run_load(self) -> list[Child]:
        assert self.children is not None
        o = self.opts
        self.start_gateways()
        arrival = "bursts" if o.burst else "poisson"
        total = len(self.planned())
        load = (
            f"bursts of {o.burst} requests every {o.burst_every:g} s"
            if o.burst
            else f"Poisson {o.rate:g} req/s"
        )
        self.echo(
            f"starting loadgen: {load} for {o.duration:g} s, {total} streamed requests "
            "to the gateways in turn"
        )
        args = ["--arrival", arrival, "--rate", str(o.rate or 1.0), "--burst", str(o.burst or 1)]
        args += ["--burst-every-s", str(o.burst_every), "--duration", str(o.duration)]
        args += ["--output-mean", str(o.mean_output), "--max-output", str(o.max_output)]
        args += ["--prompt-mean", str(PROMPT_MEAN), "--sigma", str(o.sigma), "--seed", str(o.seed)]
        return [self.start_loadgen(args, total)]

    def start_loadgen(self, args: list[str], total: int) -> Child:
        """Start ``redisbal loadgen`` with ``args`` through every gateway (plus the run's
        timeout, objective and stats file) and show its progress until it ends."""
        assert self.children is not None
        o = self.opts
        args = [*args, "--timeout-s", str(o.duration + o.drain_timeout + 30)]
        if o.slo_ttft_ms:
            args += ["--slo-ttft-ms", str(o.slo_ttft_ms)]
        for _, url in self.gateways:
            args += ["--url", url]
        start = time.time()
        gen = self.children.start(
            "loadgen", "loadgen", *args,
            "--stats-out", str(self.logdir / "loadgen.json"), "--no-progress",
        )  # fmt: skip
        self.progress([gen], total, start)
        return gen

    def progress(self, apis: list[Child], total: int, start_at: float) -> None:
        """Requests at the engines (their /sim/state) and the snapshot's loads."""
        urls = endpoints.fetch_sync(self.client, DeploymentKeys(self.opts.deployment))

        def counts() -> str:
            arrived = done = 0
            for url in urls.values():
                try:
                    st = orjson.loads(_get(url + "/sim/state"))
                except OSError:
                    continue
                arrived += st["arrived"]
                done += st["served"]
            return f"at engines {arrived}/{total}  done {done}  in flight {arrived - done}"

        self.show_progress(apis, start_at, "loadgen", counts)

    def stop_front_ends(self) -> int:
        code = 0
        for child, _ in self.gateways:
            rc = Children.stop(child)
            if rc not in (0, None):
                self.echo(f"{child.name} exited with {rc}; its log ends with:\n{child.tail()}")
                code = 1
        return code

    def client_summary(self) -> tuple[int, list[str]]:
        f = self.logdir / "loadgen.json"
        if not f.exists():
            raise DemoError("loadgen wrote no figures")
        lg: dict[str, Any] = orjson.loads(f.read_bytes())
        self.results["loadgen"] = lg
        per_url = lg.get("per_url") or {lg["url"]: lg}
        rows = [("gateway", "sent", "ok", "TTFT p50", "TTFT p99", "e2e p50", "e2e p99")]
        for (child, url), (_, d) in zip(self.gateways, per_url.items(), strict=True):
            rows.append(
                (
                    f"{child.name} {url}",
                    str(d["requests"]),
                    str(d["ok"]),
                    _fmt(d["ttft_p50_ms"], ".1f") + "ms",
                    _fmt(d["ttft_p99_ms"], ".1f") + "ms",
                    _fmt(d["e2e_p50_ms"], ".1f") + "ms",
                    _fmt(d["e2e_p99_ms"], ".1f") + "ms",
                )
            )
        if not self.brief:
            self.echo("per gateway (as loadgen saw it):")
            self.echo(render_table(rows))
            self.echo("")
        self.results["overall"] = {k: lg.get(k) for k in OVERALL}
        lines = user_lines(lg, self.opts.slo_ttft_ms)
        lines.append(f"loadgen lag p99 {_fmt(lg['lag_p99_ms'], '.1f')} ms")
        errors = ", ".join(f"{k} {v}" for k, v in lg["errors"].items())
        lines.append(
            f"loadgen: {lg['ok']} of {lg['requests']} ok" + (f"; {errors}" if errors else "")
        )
        return lg["requests"], lines
