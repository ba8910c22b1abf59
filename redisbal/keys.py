"""Every Redis key and channel of a deployment, and the name checks that guard them.

All keys of one deployment share the hash tag ``{<deployment>}`` so that they
live in one Redis Cluster slot: the Lua scripts touch several of them at once,
and a script may only touch keys of one slot. No key is ever built from a name
that has not passed :func:`check_name` first.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from redisbal.errors import InvalidName as InvalidName

PREFIX = "redisbal"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")
NAME_RULE = "1-64 characters from A-Z a-z 0-9 _ . -, starting with a letter or digit"


# The barrier's hot fields, kept in the reports hash next to the engine records so
# that a report is one read and one write (lua/includes/deployment.lua; docs/DESIGN.md).
# An engine id starts with a letter or digit, so these never clash with one.
BARRIER_FIELDS = (
    ".epoch",
    ".pub",
    ".behind",
    ".since",
    ".next_reap",
    ".pub_at",
    ".rebase",
    ".rebase_ms",
    ".roster",
)


def is_engine_field(name: str) -> bool:
    """Whether a field of the reports hash is an engine's record (not a barrier field)."""
    return not name.startswith(".")


def check_name(value: object, what: str) -> str:
    """Return ``value`` if it is a valid deployment/engine name, else raise InvalidName.

    Braces would break the hash tag, spaces and control characters make keys
    unreadable in redis-cli, and an unbounded length makes every key unbounded.
    """
    if not isinstance(value, str):
        raise InvalidName(f"{what} must be a string, got {type(value).__name__}: {value!r}")
    if not NAME_RE.fullmatch(value):  # match() would let a trailing "\n" through ($)
        raise InvalidName(f"invalid {what} {value!r}: use {NAME_RULE}")
    return value


@dataclass(frozen=True)
class DeploymentKeys:
    """Names of all keys and the snapshot channel of one deployment."""

    deployment: str

    def __post_init__(self) -> None:
        check_name(self.deployment, "deployment")

    def key(self, suffix: str) -> str:
        return f"{PREFIX}:{{{self.deployment}}}:{suffix}"

    @property
    def config(self) -> str:
        """HASH: settings written by the coordinator (dead_after_ms, stall_ms, ...) and
        the coordinator lease (lease_owner, lease_until_ms, fence: lua/lease.lua)."""
        return self.key("config")

    @property
    def epoch(self) -> str:
        """STRING: id of the current state generation; a new one means state was lost."""
        return self.key("epoch")

    @property
    def members(self) -> str:
        """ZSET engine -> server time (ms) of its last report: liveness."""
        return self.key("members")

    @property
    def reports(self) -> str:
        """HASH engine -> its record: barrier flag, heartbeat, recent reports; plus the
        barrier's fields ``BARRIER_FIELDS`` (lua/includes/record.lua, docs/DESIGN.md)."""
        return self.key("reports")

    @property
    def meta(self) -> str:
        """HASH: epoch, published step, barrier count, version, counters."""
        return self.key("meta")

    @property
    def snapshot(self) -> str:
        """STRING: the latest published snapshot (JSON)."""
        return self.key("snapshot")

    @property
    def channel(self) -> str:
        """Pub/sub channel on which every snapshot is published."""
        return self.key("snapshots")

    @property
    def routes(self) -> str:
        """Pub/sub channel on which routers tell each other their routes
        (redisbal.routing.told_routes)."""
        return self.key("routes")

    @property
    def urls(self) -> str:
        """HASH engine -> its HTTP base URL (gateways discover engines from it)."""
        return self.key("urls")

    @property
    def running_caps(self) -> str:
        """HASH engine -> the running cap it declared (how many requests it runs at once:
        vLLM's max_num_seqs, SGLang's max_running_requests), written when it attaches
        (redisbal.running_caps; docs/DESIGN.md)."""
        return self.key("running_caps")

    @property
    def clients(self) -> str:
        """ZSET "<index>:<token>" -> lease expiry (server ms): auto client indexes."""
        return self.key("clients")

    @property
    def kv_changes(self) -> str:
        """STREAM: every change to the engines' cache views, in order (engine, anchors
        added and removed, cleared, dropped), trimmed by age (routing/cache_sync.py)."""
        return self.key("kv:changes")

    @property
    def kv_engines(self) -> str:
        """ZSET engine -> when its cache view expires (ms): the engines that have one."""
        return self.key("kv:engines")

    def kv_view(self, engine_id: str) -> str:
        """SET: one engine's anchors, 8 bytes each (routing/cache_view.py); it expires
        with the engine's entry in ``kv_engines`` unless its subscriber refreshes it."""
        return self.key(f"kv:view:{check_name(engine_id, 'engine_id')}")

    def script_keys(self) -> list[str]:
        """KEYS of the barrier scripts, in the order their headers list them."""
        return [
            self.config,
            self.epoch,
            self.members,
            self.reports,
            self.meta,
            self.snapshot,
            self.channel,
        ]

    def all_keys(self) -> list[str]:
        """Every key the deployment may own (for cleanup and tests), but the per-engine
        cache views (``kv_view``), which expire on their own."""
        return [
            *self.script_keys()[:-1],
            self.urls,
            self.running_caps,
            self.clients,
            self.kv_changes,
            self.kv_engines,
        ]
