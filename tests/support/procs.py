"""Real processes and probes for the fault tests and the soak.

:class:`ProcGroup` spawns the role processes of ``tests/programs/roles.py`` (an
engine, a coordinator, a router, on the public API only, so that a test can
SIGKILL / SIGSTOP them like real ones) and kills everything on exit, also on
failure; :class:`Proc` collects each one's JSON stdout lines. Beside them:
:class:`RouteLoop` (an in-process router routing continuously and recording every
decision), :class:`SnapshotObserver` (every published snapshot as received on the
channel), :class:`TcpProxy` (cut or stall one client's network path) and
:func:`record` (measured recovery times, appended to the file
``$REDISBAL_RELIABILITY_LOG`` names).
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from redisbal.barrier.snapshot import Snapshot
from redisbal.bench.peer_routers import free_port_block as free_port_block
from redisbal.keys import DeploymentKeys
from support.helpers import wait_until

ROOT = Path(__file__).resolve().parents[2]
ROLES = ROOT / "tests" / "programs" / "roles.py"
RELIABILITY_LOG_ENV = "REDISBAL_RELIABILITY_LOG"


# -- measuring --------------------------------------------------------------------------------


def record(fault: str, **figures: Any) -> dict[str, Any]:
    """Print one measurement, and append it to $REDISBAL_RELIABILITY_LOG when set (the test
    session points it into its temp dir unless given: tests write nothing into the checkout)."""
    row = {"fault": fault, "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **figures}
    for k, v in row.items():
        if isinstance(v, float):
            row[k] = round(v, 3)
    line = json.dumps(row, sort_keys=False)
    print(f"RELIABILITY {line}")
    path = os.environ.get(RELIABILITY_LOG_ENV)
    if path:
        with Path(path).open("a", encoding="utf-8") as f:
            f.write(line + "\n")
    return row


def hold_port(port: int, host: str = "127.0.0.1") -> socket.socket:
    """Bind (without listening) a port a killed server had, so that connections to it are
    refused and no other process on this shared machine takes it over meanwhile (clients
    that still have the old address would then talk to a stranger). Close it to release."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, port))
    return s


# -- child processes --------------------------------------------------------------------------


class Proc:
    """One child process of this module; its JSON stdout lines land in ``lines``.

    A thread reads each of its pipes to the end and then closes it: a pipe left open
    outlives the test and warns (ResourceWarning, unclosed file) whenever the garbage
    collector gets to it, in whichever later test that is. ``kill``/``terminate`` wait
    for both, so ``lines`` is complete when they return."""

    def __init__(self, role: str, args: list[str], name: str) -> None:
        self.role = role
        self.name = name
        cmd = [sys.executable, str(ROLES), role, *args]
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            cwd=str(ROOT),
        )
        self.lines: list[dict[str, Any]] = []
        self.stderr: collections.deque[str] = collections.deque(maxlen=200)
        self._lock = threading.Lock()
        self._readers = [
            threading.Thread(target=self._read_out, daemon=True),
            threading.Thread(target=self._read_err, daemon=True),
        ]
        for t in self._readers:
            t.start()

    def _read_out(self) -> None:
        assert self.proc.stdout is not None
        with self.proc.stdout:  # closed at its end (the child exited)
            for raw in self.proc.stdout:
                with contextlib.suppress(ValueError):
                    item = json.loads(raw)
                    item["_t"] = time.monotonic()
                    with self._lock:
                        self.lines.append(item)

    def _read_err(self) -> None:
        assert self.proc.stderr is not None
        with self.proc.stderr:
            for raw in self.proc.stderr:
                self.stderr.append(raw.decode(errors="replace").rstrip())

    def _join_readers(self, timeout: float = 5.0) -> None:
        """Wait until both pipes are read to their end and closed (once the child exited)."""
        for t in self._readers:
            t.join(timeout)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def last(self) -> dict[str, Any]:
        with self._lock:
            return dict(self.lines[-1]) if self.lines else {}

    def since(self, t: float) -> list[dict[str, Any]]:
        with self._lock:
            return [x for x in self.lines if x["_t"] >= t]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_ready(self, timeout: float = 20.0) -> None:
        def ready() -> bool:
            if not self.alive():
                raise AssertionError(f"{self.name} exited: {self.tail()}")
            return any(x.get("ready") for x in self.lines)

        wait_until(ready, timeout, f"{self.name} ready")

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        """SIGKILL: a crash; nothing is cleaned up."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
            self._join_readers()

    def terminate(self, timeout: float = 5.0) -> None:
        """SIGTERM: a graceful stop (engines leave, coordinators release the lease)."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._join_readers()

    def tail(self) -> str:
        return "\n".join(list(self.stderr)[-15:])


