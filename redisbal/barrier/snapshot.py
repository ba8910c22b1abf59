"""The snapshot: a consistent cut of every engine's counts at one (wave, step).

Published by the Lua barrier as JSON (built in Lua, parsed here with orjson), in
one of two forms (docs/DESIGN.md, "Snapshot format" and "Compact form"): full, an object per
engine; or compact, for large deployments, four numbers per engine in the order
of a roster of engine ids that the channel message carries only when it
changes. A reader of compact messages keeps the rosters it saw (``Rosters``)
and reads the stored snapshot, which always has its roster, when a message
names one it has not seen (``RosterUnknown``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import orjson

from redisbal.errors import InvalidArgument, MalformedData
from redisbal.errors import RosterUnknown as RosterUnknown

# admitted counts the reporters send are below this; the Lua script checks that an
# admitted list is JSON integers but not their length (docs/DESIGN.md), so routers
# read a list whose sum reaches it, which only another client can send, as not reported
MAX_ADMITTED = 10**15
MAX_TOTAL = MAX_ADMITTED - 1  # an engine's admitted total (lua/includes/args.lua)


def check_total(value: object, error: type[ValueError] = InvalidArgument) -> int:
    """``value`` as an admitted total: a whole number in 0..MAX_TOTAL, else a clear
    one-line ``error`` (the boundary check of a report's field, as the Lua script's)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise error(f"admitted_total must be a whole number, got {value!r}")
    if not 0 <= value <= MAX_TOTAL:
        raise error(f"admitted_total must be in 0..{MAX_TOTAL}, got {value}")
    return value


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
    # requests the engine has taken in since its process began, finished + waiting +
    # running (None: not reported): what engines without per-router counts can say
    admitted_total: int | None = None

    @property
    def load(self) -> int:
        return self.waiting + self.running


class Roster:
    """The engines of compact snapshots, in the order of their counts: ids, their
    incarnations (None: unnamed), and each id's position."""

    __slots__ = ("ids", "incs", "index")

    def __init__(self, ids: tuple[str, ...], incs: tuple[str | None, ...]) -> None:
        self.ids, self.incs = ids, incs
        self.index = {e: i for i, e in enumerate(ids)}

    @classmethod
    def from_json(cls, ids: Any, incs: Any) -> Roster:
        """From a snapshot's "ids" and "incs" ("-": no incarnation); ValueError if
        they are not two lists of texts of one length."""
        if (
            not isinstance(ids, list)
            or not isinstance(incs, list)
            or len(ids) != len(incs)
            or not all(isinstance(x, str) for x in ids)
            or not all(isinstance(x, str) for x in incs)
        ):
            raise MalformedData(
                "compact snapshot: ids and incs must be lists of texts of one length"
            )
        if len(set(ids)) != len(ids):
            raise MalformedData("compact snapshot: an engine id appears twice in ids")
        return cls(tuple(ids), tuple(None if i == "-" else i for i in incs))


class Rosters:
    """The rosters a reader of compact snapshots has seen, by (epoch, roster
    version): the last few, enough for messages that arrive out of order."""

    def __init__(self, keep: int = 4) -> None:
        self._keep = keep
        self._seen: dict[tuple[str, int], Roster] = {}

    def get(self, epoch: str, version: int) -> Roster | None:
        return self._seen.get((epoch, version))

    def add(self, epoch: str, version: int, roster: Roster) -> None:
        self._seen[(epoch, version)] = roster
        while len(self._seen) > self._keep:
            del self._seen[next(iter(self._seen))]


class CompactEngines(Mapping[str, EngineCounts]):
    """A compact snapshot's engines as a mapping like the full form's, each entry
    built when read: a router adopts the counts in place (``RouterCore``) and only
    other readers (status, metrics) pay for the entries. An engine's wave and step
    are the snapshot's, its admitted counts and total None (the compact form carries
    none of them)."""

    __slots__ = ("counts", "roster", "step", "time_ms", "wave")

    def __init__(self, roster: Roster, counts: list[Any], wave: int, step: int, time_ms: int):
        self.roster, self.counts = roster, counts
        self.wave, self.step, self.time_ms = wave, step, time_ms

    def __getitem__(self, engine_id: str) -> EngineCounts:
        i = self.roster.index[engine_id]
        w, r, kv, age = self.counts[4 * i : 4 * i + 4]
        inc = self.roster.incs[i]
        return EngineCounts(w, r, kv, self.wave, self.step, self.time_ms - age, None, inc)

    def __contains__(self, engine_id: object) -> bool:
        return engine_id in self.roster.index

    def __iter__(self) -> Iterator[str]:
        return iter(self.roster.ids)

    def __len__(self) -> int:
        return len(self.roster.ids)


