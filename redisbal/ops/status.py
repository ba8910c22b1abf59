"""``redisbal status``: what a deployment looks like right now, read from Redis.

One pipeline reads the snapshot, the members (heartbeats), every engine's
record (barrier flag, lifecycle fields, latest report) and the meta counters;
nothing is written. Per engine it shows the age of its latest report and of
its last progress (a report its loop made, not a heartbeat). Engine states:

- ``live``: a member that holds the barrier (reports every step);
- ``provisional``: a member that joined behind the published step: it is in
  snapshots but does not hold the barrier back yet;
- ``stalled``: work queued or running and no progress for ``stall_after_ms``:
  routers do not choose it and the barrier does not wait for it;
- ``suspect``: requests to it failed (``router.failed()``): ejected, routers
  do not choose it until its back-off ends; the reason says what they got
  (``suspect: 5xx x12 in 2.0s``);
- ``probing``: its back-off ended and no router has seen it answer since:
  routers send it one request at a time; an answer makes it live again (its
  own reports do not);
- ``conflict``: a process started earlier still reports under its id (two
  processes, one engine id): its reports are refused; both incarnations shown;
- ``registered``: announced (by itself or by the coordinator's expected
  list) but not reported yet: the first snapshot waits for it;
- ``expired`` / ``left``: removed, shown for ``RECENT_S`` after it (the
  deployment remembers the last 64 removals), ``gone``: seen before (``--watch``)
  but no longer a member.

``room`` is an engine's room as routers read it from its declared running cap
(``redisbal.running_caps``: its free slots) and its KV usage
(``routing.estimates.kv_room``: requests of the size of those it runs that its KV
cache would still take), the fewer, less its queue; negative, a queue past it; ``-``,
it declares no cap and reports no KV usage. Holding waits while every engine's room
is used up. ``--json`` gives the declared cap as ``cap``.
"""

from __future__ import annotations

import math
import re
from typing import Any

from redisbal import running_caps
from redisbal.barrier.record import PROVISIONAL, STALLED, Record, parse_record
from redisbal.barrier.snapshot import Snapshot
from redisbal.config import SETTINGS
from redisbal.connection import RedisClient
from redisbal.keys import DeploymentKeys, is_engine_field
from redisbal.ops.table import render_table
from redisbal.routing.estimates import kv_room

COUNTERS = (
    "published",
    "forced",
    "stale",
    "late",
    "joined",
    "restarted",
    "conflicts",
    "stalled",
    "suspected",
    "recovered",
    "expired",
    "left",
)
RECENT_S = 600  # removed engines stay in the table this long
DEFAULT_DEAD_AFTER_MS = SETTINGS["dead_after_ms"].default


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _natural(name: str) -> tuple[Any, ...]:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


def _engine_record(text: str) -> tuple[Record | None, dict[str, Any] | None]:
    """(record, latest report decoded) of an engine's record (redisbal.barrier.record); the
    report is None when the engine only registered, both are None when the record is
    not readable (status shows what it can)."""
    try:
        rec = parse_record(text)
        return rec, rec.latest.counts() if rec.latest else None
    except ValueError:  # orjson.JSONDecodeError is a ValueError too
        return None, None


def _recent(meta: dict[str, str], now_ms: int) -> dict[str, tuple[str, int, str]]:
    """Engines removed within RECENT_S: id -> (why, ms ago, incarnation), newest first."""
    out: dict[str, tuple[str, int, str]] = {}
    for line in meta.get("recent", "").split("\n"):
        parts = line.split(" ")
        if len(parts) != 4 or not parts[2].isdigit():
            continue
        ago = max(0, now_ms - int(parts[2]))
        if ago <= RECENT_S * 1000 and parts[0] not in out:
            out[parts[0]] = (parts[1], ago, parts[3])
    return out


