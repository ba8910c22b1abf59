"""The snapshot: a consistent cut of every engine's counts at one (wave, step).

Published by the Lua barrier as JSON (built in Lua, parsed here with orjson), in
one of two forms (docs/DESIGN.md, "Snapshot format" and "Compact form"): full, an object per
engine; or compact, for large deployments, four numbers per engine in the order
of a roster of engine ids that the channel message carries only when it
changes. A reader of compact messages keeps the rosters it saw (``Rosters``)
and reads the stored snapshot, which always has its roster, when a message
names one it has not seen (``RosterUnknown``).

``Snapshot.from_json`` is the one place a snapshot is decoded, and it checks every
field any reader uses (type and range) before it hands out a Snapshot: anything
else may publish on the channel (another client, another version), and a field of
the wrong type let through would fail later, in whichever routing path met it
first. A snapshot that fails a check is ``MalformedData``, never a partial one.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, NamedTuple

import orjson

from redisbal.errors import InvalidArgument, MalformedData
from redisbal.errors import RosterUnknown as RosterUnknown
from redisbal.keys import NAME_RE, NAME_RULE

# admitted counts the reporters send are below this; the Lua script checks that an
# admitted list is JSON integers but not their length (docs/DESIGN.md), so routers
# read a list whose sum reaches it, which only another client can send, as not reported
MAX_ADMITTED = 10**15
MAX_TOTAL = MAX_ADMITTED - 1  # an engine's admitted total (lua/includes/args.lua)
MAX_COUNT = 1_000_000_000  # waiting and running are in 0..MAX_COUNT (lua/includes/args.lua)


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
        _check_ids(ids, "ids")
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


_NONE = type(None)
_INT = frozenset({int})
_NUMBER = frozenset({int, float})
_KV = frozenset({int, float, _NONE})
_ANY_MS = 2**63 - 1  # times and ages: whole ms >= 0


def _whole(hi: int) -> Callable[[Any], bool]:
    """The check of one value: a whole number in 0..hi (a bool is none)."""
    return lambda v: type(v) is int and 0 <= v <= hi


def _optional(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    """``check``, or None (null, or absent: not reported)."""
    return lambda v: v is None or check(v)


def _admitted(v: Any) -> bool:
    """An admitted list: JSON integers >= 0. orjson reads one past 64 bits as a float,
    which is past MAX_ADMITTED: the list then reads as not reported (as one whose sum
    reaches it: routing.adoption), never refused, since the Lua script lets it through."""
    return type(v) is tuple and all(
        (type(x) is int and x >= 0) or (type(x) is float and x >= MAX_ADMITTED) for x in v
    )


_COUNT = "a whole number in 0..10^9"
# each field of an engine's counts, in EngineCounts order: its JSON name, what it must
# be, and the check of one value. Every reader of a snapshot relies on these; the
# checks of whole columns (_engines_ok, _compact_ok) are their fast equivalent.
_ENGINE_FIELDS: tuple[tuple[str, str, Callable[[Any], bool]], ...] = (
    ("waiting", _COUNT, _whole(MAX_COUNT)),
    ("running", _COUNT, _whole(MAX_COUNT)),
    ("kv", "a number in [0, 1] or null", lambda v: v is None or _kv_ok([v])),
    ("wave", "a whole number >= 0", _whole(_ANY_MS)),
    ("step", "a whole number >= 0", _whole(_ANY_MS)),
    ("t", "a whole number of ms >= 0", _whole(_ANY_MS)),
    ("adm", "a list of whole numbers >= 0, or absent", _optional(_admitted)),
    ("inc", "a text, or absent", _optional(lambda v: type(v) is str)),
    ("tot", f"a whole number in 0..{MAX_TOTAL}, or absent", _optional(_whole(MAX_TOTAL))),
)
# the compact form's four numbers per engine
_COMPACT_FIELDS = (*_ENGINE_FIELDS[:3], ("age", "a whole number of ms >= 0", _whole(_ANY_MS)))


def _kv_ok(kv: list[Any]) -> bool:
    """KV-cache usages, none null: numbers in [0, 1] (JSON has no NaN or infinity)."""
    return not kv or (set(map(type, kv)) <= _NUMBER and min(kv) >= 0 and max(kv) <= 1)


def _ints_ok(counts: list[Any], others: list[Any]) -> bool:
    """``counts`` whole numbers in 0..MAX_COUNT, ``others`` (times, waves, steps) >= 0."""
    both = counts + others
    return not both or (
        set(map(type, both)) == _INT and min(both) >= 0 and max(counts, default=0) <= MAX_COUNT
    )


def _engines_ok(rows: Collection[EngineCounts]) -> bool:
    """Whether every field of every engine passes its check (``_ENGINE_FIELDS``), a
    column at a time: the checks run in C over whole columns, several times faster than
    the checks of each value (a router parses every snapshot)."""
    if not rows:
        return True
    w, r, kv, wave, step, t, adm, inc, tot = map(list, zip(*rows, strict=True))
    if not _ints_ok(w + r, wave + step + t):
        return False
    if not set(map(type, inc)) <= {str, _NONE} or not set(map(type, tot)) <= {int, _NONE}:
        return False
    totals = list(filter(None, tot))  # (filter(None) drops 0 too: in every range)
    if totals and (min(totals) < 0 or max(totals) > MAX_TOTAL):
        return False
    if not set(map(type, kv)) <= _KV or not _kv_ok(list(filter(None, kv))):
        return False
    if not set(map(type, adm)) <= {tuple, _NONE}:
        return False
    flat = list(chain.from_iterable(filter(None, adm)))
    if not flat or (set(map(type, flat)) == _INT and min(flat) >= 0):
        return True
    return all(map(_admitted, filter(None, adm)))  # (a float in one: the slow way)


def _compact_ok(counts: list[Any]) -> bool:
    """``_engines_ok`` of the compact form's counts (4 per engine)."""
    kv = counts[2::4]
    if not set(map(type, kv)) <= _KV or not _kv_ok(list(filter(None, kv))):
        return False
    return _ints_ok(counts[0::4] + counts[1::4], counts[3::4])


