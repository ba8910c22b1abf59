"""The snapshot: a consistent cut of every engine's counts at one (wave, step).

Published by the Lua barrier as JSON (built in Lua, parsed here with orjson).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import orjson

# admitted counts the reporters send are below this; the Lua script checks that an
# admitted list is JSON integers but not their length (docs/DESIGN.md), so routers
# read a list whose sum reaches it, which only another client can send, as not reported
MAX_ADMITTED = 10**15


class EngineCounts(NamedTuple):
    """One engine's counts in a snapshot: its newest report at or before the cut.

    A NamedTuple, not a frozen dataclass: every router builds one per engine per
    snapshot, and a tuple is built several times faster (immutable all the same).
    """

    waiting: int
    running: int
    kv_usage: float | None
    wave: int
    step: int
    reported_ms: int
    # cumulative requests received from each API-server index (None: not reported)
    admitted: tuple[int, ...] | None = None
    # the reporting process (None: the report named none); a new one is a restart
    incarnation: str | None = None

    @property
    def load(self) -> int:
        return self.waiting + self.running


@dataclass(frozen=True, slots=True)
class Snapshot:
    deployment: str
    epoch: str
    version: int
    wave: int
    step: int
    forced: bool
    laggards: dict[str, int]  # engine -> age (ms) of its last report, forced only
    gone: dict[str, str]  # engines removed since the previous snapshot -> "expired"/"left"
    joining: tuple[str, ...]  # joined ahead of this cut: in the next snapshot
    time_ms: int  # Redis server time at publication
    engines: dict[str, EngineCounts] = field(default_factory=dict)
    raw: bytes = b""
    # not to be routed to: engines with work and no progress -> ms since their last
    # progress; engines a router could not reach (failed()) -> ms the mark has left
    stalled: dict[str, int] = field(default_factory=dict)
    suspect: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: bytes | str) -> Snapshot:
        raw = data.encode() if isinstance(data, str) else bytes(data)
        d: dict[str, Any] = orjson.loads(raw)
        # tuple.__new__ builds the NamedTuple without its Python-level __new__ (about
        # 8 of the 47 us this parse took for 32 engines; scripts/bench_core.py)
        new, cls_ = tuple.__new__, EngineCounts
        engines: dict[str, EngineCounts] = {
            e: new(
                cls_,
                (
                    c["waiting"],
                    c["running"],
                    c["kv"],
                    c["wave"],
                    c["step"],
                    c["t"],
                    tuple(adm) if (adm := c.get("adm")) is not None else None,
                    c.get("inc"),
                ),
            )
            for e, c in d["engines"].items()
        }
        return cls(
            deployment=d["deployment"],
            epoch=d["epoch"],
            version=d["version"],
            wave=d["wave"],
            step=d["step"],
            forced=d["forced"],
            laggards=d["laggards"],
            gone=d["gone"],
            joining=tuple(d["joining"]),
            time_ms=d["time_ms"],
            engines=engines,
            raw=raw,
            stalled=d.get("stalled", {}),
            suspect=d.get("suspect", {}),
        )

    @property
    def cut(self) -> tuple[int, int]:
        return (self.wave, self.step)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = orjson.loads(self.raw) if self.raw else {}
        return out
