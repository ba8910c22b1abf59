"""The real peer routers as baselines: vllm-router and sglang-router, pinned.

Both are Rust binaries from the package index. The benchmark installs the pinned
versions into a venv of its own (``install``; default ``~/.cache/redisbal/peer-routers``,
or ``REDISBAL_PEER_VENV``), never into the project's environment, and runs them as
processes in front of the simulated HTTP engines (``RouterProcess``). A peer policy is
named ``ROUTER:POLICY`` (``vllm-router:cache_aware``); each keeps the router's own
defaults (thresholds, intervals).

Every run checks, in the router's own /metrics and in the calls the engines answered
(``/sim/peer_calls``), that the path the policy is named for actually ran
(``check_paths``): vllm-router's cache_aware must render prompts on the workers and
decide by prefix (``prefix_routing_decisions`` outcomes ``prefix_hit``/``prefix_miss``,
not ``missing_tokens``); sglang-router's power_of_two must have read loads
(``GET /get_load`` at the engines); sglang-router's cache_aware needs nothing of the
engines (it matches request text) and power_of_two of vllm-router counts its own
requests in flight (a real vLLM serves no ``/get_load`` it can read), which the check
says. vllm-router's kv_aware follows the engines' KV events (engine-sim ``--kv-events
ENDPOINT``, one ZMQ publisher per engine, vLLM's wire format; ``kv_event_args`` names
them to the router) and renders each request on a worker: at full strength every
request is rendered and decided by its prefix cost, and some lookups find blocks that
the events put in its index. What vllm-router 0.1.17 decodes (seen against a publisher
of its own, tests/bench/test_peer_routers.py): multipart ``[topic, 8-byte big-endian
seq, msgpack batch]``, the batch ``[ts, events, rank]``, each event a map tagged by
``type`` (an array-encoded event is refused as "KV event must be a tagged map"; a
BlockStored map must carry ``lora_name``, nil allowed); it indexes stored blocks by
their ``token_ids`` (matched against the tokens the worker renders), not their hashes,
and needs ``--kv-event-model`` with static sources.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from redisbal.errors import RouterError as RouterError
from redisbal.routing.cache_view import BLOCK_TOKENS

PINNED = {"vllm-router": "0.1.17", "sglang-router": "0.3.2"}
# every policy each ships that routes one pool of workers (kv_aware from the engines' KV
# events, the others from what each replica sees itself; sglang-router's manual needs a
# header, and is left out)
POLICIES = {
    "vllm-router": (
        "cache_aware",
        "kv_aware",
        "power_of_two",
        "round_robin",
        "consistent_hash",
        "sticky_least_loaded",
    ),
    "sglang-router": ("cache_aware", "power_of_two", "round_robin"),
}
NAMES = tuple(f"{r}:{p}" for r, ps in POLICIES.items() for p in ps)
KV_EVENT_POLICIES = frozenset({"vllm-router:kv_aware"})  # fed by the engines' KV events
# what each router's /metrics says per worker: its requests in flight (a gauge), and its
# routing decisions (a counter; sglang-router 0.3.2 counts its decisions per policy only)
INFLIGHT_METRIC = {
    "vllm-router": "vllm_router_running_requests",
    "sglang-router": "smg_worker_requests_active",
}
DECISIONS_METRIC = {"vllm-router": "vllm_router_policy_decisions_total"}
METRIC = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$", re.M)
LABEL = re.compile(r'(\w+)="([^"]*)"')


def default_venv() -> Path:
    env = os.environ.get("REDISBAL_PEER_VENV")
    return Path(env) if env else Path.home() / ".cache" / "redisbal" / "peer-routers"


def split_name(name: str) -> tuple[str, str]:
    """``vllm-router:cache_aware`` -> (router, policy); a one-line error for others."""
    router, _, policy = name.partition(":")
    if router not in POLICIES or policy not in POLICIES[router]:
        raise RouterError(f"unknown peer router policy {name!r}; choose from {', '.join(NAMES)}")
    return router, policy


def binary(router: str, venv: Path | None = None) -> Path | None:
    """The router's executable in the venv, if the pinned version is installed there."""
    venv = venv or default_venv()
    exe = venv / "bin" / router
    if not exe.exists():
        return None
    return exe if installed_version(router, venv) == PINNED[router] else None


