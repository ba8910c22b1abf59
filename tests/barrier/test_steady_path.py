"""The steady-state path of a report (apply_steady in lua/includes/reports.lua) against
the general path, on a real server.

Random report sequences (lockstep rounds one by one and in report_many batches, engines
ahead, late, stale, refreshing a step, heartbeats, restarts, zombies, reports without an
incarnation, tick mode, wave changes, suspect marks, joins, expiries) run on two
deployments: one with the operations as shipped, one with the steady path turned off.
After every call the replies and the stored bytes (records, barrier fields, members,
meta, snapshot) must be equal. Both run on one clock that the test sets: their sources
read the server time from the config hash instead of TIME (a change made here, to the
EVAL text only), so records, which hold server times, compare byte for byte.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import redis

from redisbal.barrier.loader import script_source
from redisbal.barrier.record import parse_record
from redisbal.keys import DeploymentKeys
from redisbal.reporting.reporter import new_incarnation

pytestmark = pytest.mark.servers

OPS = ("report", "report_many", "register", "suspect")
TIME_CALL = "redis.call('TIME')"
TEST_TIME = "redis.call('HMGET', KEYS[1], 'test_s', 'test_us')"
STEADY_ON = "local STEADY_PATH = true"
STEP_SPAN = 2**32
T0 = 1_764_500_000_000


def sources(steady: bool) -> dict[str, str]:
    """EVAL text of each operation on the test's clock, with or without the steady path."""
    out = {}
    for op in OPS:
        src = script_source(op)
        assert TIME_CALL in src, op
        src = src.replace(TIME_CALL, TEST_TIME)
        if op.startswith("report"):
            assert src.count(STEADY_ON) == 1, op
            if not steady:
                src = src.replace(STEADY_ON, "local STEADY_PATH = false")
        out[op] = src
    return out


