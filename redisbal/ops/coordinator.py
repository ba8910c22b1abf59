"""The coordinator: off the request path, keeps a deployment in order.

Every ``interval_s`` the lease holder:
- renews its lease (``lua/lease.lua``); a standby keeps trying and takes
  over when the lease expires, with a higher fence, so an old holder that
  comes back is refused by the scripts;
- writes the deployment config when it is missing or differs (after a Redis
  restart without persistence, or when it takes over), and registers the
  engines the config expects, so the first snapshot of every epoch waits for them;
- expires engines past ``dead_after_ms`` and republishes (``lua/reap.lua``),
  which also sends an idle heartbeat snapshot every ``idle_publish_ms``;
- force-publishes when the barrier has waited ``stall_ms`` (``lua/force.lua``);
- watches the server's identity (run_id, replication id): when it changes
  while the state survived (failover to a replica), it starts a new epoch so
  routers resynchronise instead of ignoring repeated versions;
- logs the deployment's health once per change (``HealthLog``): a barrier
  stalled on laggards, stalled and suspect engines, two processes under one
  engine id; not one line per forced snapshot.

Nothing here is needed for routing: engines' reports publish snapshots and
expire the dead by themselves; the coordinator adds the stall guard, idle
heartbeats, expected membership and metrics.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import redis.exceptions

from redisbal.barrier.operations import Scripts
from redisbal.barrier.snapshot import Snapshot
from redisbal.config import LEASE_TTL, CoordinatorConfig
from redisbal.connection import (
    OUTAGE_ERRORS,
    RedisClient,
    is_cluster,
    make_client,
    redact,
    refresh_slots,
)
from redisbal.keys import DeploymentKeys, check_name

log = logging.getLogger("redisbal.ops.coordinator")
HEALTH_EVERY_S = 0.5


class HealthLog:
    """What the coordinator logs about the deployment's health: each change once."""

    def __init__(self) -> None:
        self.laggards: frozenset[str] = frozenset()
        self.forced_since = 0  # forced snapshots since the barrier stalled
        self.excluded: dict[str, frozenset[str]] = {"stalled": frozenset(), "suspect": frozenset()}
        self.conflicts = 0
        self.conflicts_seen: set[tuple[str, str, str]] = set()  # (engine, refused, current)

    def snapshot(self, snap: Snapshot | None, forced_total: int, stall_ms: int) -> None:
        if snap is None:
            return
        laggards = frozenset(snap.laggards) if snap.forced else frozenset()
        if laggards != self.laggards:
            if laggards:
                log.warning(
                    "coordinator: barrier stalled on %s; forcing a snapshot every %d ms "
                    "until they report",
                    ", ".join(
                        f"{e} (last report {ms} ms ago)" for e, ms in sorted(snap.laggards.items())
                    ),
                    stall_ms,
                )
                self.forced_since = forced_total - 1  # (this snapshot was one)
            else:
                log.warning(
                    "coordinator: barrier complete again after %d forced snapshots",
                    forced_total - self.forced_since,
                )
            self.laggards = laggards
        marked = {*snap.suspect, *snap.probing}  # (suspect until a probe is answered)
        for kind, now in (("stalled", set(snap.stalled)), ("suspect", marked)):
            ids = frozenset(now)
            if ids == self.excluded[kind]:
                continue
            if ids - self.excluded[kind]:
                why = "work and no progress" if kind == "stalled" else "a router failed to reach it"
                log.warning(
                    "coordinator: %s now %s (%s): routers do not choose it",
                    ", ".join(sorted(ids - self.excluded[kind])),
                    kind,
                    why,
                )
            if self.excluded[kind] - ids:
                log.warning(
                    "coordinator: %s no longer %s",
                    ", ".join(sorted(self.excluded[kind] - ids)),
                    kind,
                )
            self.excluded[kind] = ids

    def conflict(self, meta: dict[str, str]) -> None:
        for key, value in meta.items():
            parts = value.split(" ")
            if not key.startswith("conflict:") or len(parts) != 3:
                continue
            engine, refused, current = key[len("conflict:") :], parts[1], parts[2]
            if (engine, refused, current) not in self.conflicts_seen:
                self.conflicts_seen.add((engine, refused, current))
                log.error(
                    "coordinator: two processes report as engine %s: incarnation %s "
                    "(started later) replaced %s, which still reports; give each engine "
                    "process its own engine id",
                    engine,
                    current,
                    refused,
                )


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


