#!/usr/bin/env python3
"""Engines that fail while their reports look healthy, end to end with real processes.

Starts a redis-server, a coordinator, ``--engines`` HTTP engine simulators (one
process each, so that one can be SIGSTOPped) and ``--gateways`` gateway
replicas, then per scenario sends ``--rate`` streamed requests a second, spread
over the gateways, for ``--duration`` seconds with the ``openai`` client (no
retries), and makes engine 0 faulty from ``--fault-at`` to ``--clear-at``:

- ``500``: it answers every request 500 (its reports say it is idle);
- ``stall``: its streams stop sending, connections open;
- ``stall_mid``: each of its streams sends its first 3 chunks, then stops
  (connections open);
- ``sigstop``: the process is stopped (the kernel still accepts connections);
- ``refuse``: it answers every request 401, as with a wrong engine key (the other
  engines accept the same credentials and model);
- ``reject``: 5 requests pinned to it are refused with a 400, then 40 sequential
  requests measure its share (no load, no fault left).

Per scenario: requests failed and hung (failed after longer than the idle
timeout plus a second), requests that waited over 2 s for a chunk (failed or
not) and the longest such wait, the faulty engine's decisions after the first
second of the fault (for sigstop, all after the fault) and their number per
request sent meanwhile, seconds from the fault's end until it got its third
request, requests still in flight anywhere after the run, and the gateways' access
logs (JSON, a file each) against the client: one line per request sent, and as many
``ok`` as the client finished. Every router
reaches engine 0 through a counting relay (redisbal.bench.tap) that records when
each request came, so a loaded host that delays this script does not shift the
windows; the fault's start and end are taken as done, not as scheduled. Prints
a table and writes JSON.

``--routers`` runs each scenario again, on fresh processes, in front of peer
routers instead of the gateways (``ROUTER:POLICY`` of redisbal.bench.peer_routers, as
many replicas as ``--gateways``, each with ``--peer-args``).

    python scripts/engine_faults.py --json engine_faults.json
    python scripts/engine_faults.py --routers redisbal,vllm-router:power_of_two,\
        sglang-router:power_of_two --json engine_faults.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import orjson

from redisbal.bench import peer_routers
from redisbal.bench.tap import read_count, read_times
from redisbal.sim.embedded import RedisServer

BIN = os.path.join(os.path.dirname(sys.executable), "redisbal")
MODEL = "redisbal-sim"
SCENARIOS = ("500", "stall", "stall_mid", "sigstop", "refuse", "reject")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get_json(url: str, timeout: float = 2.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return orjson.loads(r.read())


def post_json(url: str, body: dict[str, Any]) -> None:
    req = urllib.request.Request(
        url, data=orjson.dumps(body), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=5) as r:
        r.read()


def wait_http(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=1) as r:
            if r.status == 200:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} not ready")
        time.sleep(0.2)


@dataclass
class Deployment:
    """The processes of one run: engines (id -> URL, process) and gateway URLs."""

    redis: RedisServer
    engines: dict[str, str] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    gateways: list[str] = field(default_factory=list)
    others: list[subprocess.Popen[bytes]] = field(default_factory=list)
    peers: list[peer_routers.RouterProcess] = field(default_factory=list)
    tap_file: str = ""  # a peer's decisions to engine 0, counted in front of it
    access_logs: list[str] = field(default_factory=list)  # the gateways' stderr

    def stop(self) -> None:
        for rp in self.peers:
            rp.stop()
        for p in [*self.procs.values(), *self.others]:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signal.SIGCONT)
                p.terminate()
        for p in [*self.procs.values(), *self.others]:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(15)
            if p.poll() is None:
                p.kill()
        self.redis.stop()


def start(a: argparse.Namespace, deployment: str, router: str) -> Deployment:
    redis = RedisServer().start()
    d = Deployment(redis)
    common = ["--redis-url", redis.url, "--deployment", deployment, "--log-level", "warning"]
    d.others.append(subprocess.Popen([BIN, "coordinator", *common]))
    for i in range(a.engines):
        port = free_port()
        d.procs[str(i)] = subprocess.Popen(
            [BIN, "engine-sim", *common, "--engines", "1", "--first-id", str(i),
             "--http-port", str(port)], stdout=subprocess.DEVNULL,
        )  # fmt: skip
        d.engines[str(i)] = f"http://127.0.0.1:{port}"
    for url in d.engines.values():
        wait_http(url + "/health")
    tap_url = start_tap(a, d, deployment)
    if router != "redisbal":
        start_peers(a, d, router, deployment, tap_url)
        return d
    for i in range(a.gateways):
        port = free_port()
        d.access_logs.append(os.path.join(a.workdir, f"{deployment}-gateway-{i}.log"))
        with open(d.access_logs[-1], "wb") as log:
            d.others.append(
                subprocess.Popen([BIN, "gateway", *common, "--port", str(port),
                                  "--engine", f"0={tap_url}", "--access-log", "json",
                                  *a.gateway_args], stderr=log)
            )  # fmt: skip
        d.gateways.append(f"http://127.0.0.1:{port}")
    for url in d.gateways:
        wait_http(url + "/health")
    return d


def start_tap(a: argparse.Namespace, d: Deployment, deployment: str) -> str:
    """A counting relay in front of engine 0 (every router reaches it through it);
    returns its URL."""
    port = free_port()
    d.tap_file = os.path.join(a.workdir, f"{deployment}-{len(os.listdir(a.workdir))}.tap")
    d.others.append(
        subprocess.Popen([sys.executable, "-m", "redisbal.bench.tap", "--port", str(port),
                          "--to", d.engines["0"], "--count-file", d.tap_file])
    )  # fmt: skip
    with contextlib.suppress(OSError, ValueError):  # (any answer: it relays)
        wait_http(f"http://127.0.0.1:{port}/health")
    return f"http://127.0.0.1:{port}"


def start_peers(
    a: argparse.Namespace, d: Deployment, router: str, deployment: str, tap_url: str
) -> None:
    """``a.gateways`` replicas of the peer ``router`` in front of the engines, engine 0
    behind the counting relay."""
    name, _ = peer_routers.split_name(router)
    exe = peer_routers.binary(name)
    if exe is None:
        raise SystemExit(f"{name} is not installed: python -m redisbal.bench.peer_routers")
    ports = peer_routers.free_ports(2 * a.gateways)
    workers = [tap_url, *(u for e, u in d.engines.items() if e != "0")]
    for i in range(a.gateways):
        log = os.path.join(a.workdir, f"{deployment}-{name}-{i}.log")
        rp = peer_routers.RouterProcess(
            router, exe, ports[2 * i], ports[2 * i + 1], workers, Path(log),
            args=a.peer_args,
        )  # fmt: skip
        rp.start()
        d.peers.append(rp)
    for rp in d.peers:
        rp.wait_ready(60)
    d.gateways = [rp.url for rp in d.peers]


def by_label(d: Deployment, metric: str, label: str) -> dict[str, float]:
    """``metric``'s samples summed over the gateways, by the value of ``label``."""
    out: dict[str, float] = {}
    for g in d.gateways:
        with urllib.request.urlopen(g + "/metrics", timeout=2) as r:
            text = r.read().decode()
        for k, v in re.findall(rf'^{metric}\{{{label}="([^"]+)"\}} (\S+)$', text, re.M):
            out[k] = out.get(k, 0.0) + float(v)
    return out


