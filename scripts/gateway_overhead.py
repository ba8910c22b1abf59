#!/usr/bin/env python3
"""What one gateway adds: the same open-loop load straight to an engine and through
the gateway, interleaved in one run, so that host noise hits both alike.

Starts a redis-server, one HTTP engine simulator (1 ms steps: it answers within a
millisecond or two and does not spin) and one ``redisbal gateway`` process per
``--loops`` kind (asyncio, uvloop), then for each rate runs ``redisbal loadgen``'s
generator against the engine and against each gateway, ``--reps`` times each,
alternating. Non-streamed small bodies (one output token) give added end-to-end
latency; streamed requests give added time to first token. ``--whole-tokens N`` makes
the whole requests N tokens long, so that many wait on the engine at once (what a
gateway costs per waiting request; ``--engine-args '--per-seq-ms 0.01'`` keeps the
engine's steps short with many running). The gateway's CPU time and its run-queue wait
(time runnable but not running: what a contended host adds) come from
/proc/<pid>/schedstat; "inside" is the gateway's own added-latency histogram.

    python scripts/gateway_overhead.py --rates 100,200,500 --duration 5 --reps 2 \
        --loops asyncio,uvloop --json out.json --plot out.png

``--auth``: also one gateway per loop kind that requires an API key (from a file), in
the same interleaved run; every request carries the key, whatever its target.

The gateways of one run are replicas of one deployment (indexes leased in Redis); they
tell each other their routes only with ``--tell-routes`` (what two replicas pay for
shared routes: each request's PUBLISH; the idle one's hearing is not counted).

``--bare``: also, per loop kind, the gateway's HTTP parts passing requests to the
engine and nothing else (redisbal.bench.bare_proxy): the floor under the gateway, so
that its overhead splits into what carrying a request costs and what redisbal adds.

Every gateway runs with ``--access-log off`` unless asked otherwise. ``--tracing``: also,
per loop kind, a gateway that traces every request (``--otlp-traces-endpoint`` to a
sink that takes OTLP/HTTP and drops it; 100% sampled) and one that writes JSON access
lines (to /dev/null); ``--other-src DIR``: also a gateway run from another source tree
(say ``git archive`` of an older commit), on this venv; ``--twin``: also a second plain
gateway, the same as the first, whose ratio to it is what noise alone moves a ratio. A
second table then gives each target's CPU over the first loop kind's plain gateway in
the same repetition. "Tracing off: no measurable change" is the plain gateway (no
endpoint; ``--access-log off``) against ``--other-src`` of a tree without tracing, read
beside the twin's ratio (the other tree's engine and Redis schema must match this
one's: check that its requests all succeed):

    git archive <the commit before tracing> | tar -x -C /tmp/before-tracing
    python scripts/gateway_overhead.py --rates 300 --duration 5 --reps 6 --tracing \
        --twin --other-src /tmp/before-tracing

``--peers vllm-router:power_of_two,sglang-router:cache_aware``: also one replica of
each real peer router (redisbal.bench.peer_routers: pinned, installed into a venv of its
own on first use, ``--routers-venv``) in front of the same engine, in the same
interleaved run; their CPU comes from schedstat as the gateway's (they have no
"inside" histogram). A second table then gives each target's CPU over the first
peer's in the same repetition: its median and range say how far host noise moves it.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import click
import orjson

from redisbal.bench import peer_routers
from redisbal.bench.loadgen import run
from redisbal.bench.plots import plot_overhead, pyplot
from redisbal.sim.embedded import RedisServer
from redisbal.sim.load_plan import plan

BENCH_KEY = "bench-key-0123456789abcdef"
HERE = os.path.dirname(os.path.abspath(__file__))
REDISBAL = os.path.join(os.path.dirname(sys.executable), "redisbal")


# an OTLP/HTTP endpoint that takes every export and drops it (a process of its own)
SINK = """
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