@dataclass
class CoordinatorStats:
    leader: bool = False
    fence: int = 0
    ticks: int = 0
    expired: int = 0
    forced: int = 0
    idle_published: int = 0
    epochs_started: int = 0
    errors: int = 0
    last_error: str = ""


class Coordinator:
    """One coordinator process for one deployment (run several: one leads)."""

    def __init__(
        self,
        redis_url: str | None,
        deployment: str,
        config: CoordinatorConfig | None = None,
        *,
        client: RedisClient | None = None,
        interval_s: float | None = None,
        lease_ttl_ms: int | None = None,
        coordinator_id: str | None = None,
        on_tick: Callable[[Coordinator], None] | None = None,
    ) -> None:
        self.keys = DeploymentKeys(check_name(deployment, "deployment"))
        self.config = config or CoordinatorConfig()
        if lease_ttl_ms is not None:  # overrides the config's
            self.config = replace(
                self.config, lease_ttl_ms=LEASE_TTL.check("lease_ttl_ms", lease_ttl_ms)
            )
        self.config.check()
        self.client = client or make_client(
            redis_url or "", socket_connect_timeout=1.0, socket_timeout=2.0
        )
        self.url = redact(redis_url or "")
        self.scripts = Scripts(
            self.client, self.keys, "SPUBLISH" if is_cluster(self.client) else "PUBLISH"
        )
        self.interval_s = interval_s or max(0.01, min(0.05, self.config.stall_ms / 4000))
        self.lease_ttl_ms = self.config.lease_ttl_ms
        self.id = check_name(
            coordinator_id
            or f"{socket.gethostname()[:40]}-{os.getpid()}-{secrets.token_hex(2)}".replace(
                "_", "-"
            ),
            "coordinator id",
        )
        self.stats = CoordinatorStats()
        self.on_tick = on_tick
        self._stop = threading.Event()
        self._epoch: str | None = None
        self._identity: tuple[str, str] | None = None
        self._identity_epoch = ""  # the epoch at the last identity check
        self._last_identity_check = 0.0
        self._last_config_check = 0.0
        self._last_health_check = 0.0
        self.health = HealthLog()
        self._said_standby = False  # the standby line is logged once, not every tick

    # -- one round --------------------------------------------------------------------------------

    def lease(self) -> bool:
        held, fence, owner, _left = self.scripts.call(
            "lease", self.id, self.lease_ttl_ms, "acquire"
        )
        was = self.stats.leader
        self.stats.leader, self.stats.fence = bool(int(held)), int(fence)
        if self.stats.leader and not was:
            log.info(
                "coordinator %s: took the lease of %s (fence %d)",
                self.id,
                self.keys.deployment,
                self.stats.fence,
            )
            self._last_config_check = 0.0
        elif was and not self.stats.leader:
            log.warning("coordinator %s: lost the lease to %s; standing by", self.id, _s(owner))
        elif not self.stats.leader and not self._said_standby:  # started as the standby
            log.info(
                "coordinator %s: standing by (%s holds the lease of %s)",
                self.id, _s(owner), self.keys.deployment,
            )  # fmt: skip
        self._said_standby = not self.stats.leader
        return self.stats.leader

    def ensure_config(self) -> None:
        """Write the config if it is missing or differs; re-register expected engines
        whenever the epoch changed (state lost)."""
        want = self.config.fields()
        have = {_s(k): _s(v) for k, v in self.client.hgetall(self.keys.config).items()}
        if any(have.get(k) != v for k, v in want.items()):
            changed = [k for k, v in want.items() if have.get(k) not in (None, v)]
            if changed:
                log.warning(
                    "coordinator %s: config of %s differed (%s); writing ours",
                    self.id,
                    self.keys.deployment,
                    ", ".join(changed),
                )
            args: list[str] = []
            for k, v in want.items():
                args += [k, v]
            self.scripts.call("configure", self._candidate(), *args)
        epoch = _s(self.client.get(self.keys.epoch) or "")
        if epoch != self._epoch:
            if self._epoch is not None:
                log.warning(
                    "coordinator %s: epoch changed %s -> %s (Redis state was reset)",
                    self.id,
                    self._epoch,
                    epoch,
                )
            self._epoch = epoch
            if self.config.expected:
                self.scripts.call("register", self._candidate(), *self.config.expected)

    def _candidate(self) -> str:
        """Epoch to create if the state is missing; "r-" once this coordinator has seen
        an epoch: the state was lost, so its first snapshot waits join_grace_ms."""
        return ("r-" if self._epoch is not None else "") + secrets.token_hex(8)

    def check_identity(self) -> None:
        """Start a new epoch when the server changed but the state survived (failover)."""
        info = self.client.info("server")
        repl = self.client.info("replication")
        ident = (_s(info.get("run_id", "")), _s(repl.get("master_replid", "")))
        current = _s(self.client.get(self.keys.epoch) or "")
        prev, self._identity = self._identity, ident
        seen, self._identity_epoch = self._identity_epoch, current
        if prev is None or prev == ident:
            return
        if not current or current != seen:
            # the state did not survive (a restart): whoever re-creates it starts the
            # new epoch; a second one would only make routers resync twice
            return
        epoch = self._candidate()  # the state survived a failover: versions may repeat
        self.scripts.call("new_epoch", epoch)
        self._epoch = epoch
        self.stats.epochs_started += 1
        log.warning(
            "coordinator %s: Redis server changed (run_id/replid); new epoch %s", self.id, epoch
        )

    def tick(self) -> None:
        """One round of housekeeping (only acts while holding the lease)."""
        self.stats.ticks += 1
        if not self.lease():
            return
        now = time.monotonic()
        if now - self._last_config_check >= 1.0:
            self._last_config_check = now
            self.ensure_config()
        if not is_cluster(self.client) and now - self._last_identity_check >= 1.0:
            self._last_identity_check = now
            self.check_identity()
        fence = str(self.stats.fence)
        out = self.scripts.call("reap", 1000, fence)
        expired = [_s(e) for e in out[1:]]
        if expired:
            self.stats.expired += len(expired)
            log.warning(
                "coordinator: engines expired (no report for %d ms): %s",
                self.config.dead_after_ms,
                ", ".join(expired),
            )
        elif int(out[0]):
            self.stats.idle_published += 1
        out = self.scripts.call("force", "", fence)
        if int(out[0]):
            self.stats.forced += 1
        if now - self._last_health_check >= HEALTH_EVERY_S:
            self._last_health_check = now
            self.watch_health()
        if self.on_tick is not None:
            self.on_tick(self)

    def watch_health(self) -> None:
        """Read the snapshot and the conflict counter; log what changed (HealthLog)."""
        pipe = self.client.pipeline(transaction=False)
        pipe.get(self.keys.snapshot)
        pipe.hget(self.keys.meta, "conflicts")
        raw, conflicts = pipe.execute()
        with contextlib.suppress(ValueError, KeyError, TypeError):  # unreadable: skip
            snap = Snapshot.from_json(raw) if raw else None
            self.health.snapshot(snap, self.stats.forced, self.config.stall_ms)
        if int(conflicts or 0) > self.health.conflicts:
            self.health.conflicts = int(conflicts)
            meta = self.client.hgetall(self.keys.meta)
            self.health.conflict({_s(k): _s(v) for k, v in meta.items()})

    # -- loop -------------------------------------------------------------------------------------

    def run(self, duration_s: float | None = None) -> None:
        """Run until stop() (or SIGINT/SIGTERM via the CLI), or for duration_s."""
        end = None if duration_s is None else time.monotonic() + duration_s
        log.info("coordinator %s for deployment %s on %s", self.id, self.keys.deployment, self.url)
        backoff = self.interval_s
        while not self._stop.is_set() and (end is None or time.monotonic() < end):
            try:
                self.tick()
                backoff = self.interval_s
            except OUTAGE_ERRORS as exc:
                self._error(f"Redis unavailable: {type(exc).__name__}")
                self.stats.leader = False
                backoff = min(backoff * 2, 1.0)
                with contextlib.suppress(Exception):  # a cluster: find a promoted replica
                    refresh_slots(self.client)
            except redis.exceptions.ResponseError as exc:
                if "fenced" in str(exc):
                    self.stats.leader = False
                self._error(f"Redis refused: {redact(str(exc))}")
            self._stop.wait(backoff)
        self.release()

    def _error(self, msg: str) -> None:
        self.stats.errors += 1
        if msg != self.stats.last_error:
            log.warning("coordinator %s: %s", self.id, msg)
        self.stats.last_error = msg

    def stop(self) -> None:
        self._stop.set()

    def release(self) -> None:
        """Give the lease up so that a standby takes over at once."""
        if not self.stats.leader:
            return
        try:
            self.scripts.call("lease", self.id, self.lease_ttl_ms, "release")
            log.info("coordinator %s: released the lease", self.id)
        except redis.exceptions.RedisError:
            pass
        self.stats.leader = False
