"""Property test: random interleavings against a plain-Python model of the barrier.

The model is written from docs/DESIGN.md's invariants and the KEYS/ARGV/returns
headers of the Lua scripts, in its own terms (tags are (wave, step) tuples,
membership is a dict), not by transcribing the Lua. Hypothesis drives reports
(in order, ahead, late, stale, same-step refresh, retries, wave changes),
registrations, leaves, expiries (an engine's liveness score lowered to the
distant past, then a reap, or another engine's report that reaps it on the
way), forced publications, state loss, and the engine lifecycle: restarts (a
later incarnation from step 0..3, whose steps continue after the published
one), zombies (an earlier incarnation: refused), hangs (the record's last
progress moved to the distant past) and heartbeats (unchanged counts, no
progress: a hung engine with work is stalled until its next progress); after
every step the real stored snapshot, barrier, membership and counters must
equal the model's.

Time is kept out of the model: no join grace, dead_after_ms and idle publish
far away, the stall guard called with stall_ms 0.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import orjson
import pytest
import redis
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test
from support.helpers import Barrier, text

from redisbal.keys import DeploymentKeys
from redisbal.reporting.reporter import new_incarnation

pytestmark = pytest.mark.servers

Tag = tuple[int, int]  # (wave, step)
BEFORE: Tag = (-1, 0)  # before every real tag: "nothing published" / "registered, no report"
ENGINES = ["e0", "e1", "e2", "e3"]
COUNTERS = (
    "stale",
    "late",
    "published",
    "forced",
    "left",
    "expired",
    "restarted",
    "conflicts",
    "stalled",
)
STEP_SPAN = 2**32
# how far behind the next step a shared new sequence may put a process (reports.lua's)
_REPORTS_LUA = (resources.files("redisbal.barrier") / "lua/includes/reports.lua").read_text()
_SLACK = re.search(r"^local SHARED_SLACK = (\d+)", _REPORTS_LUA, re.M)
assert _SLACK is not None
SHARED_SLACK = int(_SLACK.group(1))


def tag_of(score: int) -> Tag:
    return divmod(score, STEP_SPAN)  # type: ignore[return-value]


def raw_score(tag: Tag) -> int:
    return tag[0] * STEP_SPAN + tag[1]


@dataclass
class Report:
    tag: Tag  # in the deployment's order: the engine's own (wave, step) plus its offset
    waiting: int
    running: int
    kv: float | None
    raw: Tag = BEFORE  # the engine's own (wave, step) (BEFORE: the same as tag)

    def own(self) -> Tag:
        return self.tag if self.raw == BEFORE else self.raw


@dataclass
class Model:
    """What docs/DESIGN.md says the barrier holds."""

    epoch: str
    pub: Tag = BEFORE
    version: int = 0
    members: dict[str, bool] = field(default_factory=dict)  # engine -> alive (False: expired)
    barrier: dict[str, Tag] = field(default_factory=dict)  # engines that hold the barrier
    history: dict[str, list[Report]] = field(default_factory=dict)  # newest first
    counters: dict[str, int] = field(default_factory=dict)
    stale: dict[str, int] = field(default_factory=dict)
    gone: dict[str, str] = field(default_factory=dict)  # removed since the last snapshot
    snapshot: dict[str, Any] | None = None
    # the lifecycle: each record's incarnation (a number: later is greater) and offset,
    # the step sequence restarts share, engines that stopped progressing, stalled ones
    inc: dict[str, int] = field(default_factory=dict)
    offset: dict[str, int] = field(default_factory=dict)
    rebase: int | None = None
    hung: set[str] = field(default_factory=set)
    stalled: set[str] = field(default_factory=set)

    def bump(self, name: str) -> None:
        self.counters[name] = self.counters.get(name, 0) + 1

    # -- publication --------------------------------------------------------------------------

    def publish(self, cut: Tag, laggards: list[str] | None = None) -> int:
        """Invariant 1: each engine's newest report at or before the cut."""
        self.version += 1
        engines, joining = {}, set()
        for e, hist in self.history.items():
            older = [h for h in hist if h.tag <= cut]
            if older:
                h = older[0]
                engines[e] = (*h.own(), h.waiting, h.running, h.kv)
            else:
                joining.add(e)
        self.snapshot = {
            "version": self.version,
            "cut": cut,
            "forced": laggards is not None,
            "laggards": set(laggards or ()),
            "gone": dict(self.gone),
            "joining": joining,
            # registered, no report yet: whether these count as joining is not specified
            "registered_only": {e for e in self.members if e not in self.history},
            "engines": engines,
            "stalled": set(self.stalled),
        }
        self.gone.clear()
        self.pub = cut
        self.bump("forced" if laggards is not None else "published")
        return self.version

    def complete(self) -> int:
        """Invariant 2: publish once every barrier member is past the published step."""
        if not self.barrier:
            return 0
        low = min(self.barrier.values())
        return self.publish(low) if low > self.pub else 0

    def after_membership_change(self) -> int:
        """Invariant 5: a change completes the barrier or is republished at once."""
        v = self.complete()
        if v == 0 and self.pub != BEFORE:
            v = self.publish(self.pub)
        return v

    def forget(self, engine: str) -> None:
        """The engine's record and its place in the barrier go (a removal, a restart)."""
        self.barrier.pop(engine, None)
        self.history.pop(engine, None)
        self.stale.pop(engine, None)
        for d in (self.inc, self.offset):
            d.pop(engine, None)
        self.hung.discard(engine)
        self.stalled.discard(engine)

    def remove(self, engine: str, why: str) -> bool:
        self.forget(engine)
        if self.members.pop(engine, None) is None:
            return False
        self.bump(why)
        self.gone[engine] = why
        return True

    def reap_dead(self) -> list[str]:
        dead = sorted(e for e, alive in self.members.items() if not alive)
        for e in dead:
            self.remove(e, "expired")
        return dead

    # -- operations ---------------------------------------------------------------------------

    def report(
        self,
        engine: str,
        rep: Report,
        reap_due: bool,
        inc: int | None = None,
        progress: bool = True,
    ) -> tuple[str, int]:
        """reap_due: whether this report also expires dead engines on the way (reports
        do that at most every dead_after_ms / 4; the test decides which happens). ``inc``:
        the reporting process's incarnation (None: the report names none); ``progress``:
        False for a heartbeat. ``rep.tag`` is the engine's own (wave, step) here."""
        changed = restarted = False
        current = self.inc.get(engine)
        if inc is not None and current is not None and inc != current:
            if inc < current:  # invariant 6: a process older than the record's: refused
                self.bump("conflicts")
                return "conflict", 0
            self.forget(engine)  # a restart: a leave and a join in one step
            self.bump("restarted")
            changed = restarted = True
        raw = rep.tag
        hist = self.history.get(engine)
        offset = self.offset.get(engine, 0)
        pub = score(self.pub)
        if not hist and inc is not None and self.pub != BEFORE and raw_score(raw) <= pub:
            # a restart starts a new step sequence right after the published step; a
            # process joining while that sequence puts it at the next step or at most
            # SHARED_SLACK behind joins it (the test's processes all started before pub
            # was reached)
            if (
                self.rebase is not None
                and pub + 1 - SHARED_SLACK <= self.rebase + raw_score(raw) <= pub + 1
            ):
                offset = self.rebase
            elif restarted:
                offset = self.rebase = int(pub) + 1 - raw_score(raw)
        rep = Report(tag_of(raw_score(raw) + offset), rep.waiting, rep.running, rep.kv, raw)
        if hist and rep.tag < hist[0].tag:  # invariant 3: older than its latest
            self.bump("stale")
            self.stale[engine] = self.stale.get(engine, 0) + 1
            return "stale", 0
        if not hist:
            self.history[engine] = [rep]
            self.offset[engine] = offset
        elif rep.tag == hist[0].tag:
            hist[0] = rep  # same-step refresh
        else:
            if rep.tag <= self.pub:
                self.bump("late")
            hist.insert(0, rep)
        self.members[engine] = True
        if inc is not None:
            self.inc[engine] = inc
        if progress:
            self.hung.discard(engine)
        if engine in self.stalled:
            if progress:  # it progressed: back, a member unless behind the published step
                self.stalled.discard(engine)
                changed = True
                if rep.tag >= self.pub:
                    self.barrier[engine] = rep.tag
        # a joiner behind the published step does not hold the barrier (invariant 5); once
        # it reaches the published step it is a member like the others
        elif self.pub == BEFORE or rep.tag >= self.pub or engine in self.barrier:
            self.barrier[engine] = rep.tag
        if (
            not progress
            and engine in self.hung
            and engine not in self.stalled
            and (rep.waiting or rep.running)
        ):  # invariant 9: work and no progress: stalled, not waited for
            self.stalled.add(engine)
            self.barrier.pop(engine, None)
            self.bump("stalled")
            changed = True
        if reap_due and self.reap_dead():
            changed = True
        return "accepted", self.after_membership_change() if changed else self.complete()

    def register(self, engines: list[str]) -> int:
        added = 0
        for e in engines:
            if e not in self.members:
                self.members[e] = True
                added += 1
                if self.pub == BEFORE:  # the first snapshot waits for it
                    self.barrier[e] = BEFORE
        return added

    def leave(self, engine: str) -> tuple[int, int]:
        if not self.remove(engine, "left"):
            return 0, 0
        return 1, self.after_membership_change()

    def reap(self) -> tuple[int, list[str]]:
        dead = self.reap_dead()
        return (self.after_membership_change() if dead else self.complete()), dead

    def force(self) -> tuple[int, list[str]]:
        if self.pub == BEFORE and BEFORE in self.barrier.values():
            return 0, []  # never force over an engine that has not reported at all
        ahead = [t for t in self.barrier.values() if t > self.pub]
        if not ahead:
            return 0, []
        cut = min(ahead)
        laggards = sorted(e for e, t in self.barrier.items() if t < cut)
        return self.publish(cut, laggards), laggards


