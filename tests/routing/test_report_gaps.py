"""How long an engine may go without a report before a request waiting on it is given
up (``ReportGaps``): from its own pauses, as forced snapshots name them. Pure logic,
fed with snapshots built the way the Lua barrier builds them."""

from __future__ import annotations

from support.helpers import make_snapshot

from redisbal.routing.outcomes import SILENT_AFTER_S
from redisbal.routing.unanswered import GAPS_FOR_MS, ReportGaps

ENGINES = {"a": (0, 1), "b": (0, 1)}


class Feed:
    """Snapshots every 100 ms (Redis time), as a coordinator's stall guard forces them."""

    def __init__(self) -> None:
        self.gaps = ReportGaps()
        self.ms = 1_000_000
        self.step = 1

    def complete(self, every_ms: int = 100) -> None:
        """A snapshot at a new cut: every engine reported."""
        self.ms += every_ms
        self.step += 1
        self.gaps.track(make_snapshot(ENGINES, time_ms=self.ms, step=self.step))

    def pause(self, engine: str, ms: int, every_ms: int = 100) -> None:
        """``engine`` does not report for ``ms``: forced snapshots at the same cut name it."""
        for age in range(every_ms, ms + 1, every_ms):
            self.ms += every_ms
            snap = make_snapshot(
                ENGINES, time_ms=self.ms, step=self.step, forced=True, laggards={engine: age}
            )
            self.gaps.track(snap)

    def bound(self, engine: str) -> float:
        return self.gaps.silent_after_s(engine, self.ms)


def test_an_engine_that_pauses_at_its_step_pace_gets_a_longer_bound() -> None:
    feed = Feed()
    for _ in range(4):  # a long step, reports again, a long step, ...
        feed.pause("a", 1400)
        feed.complete()
    assert feed.bound("a") > 1.4  # a pause like its usual ones is no sign it stopped
    assert feed.bound("b") == SILENT_AFTER_S  # the other engine's is the floor


def test_a_stopped_engines_ongoing_silence_never_lengthens_its_bound() -> None:
    feed = Feed()
    feed.complete()
    feed.pause("a", 5000)  # stopped: named a laggard longer and longer, never back
    assert feed.bound("a") == SILENT_AFTER_S


def test_a_pause_of_the_snapshots_themselves_is_no_engines_pace() -> None:
    feed = Feed()
    feed.pause("a", 300)
    feed.complete(every_ms=2000)  # nothing published for 2 s (a Redis outage)
    feed.pause("a", 300)
    feed.complete(every_ms=2000)
    assert feed.bound("a") == SILENT_AFTER_S


def test_pauses_are_forgotten_once_the_engine_is_back_at_its_pace() -> None:
    feed = Feed()
    feed.pause("a", 1400)
    feed.complete()
    assert feed.bound("a") > 1.4
    for _ in range(GAPS_FOR_MS // 100 + 1):
        feed.complete()
    assert feed.bound("a") == SILENT_AFTER_S