class Sink(BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass

ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Sink).serve_forever()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def check_one_engine(name: str, health: bytes) -> None:
    """Exit unless the gateway (its ``/health`` body) routes to exactly the one engine
    that direct loads (with more, its side would run at a fraction of the engine load)."""
    engines = orjson.loads(health).get("engines", [])
    if len(engines) != 1:
        sys.exit(f"{name} sees {len(engines)} engines ({engines}), not the one measured direct")


def wait_http(url: str, timeout: float = 60.0) -> bytes:
    """The body of ``url``'s first 200 answer, polled until ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return bytes(r.read())
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} not ready")
        time.sleep(0.2)


def added_hist(base: str, stream: bool) -> dict[float, float]:
    """The gateway's own added-latency histogram (cumulative bucket counts)."""
    import re
    import urllib.request

    with urllib.request.urlopen(base + "/metrics", timeout=5) as r:
        text = r.read().decode()
    want = "true" if stream else "false"
    pat = r'^redisbal_gateway_added_latency_seconds_bucket\{le="([^"]+)",stream="(\w+)"\} (\S+)$'
    out = {}
    for le, st, v in re.findall(pat, text, re.M):
        if st == want:
            out[float(le)] = float(v)
    return out


def hist_quantile(buckets: dict[float, float], q: float) -> float | None:
    """The upper bound (ms) of the bucket holding the q-quantile."""
    total = buckets.get(float("inf"), 0)
    if total <= 0:
        return None
    for le in sorted(buckets):
        if buckets[le] >= q * total:
            return le * 1000
    return None


def one_run(
    url: str, rate: float, duration: float, stream: bool, seed: int, whole_tokens: int = 1
) -> dict[str, Any]:
    planned = plan(
        rate=rate,
        duration=duration,
        arrival="poisson",
        burst=1,
        burst_every=1.0,
        prompt_mean=8,
        output_mean=8 if stream else whole_tokens,
        sigma=0.0,
        seed=seed,
    )
    opts = {
        "model": "redisbal-sim",
        "stream": stream,
        "chat": False,
        "ignore_eos": True,
        "headers": {"Content-Type": "application/json", "Authorization": f"Bearer {BENCH_KEY}"},
        "timeout": 30.0,
        "progress": False,
    }
    return asyncio.run(run(url, planned, opts))


def listen_overflows() -> int:
    """The host's TcpExt ListenOverflows: connects dropped on a full accept queue (each
    costs the client a 1 s SYN retransmit), whoever's socket it was."""
    with open("/proc/net/netstat") as fh:
        lines = [ln.split() for ln in fh if ln.startswith("TcpExt:")]
    return int(dict(zip(lines[0], lines[1], strict=True)).get("ListenOverflows", 0))