def decisions(d: Deployment) -> dict[str, float]:
    """Decisions per engine so far: engine 0's relay; the others' from the gateways'
    counters, or for peers their arrivals."""
    out: dict[str, float] = dict.fromkeys(d.engines, 0.0)
    if not d.peers:
        out.update(by_label(d, "redisbal_gateway_decisions_total", "engine"))
    else:
        out.update({e: arrived(url) for e, url in d.engines.items() if e != "0"})
    out["0"] = float(read_count(d.tap_file))
    return out


def arrived(url: str) -> float:
    return float(get_json(url + "/sim/state")["arrived"])


def leftovers(d: Deployment) -> int:
    """Requests still in flight anywhere: gateways' gauges plus engines' own counts."""
    n = 0
    for g in [] if d.peers else d.gateways:
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(g + "/metrics", timeout=2) as r:
                text = r.read().decode()
            m = re.search(r"^redisbal_gateway_inflight (\S+)$", text, re.M)
            n += int(float(m.group(1))) if m else 0
    for url in d.engines.values():
        with contextlib.suppress(OSError):
            n += int(get_json(url + "/sim/state")["inflight"])
    return n


async def one_request(client: openai.AsyncOpenAI, idle_s: float) -> tuple[str, float, float]:
    """('ok' | 'failed' | 'hung', seconds, the longest wait for a chunk: the first one
    included)."""
    t0 = last = time.monotonic()
    gap = 0.0
    try:
        out = await client.completions.create(
            model=MODEL, prompt="hello", max_tokens=32, stream=True, timeout=60.0
        )
        done = False
        async for chunk in out:
            now = time.monotonic()
            gap, last = max(gap, now - last), now
            if chunk.choices and chunk.choices[0].finish_reason is not None:
                done = True
        took = time.monotonic() - t0
        return ("ok" if done else "failed"), took, gap
    except Exception:
        took = time.monotonic() - t0
        gap = max(gap, time.monotonic() - last)
        return ("hung" if took > idle_s + 1.0 else "failed"), took, gap