def _first_bad(
    rows: Collection[tuple[Any, ...]],
    ids: Iterator[str],
    fields: tuple[tuple[str, str, Callable[[Any], bool]], ...],
) -> MalformedData:
    """The error naming the first engine (of ``ids``, in the order of ``rows``) and field
    whose value fails its check (``fields``, one per column of ``rows``)."""
    for eid, row in zip(ids, rows, strict=True):
        for (name, rule, ok), value in zip(fields, row, strict=True):
            if not ok(value):
                return MalformedData(
                    f"snapshot: engine {eid!r:.40}: {name} must be {rule}, got {value!r:.40}"
                )
    return MalformedData("snapshot: malformed engine counts")  # (the checks disagree: a bug)


# engine ids seen to be names (``_check_ids``): checking each again costs more than
# the set lookup, and a deployment's ids repeat in every snapshot
_NAMES_SEEN: set[str] = set()


def _check_ids(ids: Collection[Any], where: str) -> None:
    """MalformedData unless every one of ``ids`` is an engine id (keys.NAME_RE)."""
    if set(map(type, ids)) <= {str} and _NAMES_SEEN.issuperset(ids):
        return
    for i in ids:
        if type(i) is not str or not NAME_RE.fullmatch(i):
            raise MalformedData(f"snapshot: {where}: {i!r:.40} is not an engine id ({NAME_RULE})")
    if len(_NAMES_SEEN) > 100_000:  # (ids of deployments come and go: bounded)
        _NAMES_SEEN.clear()
    _NAMES_SEEN.update(ids)