def _state(
    e: str, rec: Record | None, rep: dict[str, Any] | None, meta: dict[str, str], now_ms: int
) -> tuple[str, dict[str, Any]]:
    """An engine's state (module docstring) and the fields that explain it."""
    extra: dict[str, Any] = {}
    if rec is None or rep is None:
        return "registered", extra
    extra["incarnation"] = None if rec.incarnation == "-" else rec.incarnation
    extra["progress_age_ms"] = max(0, now_ms - rec.progress_ms) if rec.progress_ms else None
    dead_after = int(meta.get("dead_after_ms") or DEFAULT_DEAD_AFTER_MS)
    conflict = meta.get(f"conflict:{e}", "").split(" ")
    if len(conflict) == 3 and conflict[0].isdigit() and now_ms - int(conflict[0]) < dead_after:
        extra["conflict"] = {"refused": conflict[1], "current": conflict[2]}
        return "conflict", extra
    if rec.flag == STALLED:
        return "stalled", extra
    if rec.suspect_until_ms:
        # "<ms> <client> <level> <reason>" (lua/suspect.lua)
        mark = meta.get(f"suspect:{e}", "").split(" ", 3)
        if len(mark) == 4:  # client index "-": not a router (the sidecar)
            who = int(mark[1]) if mark[1].isdigit() else None
            level = int(mark[2]) if mark[2].isdigit() else 0
            extra["suspect"] = {"client_index": who, "reason": mark[3], "level": level}
        if rec.suspect_until_ms > now_ms:
            extra["ejected_ms_left"] = rec.suspect_until_ms - now_ms
            return "suspect", extra
        return "probing", extra
    return ("provisional" if rec.flag == PROVISIONAL else "live"), extra


def gather_status(
    client: RedisClient, deployment: str, seen: set[str] | None = None
) -> dict[str, Any]:
    """The deployment's state as a JSON-able dict (``seen``: engines shown before, for --watch)."""
    keys = DeploymentKeys(deployment)
    sec, usec = client.time()
    now_ms = int(sec) * 1000 + int(usec) // 1000
    pipe = client.pipeline(transaction=False)
    pipe.get(keys.epoch)
    pipe.get(keys.snapshot)
    pipe.zrange(keys.members, 0, -1, withscores=True)
    pipe.hgetall(keys.reports)
    pipe.hgetall(keys.meta)
    pipe.hgetall(keys.config)
    pipe.hgetall(keys.running_caps)
    epoch, snap_raw, members, reports, meta, config, caps_raw = pipe.execute()
    caps = running_caps.parse(caps_raw)  # the running caps the engines declared
    snap = Snapshot.from_json(snap_raw) if snap_raw else None
    members_ms = {_s(e): int(score) for e, score in members}  # heartbeat (or registration)
    records = {
        _s(e): _engine_record(_s(rec)) for e, rec in reports.items() if is_engine_field(_s(e))
    }
    meta = {_s(k): _s(v) for k, v in meta.items()}
    config = {_s(k): _s(v) for k, v in config.items()}
    gone = dict(snap.gone) if snap else {}
    recent = _recent(meta, now_ms)
    names = (
        set(members_ms)
        | set(records)
        | set(gone)
        | set(recent)
        | (set(snap.engines) if snap else set())
        | (seen or set())
    )
    engines = []
    for e in sorted(names, key=_natural):
        row: dict[str, Any] = {"engine": e}
        counts = snap.engines.get(e) if snap else None
        rec, rep = records.get(e, (None, None))
        if counts is not None:
            row.update(
                source="snapshot",
                waiting=counts.waiting,
                running=counts.running,
                kv=counts.kv_usage,
                wave=counts.wave,
                step=counts.step,
            )
        elif rep is not None:
            row.update(
                source="report",
                waiting=rep["waiting"],
                running=rep["running"],
                kv=rep["kv"],
                wave=rep["wave"],
                step=rep["step"],
            )
        else:
            row.update(source=None, waiting=None, running=None, kv=None, wave=None, step=None)
        # what the routers read of its room: requests it would take beyond its queue
        # (negative: queued past it) under its declared cap and in its KV cache, None when
        # neither bounds it (routing.estimates.room; a cap learned from queues is each
        # router's own, not shown)
        running, waiting = row["running"] or 0, row["waiting"] or 0
        row["cap"] = cap = caps.get(e)
        slots = cap - running - waiting if cap else math.inf
        room = min(slots, kv_room(running, row["kv"]) - waiting)
        row["kv_room"] = None if room == math.inf else round(room, 1)
        row.update(incarnation=None, progress_age_ms=None)
        if e in members_ms or e in records:
            seen_ms = rep["t"] if rep is not None else members_ms.get(e)
            row["age_ms"] = None if seen_ms is None else max(0, now_ms - int(seen_ms))
            row["state"], extra = _state(e, rec, rep, {**config, **meta}, now_ms)
            row.update(extra)
        elif e in recent:
            row["state"], row["removed_ms_ago"], inc = recent[e]
            row["incarnation"] = None if inc == "-" else inc
            row["age_ms"] = None
        else:
            row["age_ms"] = None
            row["state"] = gone.get(e, "gone")
        row["stale_reports"] = int(meta.get(f"stale:{e}", 0))
        engines.append(row)
    return {
        "deployment": deployment,
        "server_time_ms": now_ms,
        "epoch": _s(epoch) if epoch else None,
        "snapshot": None
        if snap is None
        else {
            "version": snap.version,
            "wave": snap.wave,
            "step": snap.step,
            "forced": snap.forced,
            "laggards": snap.laggards,
            "joining": list(snap.joining),
            "stalled": snap.stalled,
            "suspect": snap.suspect,
            "probing": list(snap.probing),
            "age_ms": max(0, now_ms - snap.time_ms),
            "engines": len(snap.engines),
        },
        "counters": {c: int(meta.get(c, 0)) for c in COUNTERS},
        "config": config,
        "coordinator": _lease_holder(config, now_ms),
        "engines": engines,
    }