def fault(d: Deployment, kind: str, on: bool) -> float:
    """Start or end the fault; returns when it was done (``time.monotonic()``)."""
    url, proc = d.engines["0"], d.procs["0"]
    if kind == "sigstop":
        proc.send_signal(signal.SIGSTOP if on else signal.SIGCONT)
    elif kind == "500":
        post_json(url + "/sim/fault", {"mode": "status", "status": 500} if on else {"mode": "none"})
    elif kind == "refuse":
        post_json(url + "/sim/fault", {"mode": "status", "status": 401} if on else {"mode": "none"})
    elif kind == "stall":
        post_json(url + "/sim/fault", {"mode": "stall"} if on else {"mode": "none"})
    elif kind == "stall_mid":
        post_json(url + "/sim/fault", {"mode": "stall", "after": 3} if on else {"mode": "none"})
    return time.monotonic()


async def load_scenario(d: Deployment, kind: str, a: argparse.Namespace) -> dict[str, Any]:
    clients = [
        openai.AsyncOpenAI(base_url=g + "/v1", api_key="x", max_retries=0) for g in d.gateways
    ]
    results: list[tuple[float, str, float, float]] = []
    t0 = time.monotonic()
    fault_s: list[float] = []  # when the fault began and ended, as done (the loop may lag)

    async def faults() -> None:
        for on, when in ((True, a.fault_at), (False, a.clear_at)):
            await asyncio.sleep(max(0.0, t0 + when - time.monotonic()))
            done_at = await asyncio.to_thread(fault, d, kind, on)
            fault_s.append(done_at - t0)  # (read in the thread: the loop may resume late)

    async def send(i: int) -> None:
        at = time.monotonic() - t0
        status, took, gap = await one_request(clients[i % len(clients)], a.idle_timeout_s)
        results.append((at, status, took, gap))

    faulting = asyncio.ensure_future(faults())
    sends = []
    n = int(a.rate * a.duration)
    for i in range(n):
        delay = t0 + i / a.rate - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        sends.append(asyncio.ensure_future(send(i)))
    await asyncio.gather(*sends)
    await faulting
    # after the run: until engine 0 takes traffic again (the relay's times say when)
    end = time.monotonic() + 10
    while time.monotonic() < end and len(engine0_times(d, t0, fault_s[1])) < 3:
        await asyncio.sleep(0.25)
    for c in clients:
        await c.close()
    row = summarize(kind, a, results, engine0_times(d, t0, -math.inf), fault_s)
    row["gateway_errors"] = await asyncio.to_thread(gateway_errors, d)
    return row