def _header(d: dict[str, Any]) -> dict[str, Any]:
    """The fields both forms share, as Snapshot's keyword arguments; ValueError when one
    has the wrong type: a router must refuse such a message before adopting any of it
    (another client, or another version, may publish on the channel)."""
    h = {
        "deployment": d["deployment"],
        "epoch": d["epoch"],
        "version": d["version"],
        "wave": d["wave"],
        "step": d["step"],
        "forced": d["forced"],
        "laggards": d["laggards"],
        "gone": d["gone"],
        "joining": d["joining"],
        "time_ms": d["time_ms"],
        "stalled": d.get("stalled", {}),
        "suspect": d.get("suspect", {}),
        "probing": d.get("probing", []),
    }
    for name in ("version", "wave", "step", "time_ms"):
        if type(h[name]) is not int:
            raise MalformedData(f"snapshot: {name} must be an integer, got {h[name]!r:.40}")
    if not (isinstance(h["deployment"], str) and isinstance(h["epoch"], str)):
        raise MalformedData("snapshot: deployment and epoch must be texts")
    for name, kind in (("laggards", int), ("stalled", int), ("suspect", int), ("gone", str)):
        m = h[name]
        if not isinstance(m, dict) or not all(type(v) is kind for v in m.values()):
            raise MalformedData(f"snapshot: {name} must map engines to {kind.__name__}s")
    for name in ("joining", "probing"):
        ids = h[name]
        if not isinstance(ids, list) or not all(isinstance(e, str) for e in ids):
            raise MalformedData(f"snapshot: {name} must be a list of engine ids")
        h[name] = tuple(ids)
    return h


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
    engines: Mapping[str, EngineCounts] = field(default_factory=dict)
    raw: bytes = b""
    # not to be routed to: engines with work and no progress -> ms since their last
    # progress; engines a router could not reach (failed()) -> ms the mark has left
    stalled: dict[str, int] = field(default_factory=dict)
    suspect: dict[str, int] = field(default_factory=dict)
    probing: tuple[str, ...] = ()  # ejection over, not cleared: one request at a time
    # compact form only: the version of its roster (0: full form), and the roster
    roster_version: int = 0
    roster: Roster | None = None

    @classmethod
    def from_json(cls, data: bytes | str, rosters: Rosters | None = None) -> Snapshot:
        """Parse a published snapshot. A compact one without its roster takes it from
        ``rosters`` (RosterUnknown when not there); one with it adds it there."""
        raw = data.encode() if isinstance(data, str) else bytes(data)
        d: dict[str, Any] = orjson.loads(raw)
        if "counts" in d:
            return cls._compact(d, raw, rosters)
        # tuple.__new__ builds the NamedTuple without its Python-level __new__ (about
        # 8 of the 47 us this parse took for 32 engines; scripts/redis_cost.py core)
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
                    c.get("tot"),
                ),
            )
            for e, c in d["engines"].items()
        }
        return cls(**_header(d), engines=engines, raw=raw)

    @classmethod
    def _compact(cls, d: dict[str, Any], raw: bytes, rosters: Rosters | None) -> Snapshot:
        epoch, version = d["epoch"], d["roster"]
        if type(version) is not int or version < 1:
            raise MalformedData(f"compact snapshot: bad roster version {version!r}")
        if "ids" in d:
            roster = Roster.from_json(d["ids"], d["incs"])
            if rosters is not None:
                rosters.add(epoch, version, roster)
        else:
            found = rosters.get(epoch, version) if rosters is not None else None
            if found is None:
                raise RosterUnknown(f"roster {version} of epoch {epoch} not seen yet")
            roster = found
        counts = d["counts"]
        # (the numbers are the Lua script's, as the full form's are: only the shape is checked)
        if not isinstance(counts, list) or len(counts) != 4 * len(roster.ids):
            raise MalformedData(
                f"compact snapshot: counts must be 4 numbers for each of {len(roster.ids)} engines"
            )
        engines = CompactEngines(roster, counts, d["wave"], d["step"], d["time_ms"])
        return cls(**_header(d), engines=engines, raw=raw, roster_version=version, roster=roster)

    @property
    def counts(self) -> list[Any]:
        """A compact snapshot's counts: waiting, running, kv, age ms per engine, in
        roster order ([] for the full form)."""
        engines = self.engines
        return engines.counts if isinstance(engines, CompactEngines) else []

    @property
    def cut(self) -> tuple[int, int]:
        return (self.wave, self.step)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = orjson.loads(self.raw) if self.raw else {}
        return out
