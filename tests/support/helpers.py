"""Shared helpers for the core tests: direct script calls, state dumps, polling.

The barrier tests drive the real Lua scripts through ``redisbal.barrier.operations.Scripts``
(the same path the library uses) and read the raw keys back, so a test sees
exactly what Redis stored, not what a Python wrapper believes it stored.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import inspect
import random
import re
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from typing import Any, Generic, TypeVar

import orjson
import redis

from redisbal.barrier.loader import script_source
from redisbal.barrier.operations import Scripts, report_reply
from redisbal.barrier.record import format_record, parse_record
from redisbal.barrier.snapshot import EngineCounts, Snapshot
from redisbal.keys import BARRIER_FIELDS, DeploymentKeys, is_engine_field
from redisbal.ops.coordinator import Coordinator, CoordinatorConfig
from redisbal.routing.router_core import RouterCore

T = TypeVar("T")
STEP_SPAN = 2**32
LONG_AGO_MS = 1_000_000_000_000  # 2001, as 13 digits like every current ms time

# Settings that keep tests fast and free of time-dependent surprises: no join
# grace, engines never expire by the clock, no idle republish, force only when asked.
FAST_CONFIG = {
    "dead_after_ms": "600000",
    "stall_ms": "600000",
    "join_grace_ms": "0",
    "idle_publish_ms": "3600000",
    "tick_ms": "20",
}


def text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def wait_until(
    pred: Callable[[], T], timeout: float = 10.0, what: str = "", interval: float = 0.01
) -> T:
    """Poll pred until it returns something truthy and return that.

    The one way a test waits for a state: never a fixed sleep followed by an assert.
    An exception from pred counts as "not yet" (a probe may hit a Redis that is down)
    and is named at the timeout; an AssertionError from pred fails at once. The
    timeout only guards a hang: no test asserts how long anything took.
    """
    poll = _Poll(pred, timeout, what)
    while (got := poll()) is None:
        time.sleep(interval)
    return got


async def await_until(
    pred: Callable[[], T],
    timeout: float = 10.0,
    what: str = "",
    interval: float = 0.01,
    *,
    threaded: bool = False,
) -> T:
    """``wait_until`` for asyncio tests: the event loop runs while it waits. With
    ``threaded``, pred runs in a worker thread (a probe that blocks, such as a command
    run to its end, while the loop carries the test's load)."""
    poll = _Poll(pred, timeout, what)
    while (got := await asyncio.to_thread(poll) if threaded else poll()) is None:
        await asyncio.sleep(interval)
    return got


class _Poll(Generic[T]):
    """One probe of pred per call: its truthy value, or None while not yet; raises
    AssertionError once the timeout has passed."""

    def __init__(self, pred: Callable[[], T], timeout: float, what: str) -> None:
        self.pred = pred
        self.timeout = timeout
        self.what = what
        self.deadline = time.monotonic() + timeout

    def __call__(self) -> T | None:
        try:
            got = self.pred()
        except AssertionError:
            raise
        except Exception as exc:
            got, error = None, exc
        else:
            error = None
        if got:
            return got
        if time.monotonic() >= self.deadline:
            extra = f" (last probe error: {error!r})" if error is not None else ""
            raise AssertionError(
                f"timed out after {self.timeout:.1f}s waiting for {self.what or self.pred}{extra}"
            ) from error
        return None


class Blocking:
    """Drive either twin of a blocking/asyncio pair (Reporter and
    AsyncReporter, Router and AsyncRouter) through one test flow: a coroutine a
    method returns is run to completion on a private event loop, and ``close()``
    calls ``aclose()`` where the object has one."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj
        self.loop = asyncio.new_event_loop()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.obj, name)
        if not callable(attr):
            return attr

        if not hasattr(self.obj, "aclose"):  # the blocking twin: a plain call
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            # inside the loop: an asyncio twin may hand work to its loop before awaiting
            async def run() -> Any:
                out = attr(*args, **kwargs)
                return await out if inspect.isawaitable(out) else out

            return self.loop.run_until_complete(run())

        return call

    def close(self, *args: Any, **kwargs: Any) -> None:
        try:
            if hasattr(self.obj, "aclose"):
                self.loop.run_until_complete(self.obj.aclose(*args, **kwargs))
            else:
                self.obj.close(*args, **kwargs)
        finally:
            self.loop.close()


SOCKET_IO = ("connect", "connect_ex", "send", "sendall", "sendto", "sendmsg", "recv", "recv_into")


@contextlib.contextmanager
def io_of_this_thread() -> Iterator[Counter[str]]:
    """Counts the socket calls the calling thread makes inside the block; other threads'
    calls (a router's feed, a sender's thread) are not counted, nor are writes to an
    unnamed socket pair (an event loop's non-blocking wake-up, as
    ``call_soon_threadsafe`` makes: it cannot reach Redis). An empty count proves
    that the block never waited on the network, however slow the machine: the way to
    test "never waits on Redis" without timing it."""
    me = threading.get_ident()
    calls: Counter[str] = Counter()
    originals = {name: getattr(socket.socket, name) for name in SOCKET_IO}
    own = {name for name in SOCKET_IO if name in vars(socket.socket)}  # else inherited

    def counted(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def call(self: socket.socket, *args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() == me and not _wake_up_pair(self):
                calls[name] += 1
            return original(self, *args, **kwargs)

        return call

    for name, original in originals.items():
        setattr(socket.socket, name, counted(name, original))
    try:
        yield calls
    finally:
        for name, original in originals.items():
            if name in own:
                setattr(socket.socket, name, original)
            else:
                delattr(socket.socket, name)


def _wake_up_pair(sock: socket.socket) -> bool:
    """An unnamed unix socket pair of this process (an event loop's self-pipe)."""
    try:
        return sock.family == socket.AF_UNIX and not sock.getpeername()
    except OSError:
        return False


def glob_escape(text: str) -> str:
    """`text` as a literal inside a Redis SCAN/KEYS pattern."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


def keys_of(r: redis.Redis, tags: Iterable[str], named: Iterable[str] = ()) -> set[bytes]:
    """The keys that hold any of `tags` (a deployment's name: its keys are
    ``redisbal:{<name>}:...``) anywhere in their name, plus those of `named` that exist.
    A test compares only keys it made: the database is shared with other tests, whose
    keys come and go (leases with a TTL) while it runs."""
    found: set[bytes] = set()
    for tag in tags:
        found.update(r.scan_iter(match=f"*{glob_escape(tag)}*", count=1000))
    found.update(k.encode() for k in named if r.exists(k))
    return found


def contents(r: redis.Redis, keys: list[str]) -> dict[str, object]:
    """Each key's type and contents, to compare state before and after a call. Not DUMP:
    Redis rehashes a hash table incrementally (on reads, and in the background), so the
    DUMP of an unchanged hash can list its fields in another order."""
    out: dict[str, object] = {}
    for k in keys:
        kind = text(r.type(k))
        value: object
        if kind == "string":
            value = r.get(k)
        elif kind == "hash":
            value = r.hgetall(k)
        elif kind == "zset":
            value = r.zrange(k, 0, -1, withscores=True)
        elif kind == "set":
            value = r.smembers(k)
        elif kind == "list":
            value = r.lrange(k, 0, -1)
        else:
            value = None
        out[k] = (kind, value)
    return out


@contextlib.contextmanager
def coordinator(redis_url: str, deployment: str, **cfg: int) -> Iterator[Coordinator]:
    """A real coordinator (stall guard, reaper) on a thread, with short lifecycle bounds."""
    config = CoordinatorConfig(join_grace_ms=0, **cfg)
    coord = Coordinator(redis_url, deployment, config, interval_s=0.02)
    th = threading.Thread(target=coord.run, daemon=True)
    th.start()
    try:
        yield coord
    finally:
        coord.stop()
        th.join(timeout=5)


def script_sha(name: str) -> str:
    """The SHA1 under which Redis caches the EVAL source of operation ``name``."""
    return hashlib.sha1(script_source(name).encode()).hexdigest()


def server_ms(r: redis.Redis) -> int:
    sec, usec = r.time()
    return int(sec) * 1000 + int(usec) // 1000


class Barrier:
    """Thin, typed access to the barrier scripts of one deployment for tests."""

    def __init__(
        self, r: redis.Redis, keys: DeploymentKeys, epoch: str = "e1", *, use_functions: bool = True
    ) -> None:
        self.r = r
        self.keys = keys
        self.epoch = epoch
        self.scripts = Scripts(r, keys, use_functions=use_functions)

    def configure(self, **fields: str | int) -> str:
        merged = {**FAST_CONFIG, **{k: str(v) for k, v in fields.items()}}
        args: list[str] = []
        for k, v in merged.items():
            args += [k, v]
        return text(self.scripts.call("configure", self.epoch, *args))

    def report(
        self,
        engine: str,
        step: int | str,
        waiting: int = 0,
        running: int = 0,
        wave: int = 0,
        kv: str = "",
        adm: str = "",
        inc: str | None = None,
        progress: bool = True,
        total: str | None = None,
    ) -> tuple[str, int, int, int]:
        """One report; ``inc`` names the reporting process's incarnation (None: the
        report carries no lifecycle arguments, as older clients send it); ``total``
        the admitted total (None: the argument is left out)."""
        args: list[str | int] = [self.epoch, engine, wave, step, waiting, running, kv, adm]
        if inc is not None or not progress or total is not None:
            args += [inc or "-", "1" if progress else "0"]
        if total is not None:
            args.append(total)
        return report_reply(self.scripts.call("report", *args))

    def register(self, *engines: str) -> int:
        return int(self.scripts.call("register", self.epoch, *engines))

    def leave(self, engine: str, inc: str = "-") -> tuple[int, int]:
        removed, version = self.scripts.call("leave", engine, inc)
        return int(removed), int(version)

    def suspect(self, engine: str, client: int = 0, reason: str = "test") -> tuple[str, int]:
        status, version = self.scripts.call("suspect", engine, client, reason)
        return text(status), int(version)

    def recovered(self, engine: str, client: int = 0) -> tuple[str, int]:
        status, version = self.scripts.call("recovered", engine, client)
        return text(status), int(version)

    def reap(self, limit: int = 1000, fence: str = "") -> tuple[int, list[str]]:
        out = self.scripts.call("reap", limit, fence)
        return int(out[0]), [text(e) for e in out[1:]]

    def force(self, stall_ms: str = "", fence: str = "") -> tuple[int, list[str]]:
        out = self.scripts.call("force", stall_ms, fence)
        return int(out[0]), [text(e) for e in out[1:]]

    def expire_now(self, engine: str) -> None:
        """Make engine look dead: its liveness score and its last report time far in the
        past (the reap script checks both), as if it had been silent for ages."""
        assert self.r.zscore(self.keys.members, engine) is not None, f"{engine} is no member"
        self.r.zadd(self.keys.members, {engine: 0}, xx=True)
        raw = self.r.hget(self.keys.reports, engine)
        if raw is not None:  # age the newest report
            rec = parse_record(text(raw))
            if rec.latest is not None:
                aged = replace(rec.latest, ms=LONG_AGO_MS)
                rec = replace(rec, reports=(aged, *rec.reports[1:]))
                self.r.hset(self.keys.reports, engine, format_record(rec))

    def age_progress(self, engine: str) -> None:
        """The engine's last progress long ago (its loop hung): its next heartbeat with
        work queued or running finds it stalled."""
        raw = self.r.hget(self.keys.reports, engine)
        assert raw is not None, f"{engine} has no record"
        rec = parse_record(text(raw))
        self.r.hset(self.keys.reports, engine, format_record(replace(rec, progress_ms=1)))

    def set_opportunistic_reap(self, engine: str, due: bool) -> None:
        """Reports expire dead engines on the way when they refresh their heartbeat (every
        dead_after_ms / 8) and a reap is due (every dead_after_ms / 4); make the next
        report of ``engine`` do it (due) or not, so that a test knows which happens."""
        if not due:
            self.r.hset(self.keys.reports, ".next_reap", str(server_ms(self.r) + 10**9))
            return
        self.r.hdel(self.keys.reports, ".next_reap")
        raw = self.r.hget(self.keys.reports, engine)
        if raw is not None:  # heartbeat due at 0: refreshed by the next report
            rec = replace(parse_record(text(raw)), due_ms=0)
            self.r.hset(self.keys.reports, engine, format_record(rec))

    def stall_for(self, ms: int) -> None:
        """The barrier has waited ``ms`` longer since the first engine moved past the
        published step (its start set back): the stall guard weighs that wait against
        stall_ms, and no test sleeps for it."""
        since = self.r.hget(self.keys.reports, ".since")
        assert since is not None, "no engine is past the published step"
        self.r.hset(self.keys.reports, ".since", str(int(since) - ms))

    def end_join_grace(self, ms: int) -> None:
        """The generation started ``ms`` earlier (its join grace of at most ``ms`` over),
        as if that time had passed."""
        start = int(self.meta()["epoch_start"])
        self.r.hset(self.keys.meta, "epoch_start", str(start - ms))

    def silence(self, ms: int) -> None:
        """Nothing reached the deployment for ``ms``: its last reap that long ago, and
        every member's last report too (``expire_now``)."""
        self.r.hset(self.keys.meta, "reaped_at", str(server_ms(self.r) - ms))
        for engine in self.members():
            self.expire_now(engine)

    def end_hold(self) -> None:
        """The hold on expiry that a silence started (reap) is over."""
        assert self.r.hdel(self.keys.meta, "hold_until") == 1, "no hold"

    # -- reading state -----------------------------------------------------------------------

    def snapshot_raw(self) -> bytes | None:
        return self.r.get(self.keys.snapshot)  # type: ignore[return-value]

    def snapshot(self) -> Snapshot | None:
        raw = self.snapshot_raw()
        return Snapshot.from_json(raw) if raw else None

    def meta(self) -> dict[str, str]:
        return {text(k): text(v) for k, v in self.r.hgetall(self.keys.meta).items()}

    def hot(self) -> dict[str, str]:
        """The barrier's hot fields (.pub, .behind, ...) without the dot."""
        got = self.r.hmget(self.keys.reports, list(BARRIER_FIELDS))
        return {f[1:]: text(v) for f, v in zip(BARRIER_FIELDS, got, strict=True) if v is not None}

    def counter(self, name: str) -> int:
        return int(self.meta().get(name, "0"))

    def members(self) -> dict[str, float]:
        return {text(k): v for k, v in self.r.zrange(self.keys.members, 0, -1, withscores=True)}

    def records(self) -> dict[str, tuple[str, list[int]]]:
        """engine -> (flag, scores of its stored reports, newest first): flag "b" is a
        barrier member, "p" a provisional joiner (redisbal.barrier.record)."""
        out: dict[str, tuple[str, list[int]]] = {}
        for k, v in self.r.hgetall(self.keys.reports).items():
            if is_engine_field(text(k)):
                rec = parse_record(text(v))
                out[text(k)] = (rec.flag, rec.scores)
        return out

    def reported_ms(self, engine: str) -> int:
        """When (server ms) the engine's newest stored report was made."""
        raw = self.r.hget(self.keys.reports, engine)
        latest = parse_record(text(raw)).latest if raw is not None else None
        assert latest is not None, f"{engine} has no report"
        return latest.ms

    def history(self, engine: str) -> list[int]:
        """Scores of the engine's stored reports, newest first ([] if none)."""
        return self.records().get(engine, ("", []))[1]

    def barrier(self) -> dict[str, float]:
        """Barrier members -> score of their latest report (-1: registered, no report yet)."""
        return {
            e: float(scores[0]) if scores else -1.0
            for e, (flag, scores) in self.records().items()
            if flag == "b"
        }

    def dump(self) -> dict[str, object]:
        """Every deployment key's contents: state to compare before/after (contents)."""
        return contents(self.r, self.keys.all_keys())


def score(wave: int, step: int) -> int:
    return wave * STEP_SPAN + step


def counts(snap: Snapshot) -> dict[str, tuple[int, int, int, int]]:
    """engine -> (wave, step, waiting, running) of a snapshot: what a cut is made of."""
    return {e: (c.wave, c.step, c.waiting, c.running) for e, c in snap.engines.items()}


def make_snapshot(
    engines: dict[str, tuple[int, int]] | dict[str, EngineCounts],
    *,
    version: int = 1,
    epoch: str = "ep",
    time_ms: int = 1_000_000,
    reported_ms: int | None = None,
    admitted: dict[str, tuple[int, ...]] | None = None,
    kv: dict[str, float] | None = None,
    gone: dict[str, str] | None = None,
    step: int = 1,
    incarnation: dict[str, str] | None = None,
    total: dict[str, int] | None = None,
    **fields: Any,
) -> Snapshot:
    """A Snapshot built the way the Lua barrier builds one (through its JSON form);
    ``total``: engines' admitted totals; ``fields`` set top-level fields (forced,
    laggards, stalled, suspect, ...)."""
    frags: dict[str, Any] = {}
    for e, c in engines.items():
        if isinstance(c, EngineCounts):
            frag: dict[str, Any] = {
                "wave": c.wave,
                "step": c.step,
                "waiting": c.waiting,
                "running": c.running,
                "kv": c.kv_usage,
                "t": c.reported_ms,
            }
            if c.admitted is not None:
                frag["adm"] = list(c.admitted)
            if c.admitted_total is not None:
                frag["tot"] = c.admitted_total
        else:
            w, r = c
            frag = {
                "wave": 0,
                "step": step,
                "waiting": w,
                "running": r,
                "kv": (kv or {}).get(e),
                "t": time_ms if reported_ms is None else reported_ms,
            }
            if admitted and e in admitted:
                frag["adm"] = list(admitted[e])
            if total and e in total:
                frag["tot"] = total[e]
        if incarnation and e in incarnation:
            frag["inc"] = incarnation[e]
        frags[e] = frag
    doc = {
        "deployment": "d",
        "epoch": epoch,
        "version": version,
        "wave": 0,
        "step": step,
        "forced": False,
        "laggards": {},
        "gone": gone or {},
        "joining": [],
        "time_ms": time_ms,
        "engines": frags,
        **fields,
    }
    return Snapshot.from_json(orjson.dumps(doc))


def cache_core(
    loads: dict[str, tuple[int, int]],
    kv: dict[str, float] | None = None,
    seed: int = 0,
    learn_routes: int = 0,
) -> RouterCore:
    """A connected RouterCore on a snapshot of ``loads`` (engine -> (waiting,
    running)), every engine admitting: what the cache-routing tests fill a view into
    (or let it learn, ``learn_routes``)."""
    core = RouterCore(0, 1, rng=random.Random(seed), learn_routes=learn_routes)
    adm = {e: (0,) for e in loads}
    core.apply_snapshot(make_snapshot(loads, admitted=adm, kv=kv))
    core.connected = True
    return core