def installed_version(router: str, venv: Path) -> str | None:
    dist = router.replace("-", "_")
    py = venv / "bin" / "python"
    if not py.exists():
        return None
    code = f"import importlib.metadata as m; print(m.version({dist!r}))"
    got = subprocess.run([str(py), "-c", code], capture_output=True, text=True, check=False)
    return got.stdout.strip() if got.returncode == 0 else None


def install(venv: Path | None = None, echo: Any = print) -> Path:
    """Make the venv and pip-install the pinned routers into it (a no-op when they are
    there); returns the venv."""
    venv = venv or default_venv()
    if all(binary(r, venv) for r in PINNED):
        return venv
    echo(f"installing {', '.join(f'{r}=={v}' for r, v in PINNED.items())} into {venv}")
    if not (venv / "bin" / "python").exists():
        venv.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    got = subprocess.run(
        pip + [f"{r}=={v}" for r, v in PINNED.items()], capture_output=True, text=True
    )
    if got.returncode != 0:
        last = (got.stderr.strip().splitlines() or ["no output"])[-1]
        raise RouterError(f"pip could not install the peer routers into {venv}: {last}")
    missing = [r for r in PINNED if binary(r, venv) is None]
    if missing:
        raise RouterError(f"after pip install, {venv} lacks {', '.join(missing)}")
    return venv


def command(
    router: str, policy: str, exe: Path, port: int, metrics_port: int, workers: list[str]
) -> list[str]:
    """The router's command line: its defaults, but loopback ports and quiet logs."""
    cmd = [str(exe)] + (["launch"] if router == "sglang-router" else [])
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--policy", policy]
    cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)]
    cmd += ["--log-level", "warning" if router == "vllm-router" else "warn"]
    return [*cmd, "--worker-urls", *workers]


def needs_kv_events(name: str) -> bool:
    """Does the peer policy ``ROUTER:POLICY`` route on the engines' KV events?"""
    return name in KV_EVENT_POLICIES


def split_name_without_events(name: str) -> tuple[str, str]:
    """``split_name`` for a benchmark that gives the engines no KV-event publishers: a
    one-line error for a policy that would run without its events (below strength)."""
    router, policy = split_name(name)
    if needs_kv_events(name):
        raise RouterError(
            f"{name} routes on the engines' KV events, which only scripts/gateway_policies.py "
            "wires (a publisher per engine); choose another policy here"
        )
    return router, policy


def kv_event_args(sources: dict[str, str], model: str) -> list[str]:
    """vllm-router's flags for static KV event sources: each worker URL's ZMQ publisher
    (``{url: "tcp://HOST:PORT"}``), the block size the engines publish at, and the model
    identity the router requires with static sources."""
    if not sources:
        raise RouterError("kv_aware needs a KV event publisher per worker, got none")
    out: list[str] = []
    for url, endpoint in sources.items():
        if not endpoint.startswith("tcp://"):
            raise RouterError(f"KV event endpoint {endpoint!r} of {url}: use tcp://HOST:PORT")
        out += ["--kv-event-source", f"{url}={endpoint}"]
    return [*out, "--kv-event-block-size", str(BLOCK_TOKENS), "--kv-event-model", model]