class Side:
    """One deployment and the operations it runs."""

    def __init__(self, r: redis.Redis, name: str, steady: bool) -> None:
        self.r = r
        self.keys = DeploymentKeys(name)
        self.scripts = {op: r.register_script(src) for op, src in sources(steady).items()}

    def call(self, op: str, now_ms: int, *args: Any) -> Any:
        self.r.hset(
            self.keys.config, mapping={"test_s": now_ms // 1000, "test_us": now_ms % 1000 * 1000}
        )
        argv = [self.keys.deployment, "PUBLISH", *args]
        try:
            return self.scripts[op](keys=self.keys.script_keys(), args=argv)
        except redis.ResponseError as exc:
            return ("error", str(exc))

    def stored(self) -> dict[str, Any]:
        k, r = self.keys, self.r
        snapshot = r.get(k.snapshot)
        return {
            "reports": r.hgetall(k.reports),
            "members": r.zrange(k.members, 0, -1, withscores=True),
            "meta": r.hgetall(k.meta),
            "epoch": r.get(k.epoch),
            # the snapshot names its deployment: the one difference allowed
            "snapshot": snapshot and snapshot.replace(k.deployment.encode(), b"D"),
        }


def steady_case(side: Side, entry: list[Any]) -> bool:
    """Whether a report (report_many's nine fields) meets the steady path's conditions
    on the stored state before the call (read with redisbal/barrier/record.py)."""
    engine, wave, step, *_, inc, progress = entry
    pub = side.r.hget(side.keys.reports, ".pub")
    text = side.r.hget(side.keys.reports, engine)
    if step == "tick" or progress != "1" or pub is None or text is None:
        return False
    rec = parse_record(text)
    latest = rec.latest
    score = int(wave) * STEP_SPAN + int(step) + rec.offset
    return bool(
        latest
        and rec.flag == "b"
        and rec.suspect_until_ms == 0
        and inc in ("-", rec.incarnation)
        and latest.score <= int(pub) < score
    )


class Engines:
    """What the random sequence knows of each engine: its step, wave, incarnations."""

    def __init__(self, rng: random.Random, n: int) -> None:
        self.rng = rng
        self.ids = [f"e{i}" for i in range(n)]
        self.wave = dict.fromkeys(self.ids, 0)
        self.step = dict.fromkeys(self.ids, 0)
        self.inc: dict[str, str] = {}
        self.old: dict[str, list[str]] = {e: [] for e in self.ids}

    def entry(
        self, e: str, step: int | str, progress: str = "1", inc: str | None = None
    ) -> list[Any]:
        rng = self.rng
        kv = rng.choice(["", "0", "1", "0.25", "0.4000", ".5"])
        adm = rng.choice(["", "0", "10,10,10", "3,0,12", ",".join(["1234567"] * 8)])
        return [e, self.wave[e], step, rng.randint(0, 3), rng.randint(0, 40), kv, adm,
                self.inc[e] if inc is None else inc, progress]  # fmt: skip


def run_sequence(r: redis.Redis, name: str, seed: int, calls: int) -> tuple[int, int]:
    """Drive both sides through one random sequence; returns how many reports met the
    steady path's conditions, and how many reports it sent."""
    rng = random.Random(seed)
    sides = [Side(r, f"{name}.steady", True), Side(r, f"{name}.general", False)]
    eng = Engines(rng, 5)
    now = T0
    steady = total = 0

    def both(op: str, *args: Any) -> None:
        replies = [s.call(op, now, *args) for s in sides]
        assert replies[0] == replies[1], (op, args)
        assert sides[0].stored() == sides[1].stored(), (op, args)

    def report(entries: list[list[Any]]) -> None:
        nonlocal steady, total
        steady += sum(steady_case(sides[0], e) for e in entries)
        total += len(entries)
        if len(entries) == 1 and rng.random() < 0.5:
            both("report", "ep", *entries[0])
        else:
            both("report_many", "ep", len(entries), *(a for e in entries for a in e))

    for i, e in enumerate(eng.ids):
        eng.inc[e] = "-" if i == 4 else new_incarnation(now - 1000)
    both("register", "ep", *eng.ids[:4])  # e4 joins by reporting
    for _ in range(calls):
        now += rng.choice([0, 1, 3, 40, 90, 300, 700, 2000, 6000])
        action = rng.choices(
            ["round", "ahead", "late", "refresh", "heartbeat", "restart", "zombie", "anon",
             "tick", "wave", "suspect"],
            weights=[30, 3, 3, 2, 3, 1, 1, 2, 1, 1, 1],
        )[0]  # fmt: skip
        e = rng.choice(eng.ids)
        if action == "round":
            live = [x for x in eng.ids if rng.random() < 0.97]
            for x in live:
                eng.step[x] += 1
            rng.shuffle(live)
            while live:
                k = rng.randint(1, len(live))
                report([eng.entry(x, eng.step[x]) for x in live[:k]])
                live = live[k:]
        elif action == "ahead":
            eng.step[e] += 2
            report([eng.entry(e, eng.step[e])])
        elif action == "late":
            report([eng.entry(e, max(0, eng.step[e] - rng.randint(1, 3)))])
        elif action == "refresh":
            report([eng.entry(e, eng.step[e])])
        elif action == "heartbeat":
            report([eng.entry(e, eng.step[e], progress="0")])
        elif action == "restart":
            eng.old[e].append(eng.inc[e])
            eng.inc[e] = new_incarnation(now)
            eng.step[e] = rng.randint(0, 3)
            report([eng.entry(e, eng.step[e])])
        elif action == "zombie" and eng.old[e] and eng.old[e][-1] != "-":
            report([eng.entry(e, eng.step[e] + 1, inc=eng.old[e][-1])])
        elif action == "anon":
            eng.step[e] += 1
            report([eng.entry(e, eng.step[e], inc="-")])
        elif action == "tick":  # (one engine in tick mode: its tag is far ahead)
            report([eng.entry("e0", "tick")])
        elif action == "wave":  # (every engine moves to the next wave)
            for x in eng.ids:
                eng.wave[x] += 1
                eng.step[x] = 0
            report([eng.entry(x, 0) for x in eng.ids])
        elif action == "suspect":
            both("suspect", e, rng.choice(["-", "3"]), "timeout")
    return steady, total


@pytest.mark.parametrize("seed", range(6))
def test_steady_path_stores_what_the_general_path_stores(
    r: redis.Redis, deployment: str, seed: int
) -> None:
    steady, total = run_sequence(r, deployment, seed, 120)
    assert steady >= 50 and steady >= total / 4, (steady, total)  # the path was taken


def test_the_comparison_can_fail(r: redis.Redis, deployment: str) -> None:
    """A steady path that wrote one byte differently is caught."""
    side = Side(r, deployment + ".broken", True)
    broken = sources(True)["report"].replace(
        "push2(p.fields, engine, format_report('b', due,",
        "push2(p.fields, engine, format_report('p', due,",
    )
    assert broken != sources(True)["report"]
    side.scripts["report"] = r.register_script(broken)
    with pytest.raises(AssertionError):
        run_sequence_with(r, deployment, side)


def run_sequence_with(r: redis.Redis, name: str, broken: Side) -> None:
    general = Side(r, f"{name}.general2", False)
    inc = new_incarnation(T0)
    for s in (broken, general):
        s.call("register", T0, "ep", "e0")
    for step in range(1, 4):
        replies = [s.call("report", T0 + step, "ep", "e0", 0, step, 1, 2, "", "", inc, "1")
                   for s in (broken, general)]  # fmt: skip
        assert replies[0] == replies[1]
        assert broken.stored() == general.stored()
