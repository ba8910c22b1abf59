"""Streams that stop mid-way (redisbal.routing.stream_gaps): pure logic on a clock the
test passes."""

from __future__ import annotations

import pytest

from redisbal.errors import InvalidArgument
from redisbal.routing.stream_gaps import StreamGaps


def flowing(g: StreamGaps, engine: str, t0: float, t1: float, gap: float = 0.02) -> None:
    """A stream of ``engine`` with a chunk every ``gap`` from ``t0`` to ``t1``, ended."""
    s = g.opened(engine, t0)
    t = t0
    while t + gap <= t1:
        t += gap
        g.chunk(s, t)
    g.closed(s)


def test_an_engine_whose_streams_under_way_went_silent_while_others_flow_is_named_once() -> None:
    g = StreamGaps(factor=10.0, min_s=0.5)
    flowing(g, "a", 0.0, 1.0)  # its usual gap: 0.02 s
    stuck = g.opened("a", 1.0)
    g.chunk(stuck, 1.02)
    other = g.opened("b", 0.0)
    t = 0.0
    while t < 3.0:
        t += 0.02
        g.chunk(other, t)
        if t < 1.5:
            assert g.check(t) == [], t  # within a's bound (0.5 s): nothing yet
    named = g.check(3.0)
    assert [(e, s) for e, s, _ in named] == [("a", stuck)]
    assert g.check(3.0) == []  # once per stall
    g.chunk(stuck, 3.1)  # it flows again: named again if it stops again
    g.chunk(other, 4.0)
    assert [e for e, _, _ in g.check(4.0)] == ["a"]


def test_no_engine_is_named_while_every_engine_is_quiet() -> None:
    """The caller's loop or the host stalled everything: no evidence against any one."""
    g = StreamGaps(min_s=0.5)
    for e in ("a", "b"):
        flowing(g, e, 0.0, 1.0)
        g.chunk(g.opened(e, 1.0), 1.02)
    assert g.check(5.0) == []


def test_new_streams_first_chunks_do_not_hide_a_stall() -> None:
    """An engine that stalls mid-way still sends each new stream's first chunks: only the
    streams under way for its bound count."""
    g = StreamGaps(min_s=0.5)
    flowing(g, "a", 0.0, 1.0)
    stuck = g.opened("a", 1.0)
    other = g.opened("b", 0.0)
    for i in range(1, 31):
        t = 1.0 + i * 0.05
        g.opened("a", t)  # a new stream every 50 ms, its first chunk and nothing more
        g.chunk(other, t)
    assert [(e, s) for e, s, _ in g.check(2.5)] == [("a", stuck)]


def test_closed_streams_and_bounds() -> None:
    g = StreamGaps(factor=10.0, min_s=0.5, max_s=2.0)
    assert g.bound("a") is None  # no gap known: never named
    flowing(g, "a", 0.0, 1.0, gap=1.0)
    assert g.bound("a") == 2.0  # 10 x 1.0, capped
    s = g.opened("a", 2.0)
    g.closed(s)
    g.closed(s)
    assert g.open == 0
    with pytest.raises(InvalidArgument, match="factor"):
        StreamGaps(factor=0)
    with pytest.raises(InvalidArgument, match="in order"):
        StreamGaps(min_s=2.0, max_s=1.0)