def _get(url: str, timeout: float = 2.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        body: bytes = resp.read()
        return body


def parse_metrics(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Prometheus text -> (name, labels, value) rows."""
    rows = []
    for m in METRIC.finditer(text):
        labels = dict(LABEL.findall(m.group(2) or ""))
        try:
            rows.append((m.group(1), labels, float(m.group(3))))
        except ValueError:
            continue
    return rows


def total(rows: list[tuple[str, dict[str, str], float]], name: str, **match: str) -> float:
    return sum(
        v for n, lab, v in rows if n == name and all(lab.get(k) == w for k, w in match.items())
    )


@dataclass
class RouterProcess:
    """One replica of a peer router, its log in ``log``."""

    name: str  # ROUTER:POLICY
    exe: Path
    port: int
    metrics_port: int
    workers: list[str]
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    metrics: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    args: list[str] = field(default_factory=list)  # more flags for the router (its options)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Start the process (again: a restarted replica appends to its predecessor's log)."""
        router, policy = split_name(self.name)
        cmd = command(router, policy, self.exe, self.port, self.metrics_port, self.workers)
        cmd += self.args
        with open(self.log, "ab") as fh:
            self.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=fh,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def tail(self, chars: int = 1500) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def ready(self) -> bool:
        """Every worker registered and healthy (sglang-router: with the engines' model)."""
        router, _ = split_name(self.name)
        try:
            if router == "vllm-router":
                st = orjson.loads(_get(self.url + "/readiness"))
                return bool(st.get("healthy_workers") == len(self.workers))
            ws = orjson.loads(_get(self.url + "/workers")).get("workers", [])
        except (OSError, ValueError):
            return False
        return len(ws) == len(self.workers) and all(w.get("is_healthy") for w in ws)

    def serving(self) -> bool:
        """Its readiness probe passes (``/readiness`` answers 200): up, with workers to send
        to, though not necessarily all of them healthy (``ready`` wants every one)."""
        try:
            _get(self.url + "/readiness", timeout=1.0)
        except OSError:  # (an HTTPError, a 503, is one)
            return False
        return True

    def per_worker(self, metric: str) -> dict[str, float]:
        """One metric of its /metrics now, summed by worker URL (an OSError if it is down)."""
        text = _get(f"http://127.0.0.1:{self.metrics_port}/metrics").decode()
        out: dict[str, float] = {}
        for n, lab, v in parse_metrics(text):
            if n == metric and "worker" in lab:
                out[lab["worker"]] = out.get(lab["worker"], 0.0) + v
        return out

    def inflight(self) -> float:
        """Its requests in flight now, over every worker (its own gauge)."""
        router, _ = split_name(self.name)
        return sum(self.per_worker(INFLIGHT_METRIC[router]).values())

    def decisions(self) -> dict[str, float] | None:
        """Its routing decisions so far by worker URL; None where its /metrics has no
        per-worker count (sglang-router)."""
        router, _ = split_name(self.name)
        metric = DECISIONS_METRIC.get(router)
        return None if metric is None else self.per_worker(metric)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RouterError(
                    f"{self.name} exited with {self.proc.returncode}; its log ends with:\n"
                    f"{self.tail()}"
                )
            if self.ready():
                return
            time.sleep(0.1)
        raise RouterError(f"{self.name} did not see its {len(self.workers)} workers healthy")

    def scrape(self) -> None:
        """Keep the router's /metrics (and sglang-router's /workers, /get_loads)."""
        try:
            self.metrics = _get(f"http://127.0.0.1:{self.metrics_port}/metrics").decode()
        except OSError as exc:
            self.metrics = ""
            self.extra["metrics_error"] = str(exc)
        if self.name.startswith("sglang-router"):
            try:
                ws = orjson.loads(_get(self.url + "/workers")).get("workers", [])
                self.extra["models"] = sorted({str(w.get("model_id")) for w in ws})
            except (OSError, ValueError) as exc:
                self.extra["workers_error"] = str(exc)

    def stop(self, timeout: float = 10.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def check_paths(
    name: str, replicas: list[RouterProcess], calls: dict[str, int], requests: int
) -> dict[str, Any]:
    """Did the named policy's prefix- or load-aware path run? ``calls``: the engines'
    /sim/peer_calls summed; ``requests``: what loadgen sent. Returns the evidence and
    ``ok``, with ``note`` saying what was seen in words."""
    router, policy = split_name(name)
    rows = [r for rp in replicas for r in parse_metrics(rp.metrics)]
    out: dict[str, Any] = {"calls": calls}
    if router == "vllm-router":
        outcomes = {
            lab["outcome"]: v
            for n, lab, v in _merge(rows, "vllm_router_prefix_routing_decisions_total", "outcome")
        }
        decisions = total(rows, "vllm_router_policy_decisions_total", policy=policy)
        out.update(prefix_outcomes=outcomes, decisions=decisions)
        if policy == "kv_aware":
            return out | _kv_aware_path(rows, outcomes, calls, requests)
        if policy == "cache_aware":
            prefix = outcomes.get("prefix_hit", 0) + outcomes.get("prefix_miss", 0)
            missing = outcomes.get("missing_tokens", 0)
            rendered = calls.get("/v1/completions/render", 0) + calls.get(
                "/v1/chat/completions/render", 0
            )
            out["ok"] = prefix >= requests > 0 and missing == 0 and rendered >= requests
            out["note"] = (
                f"prefix path: {prefix:.0f} decisions by prefix "
                f"({outcomes.get('prefix_hit', 0):.0f} hits), {missing:.0f} missing_tokens, "
                f"{rendered} renders at the engines for {requests} requests"
            )
        elif policy == "power_of_two":
            out["ok"] = decisions >= requests > 0
            out["note"] = (
                f"load path: {decisions:.0f} power_of_two decisions on the router's own "
                f"in-flight counts ({calls.get('/get_load', 0)} /get_load calls; "
                "vllm-router reads no load from a vLLM-format engine)"
            )
        else:
            out["ok"] = decisions >= requests > 0
            out["note"] = f"{policy}: {decisions:.0f} decisions on the router's own state"
        return out
    models = sorted({m for rp in replicas for m in rp.extra.get("models", [])})
    decisions = total(rows, "smg_worker_selection_total", policy=policy)
    out.update(models=models, decisions=decisions)
    model_ok = models == ["redisbal-sim"]
    if policy == "power_of_two":
        loads = calls.get("/get_load", 0)
        out["ok"] = model_ok and decisions >= requests > 0 and loads > 0
        out["note"] = (
            f"load path: {decisions:.0f} power_of_two decisions, {loads} /get_load calls "
            f"answered by the engines; model {','.join(models) or '?'}"
        )
    elif policy == "cache_aware":
        out["ok"] = model_ok and decisions >= requests > 0
        out["note"] = (
            f"cache_aware: {decisions:.0f} decisions (it matches request text: no engine "
            f"call needed, none counted by the router); model {','.join(models) or '?'}"
        )
    else:
        out["ok"] = model_ok and decisions >= requests > 0
        out["note"] = f"{policy}: {decisions:.0f} decisions; model {','.join(models) or '?'}"
    return out


def _kv_aware_path(
    rows: list[tuple[str, dict[str, str], float]],
    outcomes: dict[str, float],
    calls: dict[str, int],
    requests: int,
) -> dict[str, Any]:
    """vllm-router kv_aware at full strength: every request's tokens rendered by a
    worker (``kv_routing_inputs`` result ``render``, the engines' render calls), every
    request decided by its prefix cost (or its session's stickiness), and lookups that
    found blocks in the index the engines' KV events fill (``kv_placement_lookups``
    result ``hit``: without events every lookup is a ``miss``)."""
    inputs = {
        lab["result"]: v
        for _, lab, v in _merge(rows, "vllm_router_kv_routing_inputs_total", "result")
    }
    lookups = {
        lab["result"]: v
        for _, lab, v in _merge(rows, "vllm_router_kv_placement_lookups_total", "result")
    }
    by_prefix = outcomes.get("prefix_cost", 0) + outcomes.get("sticky_hit", 0)
    rendered = calls.get("/v1/completions/render", 0) + calls.get("/v1/chat/completions/render", 0)
    hits = lookups.get("hit", 0)
    ok = (
        requests > 0
        and by_prefix >= requests
        and inputs.get("render", 0) >= requests
        and sum(inputs.values()) == inputs.get("render", 0)
        and rendered >= requests
        and hits > 0
    )
    seen = ", ".join(f"{k} {v:.0f}" for k, v in sorted(lookups.items())) or "none"
    return {
        "kv_inputs": inputs,
        "kv_lookups": lookups,
        "ok": ok,
        "note": (
            f"KV-event path: {by_prefix:.0f} decisions by prefix cost for {requests} requests, "
            f"{inputs.get('render', 0):.0f} token inputs rendered ({rendered} renders at the "
            f"engines), index lookups {seen}"
            + ("" if hits > 0 else " (no hit: the engines' KV events never reached its index)")
        ),
    }


def _merge(
    rows: list[tuple[str, dict[str, str], float]], name: str, key: str
) -> list[tuple[str, dict[str, str], float]]:
    """Rows of ``name`` summed by label ``key`` (over replicas and other labels)."""
    acc: dict[str, float] = {}
    for n, lab, v in rows:
        if n == name and key in lab:
            acc[lab[key]] = acc.get(lab[key], 0.0) + v
    return [(name, {key: k}, v) for k, v in acc.items()]


def which_installed() -> dict[str, str | None]:
    """The pinned routers found in the default venv (None: absent), for skip reasons."""
    return {r: (str(binary(r)) if binary(r) else None) for r in PINNED}


def free_ports(n: int) -> list[int]:
    """``n`` loopback ports free now."""
    import socket

    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def free_port_block(n: int) -> int:
    """The first of ``n`` consecutive loopback ports free now (best effort: bound, then
    released), below 32768, where Linux's ephemeral ports start: an outgoing connection
    cannot take one before its server binds it."""
    import random
    import socket

    rng = random.Random()
    for _ in range(100):
        base = rng.randint(24000, 32767 - n)
        socks: list[socket.socket] = []
        try:
            for port in range(base, base + n):
                socks.append(socket.socket())
                socks[-1].bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RouterError(f"no {n} consecutive free ports found")
