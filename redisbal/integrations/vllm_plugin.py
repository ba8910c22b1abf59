"""vLLM stat-logger plugin: every engine step's counts reach the deployment, no patch.

vLLM loads it from the entry-point group ``vllm.stat_logger_plugins`` (this package
registers ``redisbal``) in each API-server process, and calls ``record()`` on its
output loop once per engine step with that step's ``SchedulerStats``. ``record()``
only validates and stores the counts; a background sender (one per process, for
every engine the process sees) writes them to Redis, so vLLM's loop never waits on
Redis and an outage costs a rate-limited warning.

Configured by environment variables (nothing happens, with one warning, without
the first two):

- ``REDISBAL_REDIS_URL``, ``REDISBAL_DEPLOYMENT``;
- ``REDISBAL_ENGINE_ID``: engine-id template over ``{engine}`` (vLLM's engine
  index, the global DP rank), ``{hostname}``, and ``{host}`` / ``{port}`` of
  ``REDISBAL_ENGINE_URL``; default ``{host}-{port}-{engine}`` with an engine URL,
  ``{hostname}-{engine}`` without;
- ``REDISBAL_ENGINE_URL``: where a gateway sends this server's requests (one
  endpoint per DP rank with ``--data-parallel-rank``);
- ``REDISBAL_MODE``: ``tick`` (default) or ``lockstep``, which tags reports with
  the stats' ``(current_wave, step_counter)``; only for vLLM versions that stamp
  those fields on the stats the front-end receives.

Each report carries the engine's admitted total: the requests it finished
(``IterationStats.finished_requests``, summed since the process began) + waiting +
running, what routers reconcile their routes with where there are no per-router counts
(routing/admit_total.py). Only with one API server: each sees only its own requests
finish, so none of them can count an engine's. An aborted request that vLLM leaves out
of ``finished_requests`` keeps the total one low; routers bound that drift.

The engines' running cap (the scheduler's ``max_num_active_seqs`` where set, else
``max_num_seqs``, from the ``vllm_config`` vLLM hands the plugin) is declared once per
engine (``redisbal.running_caps``), so routers know each engine's free slots from its
first report on.

Once the server answers ``GET /health`` at ``REDISBAL_ENGINE_URL`` (at once
without one), its engines are reported idle: a fresh or restarted server is
routable before anyone sends it a request. Between steps the last counts are
re-sent as "no progress" heartbeats: an idle engine stays routable; a busy
engine whose steps stop (a hung loop) is stalled by the barrier after the
deployment's ``stall_after_ms`` (not routed to, not waited for) and comes back
with its next step; a front-end process that dies falls silent and its engines
expire.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import hashlib
import logging
import math
import os
import socket
import ssl
import string
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from redisbal.errors import InvalidArgument
from redisbal.errors import PluginConfigError as PluginConfigError
from redisbal.integrations.relay import CountsRelay, RateLimitedLog, sanitise
from redisbal.keys import InvalidName, check_name
from redisbal.reporting.counts import Counts
from redisbal.reporting.reporter import InvalidReport, new_incarnation
from redisbal.running_caps import check_running_cap

log = logging.getLogger("redisbal.vllm")

try:  # one instance per front-end for all its engines where vLLM offers it
    from vllm.v1.metrics.loggers import AggregateStatLoggerBase as _Base  # type: ignore
except ImportError:  # older vLLM: one instance per engine; without vLLM: plain class
    try:
        from vllm.v1.metrics.loggers import StatLoggerBase as _Base  # type: ignore
    except ImportError:
        _Base = object

FIELDS = ("engine", "hostname", "host", "port")
MODES = ("tick", "lockstep")


@dataclass(frozen=True)
class PluginConfig:
    redis_url: str
    deployment: str
    template: str
    engine_url: str | None
    mode: str
    host: str = ""
    port: str = ""

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> PluginConfig | None:
        """None when the plugin is not configured; PluginConfigError when misconfigured."""
        url, dep = env.get("REDISBAL_REDIS_URL"), env.get("REDISBAL_DEPLOYMENT")
        if not url or not dep:
            return None
        check_name(dep, "REDISBAL_DEPLOYMENT")
        mode = env.get("REDISBAL_MODE", "tick")
        if mode not in MODES:
            raise PluginConfigError(f"REDISBAL_MODE must be one of {MODES}, got {mode!r}")
        engine_url = env.get("REDISBAL_ENGINE_URL") or None
        host = port = ""
        if engine_url:
            parts = urlsplit(engine_url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise PluginConfigError(f"REDISBAL_ENGINE_URL {engine_url!r}: expected http(s)://")
            host = parts.hostname
            port = str(parts.port or (443 if parts.scheme == "https" else 80))
        default = "{host}-{port}-{engine}" if engine_url else "{hostname}-{engine}"
        template = env.get("REDISBAL_ENGINE_ID") or default
        names = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
        bad = [n for n in names if n not in FIELDS or (n in ("host", "port") and not engine_url)]
        if bad:
            raise PluginConfigError(
                f"REDISBAL_ENGINE_ID {template!r}: field {{{bad[0]}}} unknown or needs "
                f"REDISBAL_ENGINE_URL; use {', '.join('{' + f + '}' for f in FIELDS)}"
            )
        return cls(url, dep, template, engine_url, mode, host, port)

    def engine_id(self, engine_index: int) -> str:
        eid = self.template.format(
            engine=engine_index,
            hostname=sanitise(socket.gethostname()),
            host=sanitise(self.host),
            port=sanitise(self.port),
        ).lstrip("-_.")
        return check_name(eid, "REDISBAL_ENGINE_ID result")


# -- one sender per process, shared by every instance (and so every engine) ---------------

_senders: dict[tuple[str, str, str], CountsRelay] = {}
_senders_lock = threading.Lock()
_warned_unconfigured = False


def api_server_count(vllm_config: Any) -> int:
    """How many API-server processes front the engines (``--api-server-count``)."""
    parallel = getattr(vllm_config, "parallel_config", None)
    count = getattr(parallel, "_api_process_count", 1)
    return count if isinstance(count, int) and count > 0 else 1


def running_cap_of(vllm_config: Any) -> int | None:
    """How many requests each engine runs at once: the scheduler's ``max_num_active_seqs``
    where set (it bounds RUNNING below ``max_num_seqs``), else ``max_num_seqs``. None
    without a config or with a value that is no whole number >= 1 (the plugin then
    declares no cap, and routers learn it from queues, as before)."""
    sched = getattr(vllm_config, "scheduler_config", None)
    for name in ("max_num_active_seqs", "max_num_seqs"):
        value = getattr(sched, name, None)
        if value is None:
            continue
        try:
            return check_running_cap(value, f"scheduler_config.{name}")
        except InvalidArgument as exc:
            log.warning("redisbal plugin: declaring no running cap: %s", exc)
            return None
    return None


def server_incarnation(pid: int | None = None) -> str | None:
    """One incarnation for every API-server process of one vLLM server: the parent
    they share (its start time and pid, from /proc; None where there is no /proc).
    Several API servers report the same engines; with one name between them the
    barrier takes their reports as one process's, not as two processes under one
    engine id (a conflict)."""
    ppid = os.getppid() if pid is None else pid
    try:
        with open(f"/proc/{ppid}/stat", encoding="ascii") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat", encoding="ascii") as f:
            boot_s = next(int(ln.split()[1]) for ln in f if ln.startswith("btime "))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    start_ms = boot_s * 1000 + start_ticks * 1000 // os.sysconf("SC_CLK_TCK")
    tag = hashlib.sha1(f"{socket.gethostname()}:{ppid}:{start_ticks}".encode()).hexdigest()
    return f"{new_incarnation(start_ms).split('-')[0]}-{tag[:8]}"


def shared_sender(cfg: PluginConfig, incarnation: str | None = None) -> CountsRelay:
    key = (cfg.redis_url, cfg.deployment, cfg.mode)
    with _senders_lock:
        sender = _senders.get(key)
        if sender is None:
            sender = _senders[key] = CountsRelay(
                cfg.redis_url,
                cfg.deployment,
                mode=cfg.mode,
                incarnation=incarnation,
                # steps bring new counts; between them (idle, or a hung loop) the last
                # ones are re-sent as "no progress" for as long as this process lives: a
                # busy engine without steps is stalled by the barrier, a dead one expires
                max_age_s=None,
            )
            atexit.register(sender.close)
        return sender


READY_POLL_S = 0.25
READY_WARN_AFTER_S = 120.0


def announce_when_ready(
    sender: CountsRelay, engine_ids: list[str], engine_url: str | None
) -> concurrent.futures.Future[None]:
    """Report the engines idle as soon as their server answers ``GET /health``.

    vLLM calls stat loggers only when an engine steps, and an engine steps only when
    it has requests: without this, a fresh or restarted server that no client sends to
    directly registers, never reports, and expires unrouted. ``/health`` answers once
    the engine and the HTTP server are up, so gateways do not get the engine before it
    can serve. Without an engine URL (no gateway sends to it) the engines are ready at
    once. Counts from a real step always win (``CountsRelay.ready``). It polls on the
    relay's sender loop: no thread of its own."""

    async def run() -> None:
        if engine_url:
            health = engine_url.rstrip("/") + "/health"
            started = time.monotonic()
            warned = False
            while not await _answers(health):
                if not warned and time.monotonic() - started > READY_WARN_AFTER_S:
                    warned = True
                    log.warning(
                        "redisbal plugin: %s has not answered for %.0f s; the engines are "
                        "announced at their first step. Is REDISBAL_ENGINE_URL an address "
                        "this host can reach?",
                        health,
                        READY_WARN_AFTER_S,
                    )
                await asyncio.sleep(READY_POLL_S)
        for eid in engine_ids:
            with contextlib.suppress(KeyError):  # the sender was closed meanwhile
                sender.ready(eid)
        log.info("redisbal plugin: engines %s ready", ", ".join(engine_ids))

    return sender.spawn(run())