def schedstat(pid: int) -> tuple[float, float]:
    """(CPU seconds, seconds spent runnable but waiting for a CPU) of a process, summed
    over its threads (/proc/PID/schedstat is the main thread's alone: the Rust routers
    serve on worker threads). Threads are long-lived here: none exits mid-run."""
    cpu = wait = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as fh:
                cpu_ns, wait_ns, _ = fh.read().split()
        except FileNotFoundError:  # a thread that ended since the listing
            continue
        cpu += int(cpu_ns)
        wait += int(wait_ns)
    return cpu / 1e9, wait / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rates", default="200,500")
    ap.add_argument("--duration", type=float, default=8.0)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--modes", default="whole,stream")
    ap.add_argument("--loops", default="uvloop", help="one gateway per event loop kind")
    ap.add_argument(
        "--whole-tokens",
        type=int,
        default=1,
        help="output tokens of each whole (non-streamed) request: more keeps more in flight",
    )
    ap.add_argument(
        "--engine-args", default="", help="more engine-sim arguments, e.g. '--per-seq-ms 0.01'"
    )
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None, help="also a PNG of CPU per request (matplotlib)")
    ap.add_argument("--auth", action="store_true", help="also a gateway with an API key")
    ap.add_argument(
        "--tell-routes",
        action="store_true",
        help="the gateways tell each other their routes (as replicas do; off: each alone)",
    )
    ap.add_argument("--bare", action="store_true", help="also the gateway's HTTP parts alone")
    ap.add_argument("--peers", default="", help="also these real routers (ROUTER:POLICY,...)")
    ap.add_argument("--routers-venv", default=None, help="the peer routers' venv")
    ap.add_argument(
        "--tracing",
        action="store_true",
        help="also gateways that trace every request and that write JSON access lines",
    )
    ap.add_argument("--other-src", default=None, help="also a gateway from this source tree")
    ap.add_argument(
        "--twin",
        action="store_true",
        help="also a second plain gateway, the same as the first: its ratio to the first is "
        "the run's noise floor",
    )
    a = ap.parse_args()
    peers = [p for p in a.peers.split(",") if p]
    if "uvloop" in a.loops.split(",") and importlib.util.find_spec("uvloop") is None:
        sys.exit("gateway_overhead: no uvloop here: pip install uvloop, or --loops asyncio")
    if a.plot:  # matplotlib is there before the run, not after it
        try:
            pyplot()
        except click.ClickException as exc:
            sys.exit(f"gateway_overhead: {exc.message}")
    try:
        for p in peers:
            peer_routers.split_name_without_events(p)
        venv = peer_routers.install(Path(a.routers_venv) if a.routers_venv else None)
    except peer_routers.RouterError as exc:
        sys.exit(f"gateway_overhead: {exc}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # so that the finally runs
    rates = [float(r) for r in a.rates.split(",")]
    modes = [m == "stream" for m in a.modes.split(",")]
    procs: list[subprocess.Popen[bytes]] = []
    replicas: list[peer_routers.RouterProcess] = []
    rows: list[dict[str, Any]] = []
    with RedisServer(tcp=True) as server:
        eport = free_port()
        env = {**os.environ, "REDISBAL_REDIS_URL": server.url, "REDISBAL_DEPLOYMENT": "ovh"}
        engine = [
            REDISBAL,
            "engine-sim",
            "--engines",  # one: direct, the gateways and the peers all load the same engine
            "1",
            "--http-port",
            str(eport),
            "--base-step-ms",
            "1",
            "--running-cap",
            "1024",
            "--log-level",
            "warning",
            *a.engine_args.split(),
        ]
        try:
            procs.append(subprocess.Popen(engine, env=env))
            wait_http(f"http://127.0.0.1:{eport}/health")
            gws: dict[str, tuple[str, int]] = {}
            key_file = os.path.join(str(server.dir), "api-keys")
            with open(key_file, "w") as fh:
                fh.write(BENCH_KEY + "\n")
            sink = ""
            if a.tracing:
                sport = free_port()
                procs.append(subprocess.Popen([sys.executable, "-c", SINK, str(sport)]))
                sink = f"http://127.0.0.1:{sport}"
            variants = [""] + (["-auth"] if a.auth else []) + (["-traced", "-logged"] * a.tracing)
            variants += ["-other"] if a.other_src else []
            variants += ["-twin"] if a.twin else []
            for kind in a.loops.split(","):
                for variant in variants:
                    port = free_port()
                    cmd = [REDISBAL, "gateway", "--port", str(port), "--log-level", "warning"]
                    cmd += ["--event-loop", kind, "--client-index", "auto"]
                    # the run's gateways lease indexes of one deployment: 2+ replicas,
                    # which tell each other their routes only when asked to
                    cmd += ["--tell-routes" if a.tell_routes else "--no-tell-routes"]
                    genv, out, cwd = env, None, None
                    if variant == "-auth":
                        cmd += ["--api-key-file", key_file]
                    if variant == "-traced":
                        cmd += ["--otlp-traces-endpoint", sink]
                    if variant == "-logged":
                        cmd += ["--access-log", "json"]
                        out = subprocess.DEVNULL
                    elif variant != "-other":
                        cmd += ["--access-log", "off"]
                    if variant == "-other":  # (an older gateway may have no --access-log)
                        cmd[0:1] = [sys.executable, "-m", "redisbal"]
                        genv = {**env, "PYTHONPATH": os.path.abspath(a.other_src)}
                        cwd = a.other_src  # (-m puts the working directory first)
                    procs.append(subprocess.Popen(cmd, env=genv, stderr=out, cwd=cwd))
                    name = f"gateway-{kind}{variant}"
                    gws[name] = (f"http://127.0.0.1:{port}", procs[-1].pid)
                if a.bare:
                    port = free_port()
                    cmd = [sys.executable, "-m", "redisbal.bench.bare_proxy", "--port", str(port)]
                    cmd += ["--upstream", f"http://127.0.0.1:{eport}", "--event-loop", kind]
                    procs.append(subprocess.Popen(cmd, env=env))
                    gws[f"bare-{kind}"] = (f"http://127.0.0.1:{port}", procs[-1].pid)
            for name, (url, _) in gws.items():
                health = wait_http(url + "/health")
                if name.startswith("gateway-"):
                    check_one_engine(name, health)
            for name in peers:
                replicas.append(start_peer(name, venv, eport, server.dir))
                gws[name] = (replicas[-1].url, replicas[-1].proc.pid)  # type: ignore[union-attr]
            targets = [
                ("direct", f"http://127.0.0.1:{eport}", 0),
                *((n, u, p) for n, (u, p) in gws.items()),
            ]
            for stream in modes:
                for rate in rates:
                    for rep in range(a.reps):
                        # each repetition starts one target later: none always runs
                        # right after another (the engine's or the host's state it leaves)
                        k = rep % len(targets)
                        for name, url, pid in targets[k:] + targets[:k]:
                            rows.append(measure(name, url, pid, rate, stream, rep, a))
                            print(orjson.dumps(rows[-1]).decode(), flush=True)
        finally:
            for rp in replicas:
                rp.stop()
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(10)
    print(orjson.dumps({"load_average": os.getloadavg()}).decode())
    print(summarize(rows))
    if peers:
        print(ratios(rows, peers[0]))
    if a.tracing or a.other_src or a.twin:
        print(ratios(rows, f"gateway-{a.loops.split(',')[0]}"))
    if a.json:
        with open(a.json, "wb") as fh:
            fh.write(orjson.dumps({"rows": rows}, option=orjson.OPT_INDENT_2))
    if a.plot:
        print(f"plot: {plot_overhead(rows, a.plot, peers[0] if peers else None)}")


def start_peer(name: str, venv: Path, engine_port: int, logdir: Path) -> peer_routers.RouterProcess:
    """One replica of a real peer router in front of the engine, ready. power_of_two
    needs two workers: it gets the one engine under two names (127.0.0.1, localhost),
    so that it picks by its own in-flight counts without a call to the engine."""
    router, policy = peer_routers.split_name(name)
    exe = peer_routers.binary(router, venv)
    assert exe is not None  # peer_routers.install checked it
    port, metrics_port = peer_routers.free_ports(2)
    log = Path(logdir) / f"{name.replace(':', '-')}.log"
    workers = [f"http://127.0.0.1:{engine_port}"]
    if policy == "power_of_two":
        workers.append(f"http://localhost:{engine_port}")
    rp = peer_routers.RouterProcess(name, exe, port, metrics_port, workers, log)
    rp.start()
    rp.wait_ready(30.0)
    return rp


def measure(
    name: str, url: str, pid: int, rate: float, stream: bool, rep: int, a: Any
) -> dict[str, Any]:
    gateway = name != "direct"
    ours = name.startswith("gateway-")  # the peers have no added-latency histogram
    h0 = added_hist(url, stream) if ours else {}
    (c0, w0), t0 = schedstat(pid) if gateway else (0.0, 0.0), time.monotonic()
    o0 = listen_overflows()
    res = one_run(url, rate, a.duration, stream, seed=rep, whole_tokens=a.whole_tokens)
    res["listen_overflows"] = listen_overflows() - o0
    (c1, w1), el = schedstat(pid) if gateway else (0.0, 0.0), time.monotonic() - t0
    row = {"target": name, "rate": rate, "stream": stream, "rep": rep, **res}
    if not stream:
        row["whole_tokens"] = a.whole_tokens
    if gateway:
        h1 = added_hist(url, stream) if ours else {}
        delta = {le: h1[le] - h0.get(le, 0) for le in h1}
        n = max(1, res["requests"])
        row.update(
            gateway_cores=round((c1 - c0) / el, 3),
            cpu_ms_per_request=round(1000 * (c1 - c0) / n, 3),
            runq_wait_ms_per_request=round(1000 * (w1 - w0) / n, 3),
            inside_p50_ms=hist_quantile(delta, 0.5),
            inside_p99_ms=hist_quantile(delta, 0.99),
        )
    return row


def summarize(rows: list[dict[str, Any]]) -> str:
    """Markdown: per (mode, rate, gateway), medians over reps of direct and gateway,
    the difference (what the gateway adds), and the gateway's own figures."""
    out = [
        "| mode | rate | gateway | metric | direct ms | gateway ms | added ms | gateway cores "
        "| CPU ms/req | run-queue wait ms/req | inside p50 / p99 ms (bucket bound) "
        "| host listen overflows (direct / gateway) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    names = sorted({r["target"] for r in rows} - {"direct"})
    for stream, rate in sorted({(r["stream"], r["rate"]) for r in rows}):
        sel = [r for r in rows if r["stream"] == stream and r["rate"] == rate]
        metrics = ("ttft_p50_ms", "ttft_p99_ms") if stream else ("e2e_p50_ms", "e2e_p99_ms")
        for name in names:
            gsel = [r for r in sel if r["target"] == name]
            for m in metrics:
                d = _median([r[m] for r in sel if r["target"] == "direct" and r[m] is not None])
                g = _median([r[m] for r in gsel if r[m] is not None])
                cores = _median([r["gateway_cores"] for r in gsel])
                cpu = _median([r["cpu_ms_per_request"] for r in gsel])
                wait = _median([r["runq_wait_ms_per_request"] for r in gsel])
                i50 = _median([r["inside_p50_ms"] for r in gsel if r.get("inside_p50_ms")])
                i99 = _median([r["inside_p99_ms"] for r in gsel if r.get("inside_p99_ms")])
                od = sum(r["listen_overflows"] for r in sel if r["target"] == "direct")
                og = sum(r["listen_overflows"] for r in gsel)
                out.append(
                    f"| {'stream' if stream else 'whole'} | {rate:g} | {name} | {m} | {d:.2f} "
                    f"| {g:.2f} | {g - d:+.2f} | {cores:.2f} | {cpu:.3f} | {wait:.3f} "
                    f"| {i50:.2f} / {i99:.2f} | {od} / {og} |"
                )
    return "\n".join(out)


def ratios(rows: list[dict[str, Any]], base: str) -> str:
    """Markdown: each target's CPU per request over ``base``'s in the same repetition
    (interleaved, so host noise hits both alike): median and range over repetitions."""
    out = [
        f"| mode | rate | target | CPU x {base}'s, median (range) | pairs |",
        "|---|---|---|---|---|",
    ]
    cpu = {
        (r["target"], r["stream"], r["rate"], r["rep"]): r["cpu_ms_per_request"]
        for r in rows
        if r.get("cpu_ms_per_request")
    }
    for target, stream, rate in sorted({k[:3] for k in cpu if k[0] != base}):
        x = [
            v / cpu[(base, *k[1:])]
            for k, v in cpu.items()
            if k[:3] == (target, stream, rate) and (base, *k[1:]) in cpu
        ]
        if x:
            out.append(
                f"| {'stream' if stream else 'whole'} | {rate:g} | {target} "
                f"| {_median(x):.3f} ({min(x):.3f}-{max(x):.3f}) | {len(x)} |"
            )
    return "\n".join(out)


def _median(v: list[float]) -> float:
    return statistics.median(v) if v else float("nan")


if __name__ == "__main__":
    main()