class ProcGroup:
    """Spawns role processes; ``close()`` kills every one still running."""

    def __init__(self, url: str, deployment: str) -> None:
        self.url = url
        self.deployment = deployment
        self.procs: list[Proc] = []

    def spawn(self, role: str, name: str, **opts: Any) -> Proc:
        args = [
            "--url",
            opts.pop("url", self.url),
            "--deployment",
            opts.pop("deployment", self.deployment),
        ]
        for k, v in opts.items():
            flag = "--" + k.replace("_", "-")
            if v is True:
                args.append(flag)
            elif v not in (None, False):
                args += [flag, str(v)]
        p = Proc(role, args, name)
        self.procs.append(p)
        return p

    def engine(self, engine_id: str, t0: float, **opts: Any) -> Proc:
        return self.spawn("engine", f"engine {engine_id}", id=engine_id, t0=t0, **opts)

    def coordinator(self, coordinator_id: str, **opts: Any) -> Proc:
        return self.spawn("coordinator", f"coordinator {coordinator_id}", id=coordinator_id, **opts)

    def router(self, index: int, count: int, **opts: Any) -> Proc:
        return self.spawn("router", f"router {index}", index=index, count=count, **opts)

    def close(self) -> None:
        for p in self.procs:
            p.kill()

    def __enter__(self) -> ProcGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- in-process probes ------------------------------------------------------------------------


Decided = tuple[float, str, int, bool, float]


@dataclass
class RouteLog:
    errors: list[str] = field(default_factory=list)
    # (monotonic time before route(), engine id, snapshot version, degraded, time after it)
    decisions: list[Decided] = field(default_factory=list)
    # (monotonic time, seconds one route() call took)
    durations: list[tuple[float, float]] = field(default_factory=list)
    # (monotonic time, epoch, version, engine ids) each time the router's snapshot changed
    snapshots: list[tuple[float, str, int, frozenset[str]]] = field(default_factory=list)
    # (monotonic time, engine id) of each decision for an unreachable engine (RouteLoop)
    failed: list[tuple[float, str]] = field(default_factory=list)
    lost: int = 0  # requests that found an unreachable engine on every try