async def _answers(url: str, timeout_s: float = 1.0) -> bool:
    """Whether ``GET url`` answers 2xx (directly, never through a proxy)."""
    parts = urlsplit(url)
    https = parts.scheme == "https"
    try:
        port = parts.port or (443 if https else 80)
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(
                parts.hostname, port, ssl=ssl.create_default_context() if https else None
            ),
            timeout_s,
        )
        try:
            request = f"GET {parts.path or '/'} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
            writer.write((request + "Connection: close\r\n\r\n").encode())
            await writer.drain()
            status = (await asyncio.wait_for(reader.readline(), timeout_s)).split()
        finally:
            writer.close()
            with contextlib.suppress(OSError, asyncio.TimeoutError):
                await asyncio.wait_for(writer.wait_closed(), timeout_s)
    except (OSError, ValueError, asyncio.TimeoutError):  # refused, reset, timed out
        return False
    return len(status) >= 2 and status[1].isdigit() and 200 <= int(status[1]) < 300


def close_all(leave: bool = True) -> None:
    """Stop every sender of this process (tests; vLLM exits through atexit)."""
    with _senders_lock:
        senders = list(_senders.values())
        _senders.clear()
    for s in senders:
        atexit.unregister(s.close)
        s.close(leave=leave)


class RedisbalStatLogger(_Base):  # type: ignore[misc, valid-type]
    """Reports each engine step's waiting / running / KV usage to a redisbal deployment."""

    def __init__(
        self,
        vllm_config: Any = None,
        engine_indexes: list[int] | None = None,
        engine_index: int = 0,
        *,
        env: Mapping[str, str] | None = None,
    ) -> None:
        global _warned_unconfigured
        self.vllm_config = vllm_config
        if isinstance(engine_indexes, int):  # per-engine base: vLLM passes (config, index)
            engine_index, engine_indexes = engine_indexes, None
        self.engine_indexes = list(engine_indexes) if engine_indexes else [engine_index]
        self.sender: CountsRelay | None = None
        self.running_cap: int | None = None  # the engines' cap, declared (running_cap_of)
        self.ids: dict[int, str] = {}
        self.warn = RateLimitedLog(log)
        self._lockstep_unstamped = False
        # requests each engine finished, from this process's start (its admitted total);
        # None where several API servers each see only their own requests finish
        self.finished: dict[int, int] | None = None
        try:
            cfg = PluginConfig.from_env(os.environ if env is None else env)
            if cfg is None:
                if not _warned_unconfigured:
                    _warned_unconfigured = True
                    log.warning(
                        "redisbal plugin loaded but not configured: set REDISBAL_REDIS_URL and "
                        "REDISBAL_DEPLOYMENT to report to redisbal; reporting nothing"
                    )
                return
            ids = {i: cfg.engine_id(i) for i in self.engine_indexes}
        except (PluginConfigError, InvalidName) as exc:
            log.warning("redisbal plugin disabled: %s", exc)
            return
        self.cfg = cfg
        if cfg.mode == "tick" and api_server_count(vllm_config) > 1:
            log.warning(
                "redisbal plugin: %d API servers: each step's counts reach one of them, and "
                "one that last saw an engine idle keeps re-sending that while another "
                "reports it busy, so snapshots may flip between the two; prefer one API "
                "server per DP rank, or `redisbal scrape` on /metrics",
                api_server_count(vllm_config),
            )
        # several API servers speak for the same engines: one incarnation between them
        servers = api_server_count(vllm_config)
        self.finished = dict.fromkeys(ids, 0) if servers == 1 else None
        self.sender = shared_sender(cfg, server_incarnation() if servers > 1 else None)
        # declared once per engine (redisbal.running_caps): routers know the engines'
        # room from their first report, before any queue formed
        self.running_cap = running_cap_of(vllm_config)
        for eid in ids.values():
            self.sender.add(eid, cfg.engine_url, self.running_cap)
        self.ids = ids
        announce_when_ready(self.sender, list(ids.values()), cfg.engine_url)
        log.info(
            "redisbal plugin: engines %s report to deployment %s (%s mode, running cap %s)",
            ", ".join(ids.values()),
            cfg.deployment,
            cfg.mode,
            self.running_cap or "not declared",
        )

    def record(
        self,
        scheduler_stats: Any,
        iteration_stats: Any,
        mm_cache_stats: Any = None,
        engine_idx: int = 0,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        """Called on vLLM's output loop once per engine step: store the counts, no I/O."""
        if self.sender is None:
            return
        eid = self.ids.get(engine_idx)
        if eid is None:
            return
        finished = self.finished
        if finished is not None and iteration_stats is not None:
            # (counted from records without scheduler stats too: they finish requests)
            done = getattr(iteration_stats, "finished_requests", None)
            if done:
                finished[engine_idx] += len(done)
        if scheduler_stats is None:
            return
        s = scheduler_stats
        waiting = int(s.num_waiting_reqs) + int(getattr(s, "num_skipped_waiting_reqs", 0) or 0)
        running = int(s.num_running_reqs)
        kv = float(getattr(s, "kv_cache_usage", 0.0) or 0.0)
        kv_usage = min(1.0, max(0.0, kv)) if math.isfinite(kv) else None
        step: int | None = None
        wave = 0
        if self.cfg.mode == "lockstep":
            step, wave = int(s.step_counter), int(s.current_wave)
            if step == 0 and wave == 0 and running and not self._lockstep_unstamped:
                self._lockstep_unstamped = True
                log.warning(
                    "redisbal plugin: REDISBAL_MODE=lockstep but this vLLM's stats carry no "
                    "step_counter (0 with requests running): reports will not advance the "
                    "barrier; use REDISBAL_MODE=tick"
                )
        total = None if finished is None else finished[engine_idx] + waiting + running
        try:
            counts = Counts(step, waiting, running, wave, kv_usage, admitted_total=total)
            self.sender.submit(eid, counts)
        except (InvalidReport, KeyError) as exc:
            self.warn.warning("bad", "redisbal plugin: not reporting engine %s: %s", eid, exc)

    def log_engine_initialized(self) -> None:
        pass

    def log(self) -> None:
        pass

    def record_sleep_state(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record_admission_rejection(self, reason: str) -> None:
        pass