def _header(d: dict[str, Any]) -> dict[str, Any]:
    """The fields both forms share, as Snapshot's keyword arguments; MalformedData when
    one has the wrong type or range: a router must refuse such a message before adopting
    any of it (another client, or another version, may publish on the channel)."""
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
        v = h[name]
        if type(v) is not int or v < 0:
            raise MalformedData(f"snapshot: {name} must be a whole number >= 0, got {v!r:.40}")
    if not (type(h["deployment"]) is str and type(h["epoch"]) is str):
        raise MalformedData("snapshot: deployment and epoch must be texts")
    if type(h["forced"]) is not bool:
        raise MalformedData(f"snapshot: forced must be true or false, got {h['forced']!r:.40}")
    # (ms since a report or progress come from the server's clock, which may go back:
    # any whole number; a suspect mark's ms left is > 0 as published, but only its
    # presence counts)
    for name, kind in (("laggards", int), ("stalled", int), ("suspect", int), ("gone", str)):
        m = h[name]
        if type(m) is not dict or not all(type(v) is kind for v in m.values()):
            raise MalformedData(f"snapshot: {name} must map engines to {kind.__name__}s")
        _check_ids(m, name)
    for name in ("joining", "probing"):
        ids = h[name]
        if type(ids) is not list:
            raise MalformedData(f"snapshot: {name} must be a list of engine ids")
        _check_ids(ids, name)
        h[name] = tuple(ids)
    return h


def _full_engines(src: Any) -> dict[str, EngineCounts]:
    """The full form's "engines", every field checked (``_ENGINE_FIELDS``)."""
    if type(src) is not dict or not set(map(type, src.values())) <= {dict}:
        raise MalformedData("snapshot: engines must map engine ids to objects of counts")
    _check_ids(src, "engines")
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
                # (anything else than a list or null is refused by its check)
                tuple(adm) if type(adm := c.get("adm")) is list else adm,
                c.get("inc"),
                c.get("tot"),
            ),
        )
        for e, c in src.items()
    }
    if not _engines_ok(engines.values()):
        raise _first_bad(engines.values(), iter(engines), _ENGINE_FIELDS)
    return engines


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
        """Parse a published snapshot, every field checked (MalformedData, one line,
        when one is missing or of the wrong type or range). A compact one without its
        roster takes it from ``rosters`` (RosterUnknown when not there); one with it
        adds it there."""
        raw = data.encode() if isinstance(data, str) else bytes(data)
        try:
            d = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise MalformedData(f"snapshot: not JSON ({exc})") from None
        if type(d) is not dict:
            raise MalformedData(f"snapshot: not a JSON object: {raw[:40]!r}")
        try:
            if "counts" in d:
                return cls._compact(d, raw, rosters)
            header = _header(d)
            return cls(**header, engines=_full_engines(d["engines"]), raw=raw)
        except KeyError as exc:
            raise MalformedData(f"snapshot: no field {exc}") from None
        except TypeError as exc:  # (a shape no check foresaw: still refused, never raised)
            raise MalformedData(f"snapshot: a field of the wrong shape ({exc})") from None

    @classmethod
    def _compact(cls, d: dict[str, Any], raw: bytes, rosters: Rosters | None) -> Snapshot:
        header = _header(d)
        epoch, version = header["epoch"], d["roster"]
        if type(version) is not int or version < 1:
            raise MalformedData(f"compact snapshot: bad roster version {version!r:.40}")
        carried = "ids" in d  # (else the roster is one seen before)
        if carried:
            roster = Roster.from_json(d["ids"], d["incs"])
        else:
            seen = rosters.get(epoch, version) if rosters is not None else None
            if seen is None:
                raise RosterUnknown(f"roster {version} of epoch {epoch} not seen yet")
            roster = seen
        counts = d["counts"]
        n = len(roster.ids)
        if type(counts) is not list or len(counts) != 4 * n:
            raise MalformedData(
                f"compact snapshot: counts must be 4 numbers for each of {n} engines"
            )
        if not _compact_ok(counts):
            rows = list(zip(*(counts[i::4] for i in range(4)), strict=True))
            raise _first_bad(rows, iter(roster.ids), _COMPACT_FIELDS)
        if carried and rosters is not None:  # (a roster of a refused message is not kept)
            rosters.add(epoch, version, roster)
        engines = CompactEngines(roster, counts, header["wave"], header["step"], header["time_ms"])
        return cls(**header, engines=engines, raw=raw, roster_version=version, roster=roster)

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