def engine0_times(d: Deployment, t0: float, after: float) -> list[float]:
    """When the relay saw requests to engine 0, in seconds from t0, after ``after``."""
    return [t - t0 for t in read_times(d.tap_file) if t - t0 > after]


def gateway_errors(d: Deployment) -> dict[str, float]:
    """The gateways' failed attempts by kind, summed: what the failures were."""
    if d.peers:
        return {}
    try:
        return by_label(d, "redisbal_gateway_errors_total", "reason")
    except OSError:
        return {}


def summarize(
    kind: str,
    a: argparse.Namespace,
    results: list[tuple[float, str, float, float]],
    to_engine0: list[float],
    fault_s: list[float],
) -> dict[str, Any]:
    """The row of one run. Windows are from the fault's actual times (``fault_s``);
    the faulty engine's share is its decisions per request sent in the window."""
    on, off = fault_s
    lo = on if kind == "sigstop" else on + 1.0
    to_faulty = sum(1 for t in to_engine0 if lo <= t <= off)
    sent = sum(1 for t, *_ in results if lo <= t <= off)
    back = [t for t in to_engine0 if t > off]
    failed = sum(1 for _, s, _, _ in results if s != "ok")
    return {
        "scenario": kind,
        "requests": len(results),
        "failed": failed,
        "failed_pct": round(100.0 * failed / max(1, len(results)), 2),
        "hung": sum(1 for _, s, _, _ in results if s == "hung"),
        "longest_s": round(max((t for _, _, t, _ in results), default=0.0), 2),
        # requests that waited over 2 s for a chunk (a stream that stalled, an answer that
        # did not come), failed or not, and the longest such wait
        "waited_2s": sum(1 for *_, g in results if g > 2.0),
        "longest_wait_s": round(max((g for *_, g in results), default=0.0), 2),
        "faulty_decisions": to_faulty,
        "faulty_share_pct": round(100.0 * to_faulty / max(1, sent), 2),
        # from the fault's end until engine 0 got its third request
        "back_after_s": round(back[2] - off, 2) if len(back) >= 3 else None,
        "fault_s": [round(t, 2) for t in fault_s],
        # when engine 0 got each request (s from the start): what the one number sums up
        "timeline": [round(t, 3) for t in to_engine0],
    }


async def reject_scenario(d: Deployment, a: argparse.Namespace) -> dict[str, Any]:
    """Engine 0 refuses 5 requests (400), then 40 sequential requests: its share. A
    gateway is made to send the 5 to it (pinned); a peer router, which cannot be
    pinned, gets requests until engine 0 refused 5."""
    import aiohttp

    url, sent = d.gateways[0], 0
    body = {"model": MODEL, "prompt": "a", "max_tokens": 4}
    pin = {} if d.peers else {"X-Redisbal-Engine": "0"}
    async with aiohttp.ClientSession() as s:

        async def one() -> None:
            async with s.post(url + "/v1/completions", json=body, headers=pin) as r:
                await r.read()

        post_json(d.engines["0"] + "/sim/fault", {"mode": "status", "status": 400})
        while decisions(d)["0"] < 5 and sent < 200:
            await one()
            sent += 1
        rejected = int(decisions(d)["0"])
        post_json(d.engines["0"] + "/sim/fault", {"mode": "none"})
        pin, before = {}, decisions(d)
        for _ in range(40):
            await one()
        after = decisions(d)
    split = {e: int(after[e] - before[e]) for e in sorted(after)}
    even = 40 / len(d.engines)
    return {
        "scenario": "reject",
        "requests": sent + 40,
        "rejected": rejected,
        "faulty_decisions": split["0"],
        "even_split": even,
        "within_one": abs(split["0"] - even) <= 1,
        "split": split,
    }


