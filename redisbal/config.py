"""Coordinator settings: their defaults and bounds, in one place.

The operator CLI builds its ``redisbal coordinator`` options from ``SETTINGS``
and ``LEASE_TTL``, ``CoordinatorConfig`` checks every value against them, and
the coordinator writes the deployment settings into the config hash, where the
Lua scripts read them. Every setting is a whole number of its unit: milliseconds,
or engines (``compact_from``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from redisbal.errors import InvalidArgument
from redisbal.keys import check_name


@dataclass(frozen=True)
class Setting:
    """One setting: default, inclusive bounds, the line the CLI shows, and its unit
    (what its error message and --help name)."""

    default: int
    lo: int
    hi: int
    help: str
    unit: str = "ms"

    def check(self, name: str, value: object) -> int:
        """``value`` if it is a whole number in bounds, else ValueError naming ``name``."""
        if isinstance(value, bool) or not isinstance(value, int) or not self.lo <= value <= self.hi:
            raise InvalidArgument(
                f"{name} must be a whole number of {self.unit} in {self.lo}..{self.hi}, "
                f"got {value!r}"
            )
        return value


# The deployment settings (written into the config hash), in the CLI's order.
SETTINGS: dict[str, Setting] = {
    "dead_after_ms": Setting(
        5000, 100, 86_400_000, "Expire an engine with no report for this long."
    ),
    "stall_ms": Setting(250, 1, 86_400_000, "Force a snapshot when the barrier waited this long."),
    "tick_ms": Setting(20, 1, 60_000, "Shared tick of independent (tick-mode) engines."),
    "join_grace_ms": Setting(1000, 0, 600_000, "The first snapshot of an epoch waits this long."),
    "idle_publish_ms": Setting(1000, 10, 3_600_000, "Republish a quiet deployment this often."),
    "stall_after_ms": Setting(
        2000, 100, 86_400_000, "An engine with work and no progress this long is stalled."
    ),
    "suspect_ms": Setting(
        1000,
        100,
        600_000,
        "The longest ejection back-off of an engine requests failed on (failed()); the "
        "first is an eighth of it, doubling while its probes fail.",
    ),
    "compact_from": Setting(
        256,
        0,
        1_000_000,
        "Publish compact snapshots (positional counts, ids only when they change, no "
        "admitted lists) once the deployment has this many engines with counts; 0: always.",
        unit="engines",
    ),
}
# The coordinator's own lease (not a deployment setting: each coordinator passes it to
# the lease script). The floor leaves a standby time to see a live holder renew.
LEASE_TTL = Setting(2000, 200, 600_000, "Coordinator lease TTL (a standby takes over after).")


@dataclass
class CoordinatorConfig:
    """Deployment settings the coordinator owns (in their units), and its lease TTL."""

    dead_after_ms: int = SETTINGS["dead_after_ms"].default
    stall_ms: int = SETTINGS["stall_ms"].default
    tick_ms: int = SETTINGS["tick_ms"].default
    join_grace_ms: int = SETTINGS["join_grace_ms"].default
    idle_publish_ms: int = SETTINGS["idle_publish_ms"].default
    stall_after_ms: int = SETTINGS["stall_after_ms"].default
    suspect_ms: int = SETTINGS["suspect_ms"].default
    compact_from: int = SETTINGS["compact_from"].default
    expected: list[str] = field(default_factory=list)
    lease_ttl_ms: int = LEASE_TTL.default

    def check(self) -> None:
        """Raise ValueError naming the first bad setting."""
        for name, setting in SETTINGS.items():
            setting.check(name, getattr(self, name))
        LEASE_TTL.check("lease_ttl_ms", self.lease_ttl_ms)
        if self.stall_ms >= self.dead_after_ms:
            raise InvalidArgument(
                f"stall_ms ({self.stall_ms}) must be below dead_after_ms "
                f"({self.dead_after_ms}): a stalled barrier is forced before an "
                "engine is declared dead"
            )
        if not isinstance(self.expected, list | tuple):
            raise InvalidArgument(
                f"expected must be a list of engine ids, got {type(self.expected).__name__}: "
                f"{self.expected!r}"
            )
        for e in self.expected:
            check_name(e, "expected engine id")
        if len(set(self.expected)) != len(self.expected):
            raise InvalidArgument("expected engine ids must be unique")

    def fields(self) -> dict[str, str]:
        """The config hash's fields (the lease TTL is not one: see LEASE_TTL)."""
        out = {name: str(getattr(self, name)) for name in SETTINGS}
        out["expected"] = ",".join(self.expected)
        return out
