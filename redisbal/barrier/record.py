"""An engine's record, the value of its field in the reports hash: parse and format.

The Lua side is ``lua/includes/record.lua``; this module and that file are the
only two that know the format (docs/DESIGN.md)::

    <flag><heartbeat due ms> <incarnation> <offset> <progress ms> <suspect until ms>
    <score>\\t<report ms>\\t<json>      the newest report
    <score>\\t<report ms>\\t<json>      older ones, newest first

flag ``b`` is a barrier member, ``p`` a provisional joiner (joined behind the
published step: in snapshots, not waited for), ``s`` stalled (work and no
progress for ``stall_after_ms``). A registered engine that has not reported yet
has the head line only, and only flag and due ms. ``score`` is the engine's
``wave * 2**32 + step`` plus its ``offset`` (the deployment's order); ``json``
is what a snapshot shows for the engine.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import orjson

from redisbal.errors import MalformedData

STEP_SPAN = 2**32  # score = wave * STEP_SPAN + step
BARRIER_MEMBER = "b"
PROVISIONAL = "p"
STALLED = "s"
NO_INCARNATION = "-"
_HEAD = re.compile(r"([bps])([0-9]*)(?: (\S+) ([0-9]+) ([0-9]+) ([0-9]+))?")
_LINE = re.compile(r"([0-9]+)\t([0-9]+)\t(.*)", re.S)


@dataclass(frozen=True)
class ReportLine:
    """One stored report: its score, the server ms it arrived, its snapshot JSON."""

    score: int
    ms: int
    json: str

    @property
    def wave(self) -> int:
        return self.score // STEP_SPAN

    @property
    def step(self) -> int:
        return self.score % STEP_SPAN

    def counts(self) -> dict[str, Any]:
        """The JSON decoded: wave, step, waiting, running, kv, t and maybe adm."""
        out: dict[str, Any] = orjson.loads(self.json)
        return out


@dataclass(frozen=True)
class Record:
    """An engine's record: barrier flag, heartbeat due ms, reports newest first, and
    the lifecycle fields: incarnation, score offset, last progress and suspect mark
    (server ms; 0 when none)."""

    flag: str
    due_ms: int
    reports: tuple[ReportLine, ...] = ()
    incarnation: str = NO_INCARNATION
    offset: int = 0
    progress_ms: int = 0
    suspect_until_ms: int = 0

    @property
    def latest(self) -> ReportLine | None:
        """The newest report, None for an engine that only registered."""
        return self.reports[0] if self.reports else None

    @property
    def scores(self) -> list[int]:
        return [r.score for r in self.reports]


def parse_record(text: str | bytes) -> Record:
    """The Record of a record's text; ValueError when it is not one."""
    if isinstance(text, bytes):
        text = text.decode()
    head, *lines = text.split("\n")
    m = _HEAD.fullmatch(head)
    if m is None:
        raise MalformedData(f"not a record head line: {head!r}")
    reports = []
    for line in lines:
        r = _LINE.fullmatch(line)
        if r is None:
            raise MalformedData(f"not a record report line: {line!r}")
        reports.append(ReportLine(int(r[1]), int(r[2]), r[3]))
    if m[3] is None:
        return Record(m[1], int(m[2] or 0), tuple(reports))
    return Record(m[1], int(m[2] or 0), tuple(reports), m[3], int(m[4]), int(m[5]), int(m[6]))


def format_record(record: Record) -> str:
    """The text of a Record, as the Lua side writes it."""
    head = f"{record.flag}{record.due_ms}"
    rest = (record.incarnation, record.offset, record.progress_ms, record.suspect_until_ms)
    if rest != (NO_INCARNATION, 0, 0, 0):
        head += " " + " ".join(str(v) for v in rest)
    lines = [head]
    lines += [f"{r.score}\t{r.ms}\t{r.json}" for r in record.reports]
    return "\n".join(lines)