class RouteLoop:
    """Routes through ``router`` continuously on a thread and records what happened.

    Requests finish ``hold_s`` after they were routed, so the router has
    in-flight bookkeeping to keep across faults. With ``unreachable``, a request routed
    to an engine it names fails as a connection error would: the loop calls
    ``failed()`` and routes it again, up to ``tries`` times (``log.failed``: every
    such decision; ``log.lost``: requests that failed every try).
    """

    def __init__(
        self,
        router: Any,
        interval_s: float = 0.002,
        hold_s: float = 0.05,
        unreachable: Callable[[str], bool] | None = None,
        tries: int = 3,
    ) -> None:
        self.router = router
        self.interval_s = interval_s
        self.hold_s = hold_s
        self.unreachable = unreachable
        self.tries = tries
        self.log = RouteLog()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="route-loop")

    def start(self) -> RouteLoop:
        self._thread.start()
        return self

    def stop(self) -> RouteLog:
        self._stop.set()
        self._thread.join(5)
        return self.log

    def _run(self) -> None:
        inflight: collections.deque[tuple[float, Any]] = collections.deque()
        seen: tuple[str, int] | None = None
        while not self._stop.is_set():
            now = time.monotonic()
            snap = self.router.snapshot
            if snap is not None and (snap.epoch, snap.version) != seen:
                seen = (snap.epoch, snap.version)
                self.log.snapshots.append((now, snap.epoch, snap.version, frozenset(snap.engines)))
            try:
                t = time.perf_counter()
                d = self.router.route()
                took = time.perf_counter() - t
                tries = 1
                while self.unreachable is not None and self.unreachable(d.engine_id):
                    self.log.failed.append((now, d.engine_id))
                    self.router.failed(d, "connection refused")
                    if tries == self.tries:
                        self.log.lost += 1
                        break
                    tries += 1
                    d = self.router.route()
            except Exception as exc:  # the point: route() must never raise
                snap = self.router.snapshot
                where = (
                    f"snapshot {snap.epoch} v{snap.version} engines={sorted(snap.engines)}"
                    if snap is not None
                    else "no snapshot"
                )
                self.log.errors.append(f"{type(exc).__name__}: {exc} [{where}]")
            else:
                done = time.monotonic()
                self.log.decisions.append((now, d.engine_id, d.version, d.degraded, done))
                self.log.durations.append((now, took))
                if not d.done:  # (not failed on its last try)
                    inflight.append((now, d))
            while inflight and now - inflight[0][0] >= self.hold_s:
                self.router.finished(inflight.popleft()[1])
            self._stop.wait(self.interval_s)

    # -- queries ------------------------------------------------------------------------------

    def current(self) -> tuple[str, int] | None:
        snaps = self.log.snapshots
        return (snaps[-1][1], snaps[-1][2]) if snaps else None

    def route_times(self, t0: float, t1: float) -> list[float]:
        """Seconds each route() call between t0 and t1 took, sorted."""
        return sorted(d for t, d in list(self.log.durations) if t0 <= t < t1)

    def decisions_since(self, t: float) -> list[Decided]:
        return [d for d in list(self.log.decisions) if d[0] >= t]

    def degraded_run(self, since: float) -> tuple[list[Decided], Decided | None]:
        """The decisions from the first one flagged degraded that began at or after
        ``since`` up to the next one that is not, and that next one (None while routing
        is still degraded). Taken in the loop's own order from the router's own flags,
        so no clock of another thread decides where the run starts."""
        ds = list(self.log.decisions)
        first = next((i for i, d in enumerate(ds) if d[0] >= since and d[3]), None)
        if first is None:
            return [], None
        end = next((i for i in range(first, len(ds)) if not ds[i][3]), None)
        return ds[first:end], None if end is None else ds[end]

    def versions_monotonic(self) -> list[str]:
        """Every place where the router went back to an older version within an epoch."""
        bad = []
        last: dict[str, int] = {}
        prev_epoch = None
        for _t, epoch, version, _engines in list(self.log.snapshots):
            if epoch == prev_epoch and version < last[epoch]:
                bad.append(f"{epoch}: {last[epoch]} -> {version}")
            if epoch != prev_epoch and epoch in last and version < last[epoch]:
                bad.append(f"back to old epoch {epoch}: {last[epoch]} -> {version}")
            last[epoch] = max(version, last.get(epoch, version))
            prev_epoch = epoch
        return bad


class Routers:
    """In-process Router objects, each with a RouteLoop; all stopped on exit (the
    ``routers`` fixture of conftest.py)."""

    def __init__(self) -> None:
        self.routers: list[Any] = []
        self.loops: list[RouteLoop] = []

    def add(
        self,
        url: str,
        deployment: str,
        index: int,
        count: int,
        unreachable: Callable[[str], bool] | None = None,
        **kw: object,
    ) -> RouteLoop:
        from redisbal import Router

        router = Router(url, deployment, index, count, **kw)  # type: ignore[arg-type]
        self.routers.append(router)
        router.start(wait=10.0)
        loop = RouteLoop(router, unreachable=unreachable).start()
        self.loops.append(loop)
        return loop

    def close(self) -> None:
        for loop in self.loops:
            loop.stop()
        for router in self.routers:
            router.close()


def synced(loop: RouteLoop, engines: tuple[str, ...] | set[str], epoch: str | None = None) -> bool:
    """The router has a fresh snapshot with exactly these engines (and this epoch)."""
    snap = loop.router.snapshot
    return (
        snap is not None
        and set(snap.engines) == set(engines)
        and not loop.router.degraded
        and (epoch is None or snap.epoch == epoch)
    )