def _lease_holder(config: dict[str, str], now_ms: int) -> str | None:
    """The coordinator holding the lease (kept in the config hash), if it is still valid."""
    owner = config.get("lease_owner")
    until = int(config.get("lease_until_ms") or 0)
    return owner if owner and until > now_ms else None


def _fmt_age(ms: int | None) -> str:
    if ms is None:
        return "-"
    return f"{ms}ms" if ms < 10_000 else f"{ms / 1000:.0f}s"


def _state_text(e: dict[str, Any]) -> str:
    """The state column: the state and what explains it."""
    state = str(e["state"])
    if "conflict" in e:
        c = e["conflict"]
        return f"conflict ({c['current']} replaced {c['refused']}, which still reports)"
    if "suspect" in e:
        who = e["suspect"]["client_index"]
        by = "" if who is None else f"router {who}: "
        left = f", {_fmt_age(e['ejected_ms_left'])} left" if "ejected_ms_left" in e else ""
        return f"{state}: {e['suspect']['reason']} ({by}back-off {e['suspect']['level']}{left})"
    if "removed_ms_ago" in e:
        return f"{state} {_fmt_age(e['removed_ms_ago'])} ago"
    return state


def _dash(v: Any) -> str:
    return "-" if v is None else str(v)


def format_status(st: dict[str, Any]) -> str:
    """Human-readable status: deployment lines, then the per-engine table."""
    lines = []
    snap = st["snapshot"]
    head = f"deployment {st['deployment']}  epoch {st['epoch'] or '-'}"
    if snap is None:
        head += "  no snapshot yet"
    else:
        lag = ", ".join(f"{e} ({ms}ms)" for e, ms in snap["laggards"].items()) or "-"
        head += (
            f"  snapshot v{snap['version']} wave {snap['wave']} step {snap['step']}"
            f" ({_fmt_age(snap['age_ms'])} ago)  forced {'yes' if snap['forced'] else 'no'}"
            f"  laggards {lag}"
        )
    lines.append(head)
    lines.append(
        "counters  "
        + "  ".join(f"{k} {v}" for k, v in st["counters"].items())
        + f"  coordinator {st['coordinator'] or 'none'}"
    )
    if not st["engines"]:
        lines.append("no engines")
        return "\n".join(lines)
    rows: list[tuple[str, ...]] = [
        ("engine", "waiting", "running", "kv", "room", "step", "age", "progress", "state", "stale")
    ]
    for e in st["engines"]:
        step = "-" if e["step"] is None else f"{e['wave']}:{e['step']}"
        if e["source"] == "report":
            step += "*"
        kv = "-" if e["kv"] is None else f"{e['kv']:.2f}"
        rows.append(
            (
                e["engine"],
                _dash(e["waiting"]),
                _dash(e["running"]),
                kv,
                _dash(e["kv_room"]),
                step,
                _fmt_age(e["age_ms"]),
                _fmt_age(e["progress_age_ms"]),
                _state_text(e),
                str(e["stale_reports"]),
            )
        )
    lines.append("")
    lines.append(render_table(rows))
    if any(e["source"] == "report" for e in st["engines"]):
        lines.append("* not in the snapshot yet: counts of its latest report")
    return "\n".join(lines)
