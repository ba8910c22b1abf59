"""The per-engine outcome state machine (redisbal.routing.outcomes): pure, on a given clock."""

from __future__ import annotations

import pytest

from redisbal.routing.outcomes import (
    EJECTED,
    FIRST_BYTE_UNANSWERED_S,
    HEALTHY,
    PROBING,
    OutcomeTracker,
)


def test_a_failure_ejects_and_the_ejection_lapses_into_probing_not_healthy() -> None:
    t = OutcomeTracker(base_s=0.1, max_s=1.0)
    assert t.state("e0", 0.0) == HEALTHY
    assert t.failure("e0", "5xx", 0.0) is True
    assert t.state("e0", 0.05) == EJECTED
    assert t.state("e0", 0.1) == PROBING  # never back to healthy by time alone
    assert t.state("e0", 100.0) == PROBING


def test_back_off_doubles_while_probes_fail_up_to_the_cap() -> None:
    t = OutcomeTracker(base_s=0.1, max_s=0.5)
    now, seen = 0.0, []
    t.failure("e0", "5xx", now)
    for _ in range(5):
        until = t.health("e0").until
        seen.append(round(until - now, 3))
        now = until
        assert t.state("e0", now) == PROBING
        assert t.take_probe("e0", now)
        assert not t.take_probe("e0", now)  # one probe at a time
        assert t.failure("e0", "connect", now) is True
    assert seen == [0.1, 0.2, 0.4, 0.5, 0.5]


def test_an_answer_while_probing_recovers_one_while_ejected_does_not() -> None:
    t = OutcomeTracker(base_s=0.1, max_s=1.0)
    t.failure("e0", "429", 0.0)
    assert t.answered("e0", 0.05) is False  # a request sent before the ejection
    assert t.state("e0", 0.05) == EJECTED
    assert t.answered("e0", 0.2) is True
    assert t.state("e0", 0.2) == HEALTHY
    assert t.why("e0", 0.2) == ""
    assert t.answered("e0", 0.3) is False  # healthy already: nothing to tell


def test_failures_while_ejected_add_evidence_but_not_time() -> None:
    t = OutcomeTracker(base_s=0.1, max_s=1.0)
    assert t.failure("e0", "5xx", 0.0)
    until = t.health("e0").until
    assert t.failure("e0", "5xx", 0.05) is False
    assert t.health("e0").until == until
    assert t.why("e0", 2.0) == "5xx x2 in 2.0s"


def test_failing_again_soon_after_recovering_backs_off_longer_later_starts_over() -> None:
    t = OutcomeTracker(base_s=0.1, max_s=1.0, forget_s=5.0)
    t.failure("e0", "idle_timeout", 0.0)
    assert t.answered("e0", 0.2)
    t.failure("e0", "idle_timeout", 1.0)  # within forget_s of the last ejection
    assert t.health("e0").until == pytest.approx(1.2)
    assert t.answered("e0", 2.0)
    t.failure("e0", "idle_timeout", 20.0)
    assert t.health("e0").until == pytest.approx(20.1)


def test_capped_failure_records_evidence_without_ejecting() -> None:
    t = OutcomeTracker()
    assert t.failure("e0", "reset", 0.0, may_eject=False) is False
    assert t.state("e0", 0.0) == HEALTHY
    assert t.why("e0", 0.0) == "reset x1 in 0.0s"
    assert t.counters["capped"] == 1


def test_first_byte_bound_follows_what_the_engine_usually_takes() -> None:
    t = OutcomeTracker(first_byte_factor=4.0, first_byte_min_s=0.5, first_byte_max_s=10.0)
    assert t.first_byte_bound("e0") == FIRST_BYTE_UNANSWERED_S  # answered none: its pace unknown
    for _ in range(200):
        t.answered("e0", 0.0, first_byte_s=1.0)
    assert t.first_byte_bound("e0") == pytest.approx(4.0)
    for _ in range(200):
        t.answered("e0", 0.0, first_byte_s=9.0)
    assert t.first_byte_bound("e0") == 10.0  # the ceiling
    assert OutcomeTracker(first_byte_factor=0).first_byte_bound("e0") == 30.0


def test_a_lost_probe_is_replaced_after_the_longest_bound() -> None:
    t = OutcomeTracker(first_byte_min_s=0.5, first_byte_max_s=2.0)
    assert t.take_probe("e0", 0.0)
    assert not t.take_probe("e0", 1.9)
    assert t.take_probe("e0", 2.0)


def test_only_the_probes_own_end_frees_the_way_for_the_next_probe() -> None:
    """A probe named stalled goes on, and what other requests got says nothing of it:
    while it hangs, no back-off sends another (they piled up on a stalled engine)."""
    t = OutcomeTracker(base_s=0.1, max_s=1.0)
    t.failure("e0", "stall", 0.0, probe=False)
    assert t.take_probe("e0", 0.1)
    t.failure("e0", "stall", 0.2, probe=False)  # the probe's own stream is named stalled
    t.failure("e0", "idle_timeout", 0.5, probe=False)  # requests sent before it
    t.answered("e0", 0.55, probe=False)
    assert t.state("e0", 1.0) == PROBING  # its back-off ended ...
    assert not t.take_probe("e0", 1.0)  # ... but the probe in flight is still the one
    assert t.failure("e0", "idle_timeout", 1.0) is True  # its end: ejected for longer
    assert t.take_probe("e0", t.health("e0").until)


def test_an_unproven_probe_makes_the_next_wait_the_back_off() -> None:
    """A probe whose stream ended within what a stall lets through proves nothing: the
    engine stays probing, and the next probe waits its back-off, not the next request."""
    t = OutcomeTracker(base_s=0.1, max_s=1.0)
    t.failure("e0", "stall", 0.0, probe=False)
    assert t.take_probe("e0", 0.1)
    t.unproven("e0", 0.15)
    assert t.state("e0", 0.2) == PROBING
    assert not t.take_probe("e0", 0.2)
    assert t.take_probe("e0", 0.25)
    assert t.answered("e0", 0.3) is True
    assert t.state("e0", 0.3) == HEALTHY


@pytest.mark.parametrize(
    "kw",
    [
        {"base_s": 0},
        {"max_s": float("inf")},
        {"base_s": 2.0, "max_s": 1.0},
        {"first_byte_factor": -1},
        {"first_byte_min_s": 0},
        {"first_byte_min_s": 5.0, "first_byte_max_s": 1.0},
    ],
)
def test_bad_settings_are_refused(kw: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        OutcomeTracker(**kw)


def test_unknown_failure_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="kind must be one of"):
        OutcomeTracker().failure("e0", "ok", 0.0)