def access_outcomes(d: Deployment) -> dict[str, int]:
    """The gateways' access-log lines by outcome (their other log lines skipped)."""
    out: dict[str, int] = {}
    for path in d.access_logs:
        with open(path, "rb") as fh:
            for line in fh:
                if line.startswith(b"{"):
                    outcome = orjson.loads(line)["outcome"]
                    out[outcome] = out.get(outcome, 0) + 1
    return out


def run_one(a: argparse.Namespace, kind: str, router: str, deployment: str) -> dict[str, Any]:
    """One scenario on fresh processes in front of ``router``."""
    load = os.getloadavg()[0]
    d = start(a, deployment, router)
    try:
        time.sleep(2.0)  # first snapshots, URLs registered
        row = asyncio.run(reject_scenario(d, a) if kind == "reject" else load_scenario(d, kind, a))
        time.sleep(1.0)
        row["left_in_flight"] = leftovers(d)
    finally:
        d.stop()
    if d.access_logs:  # one line per request sent, as many ok (or rejected) as the client saw
        got = row["access_log"] = access_outcomes(d)
        if "failed" in row:
            same = got.get("ok", 0) == row["requests"] - row["failed"]
        else:  # every pinned request refused, the 40 after them answered
            same = got.get("rejected", 0) == row["requests"] - 40 and got.get("ok", 0) == 40
        row["access_log_matches"] = sum(got.values()) == row["requests"] and same
    row["router"] = router
    row["load_avg"] = [round(load, 2), round(os.getloadavg()[0], 2)]  # at its start and end
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--gateways", type=int, default=2)
    ap.add_argument("--rate", type=float, default=100.0)
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--fault-at", type=float, default=5.0)
    ap.add_argument("--clear-at", type=float, default=15.0)
    ap.add_argument("--idle-timeout-s", type=float, default=10.0, help="the gateways' own")
    ap.add_argument(
        "--routers", default="redisbal",
        help="comma list: redisbal (the gateways) and/or peers as ROUTER:POLICY "
        f"({', '.join(peer_routers.NAMES)})",
    )  # fmt: skip
    ap.add_argument("--peer-args", default="", help="more flags for every peer replica")
    ap.add_argument("--json", default="engine_faults.json")
    a, extra = ap.parse_known_args()
    a.gateway_args = [*extra, "--idle-timeout-s", str(a.idle_timeout_s)]
    a.peer_args = a.peer_args.split()
    kinds, names = a.scenarios.split(","), a.routers.split(",")
    for kind in kinds:
        if kind not in SCENARIOS:
            ap.error(f"unknown scenario {kind!r}; known: {', '.join(SCENARIOS)}")
    for name in names:
        if name != "redisbal":
            try:
                peer_routers.split_name_without_events(name)
            except peer_routers.RouterError as exc:
                ap.error(str(exc))
    rows = []
    with tempfile.TemporaryDirectory(prefix="engine-faults-") as a.workdir:
        for k, kind in enumerate(kinds):
            for name in names:  # the same scenario in front of each router, one after another
                row = run_one(a, kind, name, f"faults{k}")
                print(orjson.dumps({k: v for k, v in row.items() if k != "timeline"}).decode())
                rows.append(row)
    cols = ["scenario", "router", "requests", "failed_pct", "hung", "waited_2s", "longest_wait_s",
            "faulty_decisions", "faulty_share_pct", "back_after_s", "left_in_flight",
            "access_log_matches"]  # fmt: skip
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r.get(c, "-")) for c in cols))
    with open(a.json, "wb") as fh:
        args = {k: v for k, v in vars(a).items() if k != "workdir"}
        fh.write(orjson.dumps({"args": args, "rows": rows}, option=orjson.OPT_INDENT_2))


if __name__ == "__main__":
    main()