def assert_routing_never_failed(*loops: RouteLoop) -> None:
    for loop in loops:
        history = [(round(t, 3), e, v, len(en)) for t, e, v, en in loop.log.snapshots]
        assert loop.log.errors == [], f"route() raised: {loop.log.errors[:3]}; history {history}"
        assert loop.versions_monotonic() == [], "a router went back to an older version"


# the engines start_deployment() runs; the fault tests use them
ENGINES = ("e0", "e1", "e2")

# A Sentinel failover here takes 1.3-2.5 s (down-after 1000 ms, election, promotion); engines
# cannot report meanwhile. These tests keep dead_after_ms above it (the default is 5000);
# test_failover_longer_than_dead_after_expires_no_engine covers the other case.
FAILOVER_DEAD_AFTER_MS = 5000


def start_deployment(
    g: ProcGroup,
    engines: tuple[str, ...] = ENGINES,
    coordinators: tuple[str, ...] = ("c1",),
    **coord_opts: object,
) -> dict[str, object]:
    """A coordinator (or several) and lockstep engines stepping on a shared 50 ms clock."""
    t0 = time.time()
    procs = {c: g.coordinator(c, **coord_opts) for c in coordinators}
    procs.update({e: g.engine(e, t0) for e in engines})
    for p in procs.values():
        p.wait_ready()  # type: ignore[attr-defined]
    return procs


def stored(c: redis.Redis, keys: DeploymentKeys) -> Snapshot | None:
    raw = c.get(keys.snapshot)
    return Snapshot.from_json(raw) if raw else None  # type: ignore[arg-type]


class SnapshotObserver:
    """Every snapshot published on a deployment's channel, as received (resubscribes on loss)."""

    def __init__(self, url: str, channel: str) -> None:
        self.url = url
        self.channel = channel
        self.received: list[tuple[float, Any]] = []  # (monotonic time, Snapshot)
        self._stop = threading.Event()
        self._subscribed = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="observer")

    def start(self) -> SnapshotObserver:
        self._thread.start()
        self._subscribed.wait(10)
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        from redisbal.barrier.snapshot import Snapshot
        from redisbal.connection import make_client

        while not self._stop.is_set():
            client = pubsub = None
            try:
                client = make_client(self.url, socket_timeout=2.0, socket_connect_timeout=1.0)
                pubsub = client.pubsub()
                pubsub.subscribe(self.channel)
                while not self._stop.is_set():
                    msg = pubsub.get_message(timeout=0.1)
                    if msg is None:
                        continue
                    if msg["type"] == "subscribe":
                        self._subscribed.set()
                    elif msg["type"] in ("message", "smessage"):
                        self.received.append((time.monotonic(), Snapshot.from_json(msg["data"])))
            except Exception:
                self._stop.wait(0.05)
            finally:
                with contextlib.suppress(Exception):
                    if pubsub is not None:
                        pubsub.close()
                    if client is not None:
                        client.close()

    def since(self, t: float) -> list[Any]:
        return [s for ts, s in list(self.received) if ts >= t]

    def first_since(self, t: float, pred: Callable[[Any], bool]) -> tuple[float, Any] | None:
        for ts, s in list(self.received):
            if ts >= t and pred(s):
                return ts, s
        return None


class TcpProxy:
    """A TCP relay in front of Redis for one client: ``cut()`` drops its connections and
    refuses new ones (a partition with resets), ``stall()`` stops forwarding without closing
    anything (a silent partition), ``restore()`` ends either."""

    def __init__(self, target_port: int, host: str = "127.0.0.1") -> None:
        self.target = (host, target_port)
        self.listener = socket.create_server((host, 0))
        self.port = self.listener.getsockname()[1]
        self.mode = "open"
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._resume = threading.Event()
        self._resume.set()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="proxy-accept").start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self.mode == "cut":
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=2)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                self._resume.wait()
                if self.mode == "cut":
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()

    def cut(self) -> None:
        self.mode = "cut"
        self._resume.set()
        with self._lock:
            conns, self._conns = self._conns, []
        for s in conns:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def stall(self) -> None:
        self.mode = "stall"
        self._resume.clear()

    def restore(self) -> None:
        self.mode = "open"
        self._resume.set()

    def close(self) -> None:
        self._closed = True
        self.cut()
        self.listener.close()
