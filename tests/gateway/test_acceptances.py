"""Which engines accepted which credentials and model (redisbal.gateway.retry.Acceptances):
the evidence that a refusal is an engine's fault, on a clock the test moves."""

from __future__ import annotations

import pytest

from redisbal.errors import InvalidArgument
from redisbal.gateway.retry import Acceptances


def test_a_refusal_counts_against_an_engine_only_when_another_accepted_the_same_lately() -> None:
    now = [0.0]
    acc = Acceptances(window_s=60.0, max_keys=2, clock=lambda: now[0])
    good, revoked = Acceptances.key("Bearer k", "m"), Acceptances.key("Bearer x", "m")
    assert good != revoked != Acceptances.key("Bearer k", "other")
    assert not acc.elsewhere(good, "0")  # nobody accepted it: the client's mistake
    acc.accepted(good, "0")
    assert not acc.elsewhere(good, "0")  # only the engine itself did
    assert acc.elsewhere(good, "1")
    assert not acc.elsewhere(revoked, "1")
    now[0] = 61.0
    assert not acc.elsewhere(good, "1")  # too long ago
    acc.accepted(good, "0")
    acc.accepted(Acceptances.key("a", "m"), "0")
    acc.accepted(Acceptances.key("b", "m"), "0")  # the least recently accepted goes
    assert not acc.elsewhere(good, "1")
    with pytest.raises(InvalidArgument, match="window_s"):
        Acceptances(window_s=0)
    with pytest.raises(InvalidArgument, match="max_keys"):
        Acceptances(max_keys=0)