_INCARNATIONS: dict[int, str] = {}


def incarnation(n: int) -> str:
    """The n-th process's incarnation: started one second after the (n-1)-th."""
    if n not in _INCARNATIONS:
        _INCARNATIONS[n] = new_incarnation(1_700_000_000_000 + n * 1000)
    return _INCARNATIONS[n]


def score(tag: Tag) -> float:
    return -1.0 if tag == BEFORE else float(tag[0] * 2**32 + tag[1])


class BarrierMachine(RuleBasedStateMachine):
    client: redis.Redis  # set by the test before running

    def __init__(self) -> None:
        super().__init__()
        self.keys = DeploymentKeys(f"m{uuid.uuid4().hex[:12]}")
        self.epochs = 1
        self.bar = Barrier(self.client, self.keys, epoch="ep1")
        self.bar.configure()
        self.model = Model(epoch="ep1")
        self.last_args: dict[str, tuple[Tag, int, int, str]] = {}
        self.expired_seen = 0
        self.processes = 0  # incarnations handed out (restart), each later than the last

    def teardown(self) -> None:
        self.client.delete(*self.keys.all_keys())

    # -- rules --------------------------------------------------------------------------------

    def _tag_for(self, engine: str, wave_move: int, step_move: int) -> Tag:
        hist = self.model.history.get(engine)
        if hist:
            base = hist[0].own()
        elif self.model.pub != BEFORE:
            base = self.model.pub  # joiners land around the published step
        else:
            base = (0, 2)
        wave = max(0, base[0] + wave_move)
        step = max(0, base[1] + step_move) if wave == base[0] else max(0, step_move)
        return (wave, step)

    def _report(
        self,
        engine: str,
        tag: Tag,
        waiting: int,
        running: int,
        kv: str,
        reap_due: bool,
        inc: int | None = None,
        progress: bool = True,
    ) -> None:
        """One report, as the engine's current process (its incarnation, if it named
        one) unless ``inc`` says which; the real barrier and the model must agree."""
        if inc is None:
            inc = self.model.inc.get(engine)
        self.last_args[engine] = (tag, waiting, running, kv)
        self.bar.set_opportunistic_reap(engine, reap_due)
        got = self.bar.report(
            engine,
            tag[1],
            waiting,
            running,
            tag[0],
            kv=kv,
            inc=None if inc is None else incarnation(inc),
            progress=progress,
        )
        want_status, want_version = self.model.report(
            engine,
            Report(tag, waiting, running, float(kv) if kv else None),
            reap_due,
            inc,
            progress,
        )
        assert got == (want_status, want_version, tag[0], tag[1])
        m = self.model
        if m.counters.get("expired", 0) > self.expired_seen:
            self.expired_seen = m.counters["expired"]
            event("report: reaped an expired engine")
        if want_status in ("stale", "conflict"):
            event(f"report: {want_status}")
        elif want_version:
            event("report: published")
        elif engine in m.stalled:
            event("report: stalled")
        elif engine not in m.barrier:
            event("report: provisional joiner")
        elif tag <= m.pub:
            event("report: late or refresh of a published step")
        if m.snapshot and m.snapshot["joining"]:
            event("snapshot lists joining engines")

    @rule(
        engine=st.sampled_from(ENGINES),
        wave_move=st.sampled_from([0, 0, 0, 0, 0, 1, -1]),
        step_move=st.integers(-3, 4),
        waiting=st.integers(0, 40),
        running=st.integers(0, 40),
        kv=st.sampled_from(["", "", "0.5", "1"]),
        reap_due=st.booleans(),
    )
    def report(
        self,
        engine: str,
        wave_move: int,
        step_move: int,
        waiting: int,
        running: int,
        kv: str,
        reap_due: bool,
    ) -> None:
        tag = self._tag_for(engine, wave_move, step_move)
        self._report(engine, tag, waiting, running, kv, reap_due)

    @rule(engine=st.sampled_from(ENGINES), waiting=st.integers(0, 40), reap_due=st.booleans())
    def report_next_step(self, engine: str, waiting: int, reap_due: bool) -> None:
        """The common case, so that barriers complete often: the engine's next step."""
        self._report(engine, self._tag_for(engine, 0, 1), waiting, waiting // 2, "", reap_due)

    @rule(engine=st.sampled_from(ENGINES), step=st.integers(0, 3), waiting=st.integers(0, 9))
    def restart(self, engine: str, step: int, waiting: int) -> None:
        """Invariant 6: a new process of the engine, its steps from (0, step)."""
        self.processes += 1
        self._report(engine, (0, step), waiting, 1, "", False, inc=self.processes)

    @rule(engine=st.sampled_from(ENGINES))
    def zombie(self, engine: str) -> None:
        """A process started before the engine's current one reports: refused."""
        current = self.model.inc.get(engine)
        if current is not None:
            self._report(engine, (0, 1), 5, 5, "", False, inc=current - 1)

    @rule(engine=st.sampled_from(ENGINES), beat=st.booleans())
    def hang(self, engine: str, beat: bool) -> None:
        """The engine's loop stops: its last progress is now long ago (and its heartbeat
        comes at once, or later)."""
        if engine in self.model.history:
            self.bar.age_progress(engine)
            self.model.hung.add(engine)
            if beat:
                self.heartbeat(engine)

    @rule(engine=st.sampled_from(ENGINES))
    def heartbeat(self, engine: str) -> None:
        """Invariant 9: its last counts again, without progress."""
        if engine in self.last_args and engine in self.model.history:
            self._report(engine, *self.last_args[engine], reap_due=False, progress=False)

    @rule(engine=st.sampled_from(ENGINES))
    def retry_last_report(self, engine: str) -> None:
        """Invariant 6: sending the same report again is harmless."""
        if engine in self.last_args:
            self._report(engine, *self.last_args[engine], reap_due=False)

    @rule(
        engines=st.lists(st.sampled_from(ENGINES), min_size=1, max_size=3), draw=st.integers(0, 2)
    )
    def register(self, engines: list[str], draw: int) -> None:
        if draw:  # membership changes are rarer than reports
            return
        assert self.bar.register(*engines) == self.model.register(engines)

    @rule(engine=st.sampled_from(ENGINES), draw=st.integers(0, 2))
    def leave(self, engine: str, draw: int) -> None:
        if draw:
            return
        assert self.bar.leave(engine) == self.model.leave(engine)

    @rule(engine=st.sampled_from(ENGINES), draw=st.integers(0, 2))
    def stop_heartbeat(self, engine: str, draw: int) -> None:
        """The engine's last report is now far older than dead_after_ms."""
        if not draw and engine in self.model.members:
            self.bar.expire_now(engine)
            self.model.members[engine] = False

    @rule()
    def reap(self) -> None:
        version, dead = self.bar.reap()
        want_version, want_dead = self.model.reap()
        assert (version, sorted(dead)) == (want_version, want_dead)
        self.expired_seen = self.model.counters.get("expired", 0)
        event(f"reap: expired {len(dead)}, published {bool(version)}")

    @rule()
    def force(self) -> None:
        version, laggards = self.bar.force(stall_ms="0")
        assert (version, sorted(laggards)) == self.model.force()
        event(f"force: published {bool(version)}")

    @rule(draw=st.integers(0, 9))
    def lose_state(self, draw: int) -> None:
        """Redis state lost: the next configure starts a new epoch, versions restart."""
        if draw:
            return
        self.client.delete(*self.keys.all_keys())
        self.epochs += 1
        self.bar.epoch = f"ep{self.epochs}"
        assert self.bar.configure() == self.bar.epoch
        self.model = Model(epoch=self.bar.epoch)
        self.last_args.clear()
        self.expired_seen = 0

    # -- checks after every step --------------------------------------------------------------

    @invariant()
    def stored_state_matches_the_model(self) -> None:
        m = self.model
        assert self.bar.barrier() == {e: score(t) for e, t in m.barrier.items()}
        assert set(self.bar.members()) == set(m.members)
        meta, hot = self.bar.meta(), self.bar.hot()
        assert float(hot["pub"]) == score(m.pub)
        # the barrier counter is exactly the members at or before pub
        assert int(hot["behind"]) == sum(1 for t in m.barrier.values() if score(t) <= score(m.pub))
        for name in COUNTERS:
            assert int(meta.get(name, "0")) == m.counters.get(name, 0), name
        assert {k[6:]: int(v) for k, v in meta.items() if k.startswith("stale:")} == m.stale
        assert text(self.client.get(self.keys.epoch)) == m.epoch

    @invariant()
    def stored_snapshot_matches_the_model(self) -> None:
        raw = self.bar.snapshot_raw()
        want = self.model.snapshot
        if want is None:
            assert raw is None
            return
        assert raw is not None
        d = orjson.loads(raw)
        assert d["epoch"] == self.model.epoch
        assert d["version"] == want["version"]
        assert (d["wave"], d["step"]) == want["cut"]
        assert d["forced"] == want["forced"]
        assert set(d["laggards"]) == want["laggards"]
        assert d["gone"] == want["gone"]
        joining = set(d["joining"])
        assert want["joining"] <= joining <= want["joining"] | want["registered_only"]
        got = {
            e: (c["wave"], c["step"], c["waiting"], c["running"], c["kv"])
            for e, c in d["engines"].items()
        }
        assert got == want["engines"]
        assert set(d["stalled"]) == want["stalled"]


def test_barrier_matches_the_model(r: redis.Redis) -> None:
    BarrierMachine.client = r
    run_state_machine_as_test(
        BarrierMachine,
        settings=settings(
            max_examples=100,
            stateful_step_count=40,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
