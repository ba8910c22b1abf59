"""Streams that stop mid-way (redisbal.routing.stream_gaps): pure logic on a clock the
test passes."""

from __future__ import annotations

import pytest
from support.helpers import make_snapshot

from redisbal.barrier.snapshot import EngineCounts
from redisbal.errors import InvalidArgument
from redisbal.routing.router_core import RouterCore
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
    for t in (3.1, 3.12, 3.14, 3.16, 3.18):  # it flows again: named again if it stops again
        g.chunk(stuck, t)
    while t < 4.0:
        t += 0.02
        g.chunk(other, t)
    assert [e for e, _, _ in g.check(4.0)] == ["a"]


def test_only_a_stream_past_where_streams_stalled_flowed() -> None:
    """A short answer ends within the chunks a mid-stream stall lets through: it proves
    nothing. One that gets past that point does, and the point is forgotten."""
    g = StreamGaps(factor=10.0, min_s=0.5)
    flowing(g, "a", 0.0, 1.0)
    stuck = g.opened("a", 1.0)
    for t in (1.02, 1.04):  # 3 chunks, then nothing
        g.chunk(stuck, t)
    other = g.opened("b", 0.0)
    t = 0.0
    while t < 3.0:
        t += 0.02
        g.chunk(other, t)
    assert [e for e, _, _ in g.check(3.0)] == ["a"]
    short = g.opened("a", 3.0)
    g.chunk(short, 3.02)
    g.chunk(short, 3.04)
    g.closed(short)
    assert not g.flowed(short)  # 3 chunks: no more than the stalled stream got
    long = g.opened("a", 3.1)
    for t in (3.12, 3.14, 3.16):
        g.chunk(long, t)
    g.closed(long)
    assert g.flowed(long)
    assert g.flowed(short)  # the point is forgotten: it streams whole answers again


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
    flowing(g, "a", 0.0, 7.0, gap=1.0)
    assert g.bound("a") is None  # 7 gaps: too few to know its usual
    flowing(g, "a", 7.0, 8.0, gap=1.0)
    assert g.usual("a") == 1.0
    assert g.bound("a") == 2.0  # 10 x 1.0, capped
    s = g.opened("a", 2.0)
    g.closed(s)
    g.closed(s)
    assert g.open == 0
    with pytest.raises(InvalidArgument, match="factor"):
        StreamGaps(factor=0)
    with pytest.raises(InvalidArgument, match="in order"):
        StreamGaps(min_s=2.0, max_s=1.0)
    with pytest.raises(InvalidArgument, match="pace"):
        StreamGaps(pace=0.5)
    with pytest.raises(InvalidArgument, match="known"):
        StreamGaps(known=0)


# gaps between chunks of streams on vLLM servers starved of CPU (three on two cores)
STARVED = (0.6, 1.8, 0.5, 1.1, 0.9, 1.6, 0.7, 1.3, 0.5, 1.0, 1.7, 0.8)


def starved(g: StreamGaps, engines: tuple[str, ...], t0: float, t1: float) -> None:
    """Streams on ``engines`` from ``t0`` to ``t1``, each sending its first two chunks
    at once (the role chunk and the first token) and then one every 0.5-1.8 s,
    offset from each other, the gaps the same on each (checked every 0.1 s meanwhile):
    nothing may be named."""
    streams, due, k = {}, {}, {}
    for i, e in enumerate(engines):
        s = streams[e] = g.opened(e, t0 + 0.2 * i)
        g.chunk(s, t0 + 0.2 * i + 0.001)
        due[e], k[e] = t0 + 0.2 * i + STARVED[i], i
    t = t0
    while t < t1:
        t = round(t + 0.1, 6)
        for e in engines:
            if due[e] <= t:
                g.chunk(streams[e], due[e])
                k[e] += 1
                due[e] += STARVED[k[e] % len(STARVED)]
        assert g.check(t) == [], t
    for s in streams.values():
        g.closed(s)


def test_engines_all_starved_from_their_first_chunks_are_not_named() -> None:
    """The first gaps of a stream are no usual: the role chunk and the first token come
    together, and a bound learned from them (0.5 s) named every starved engine."""
    starved(StreamGaps(), ("a", "b", "c"), 0.0, 30.0)


def test_engines_that_all_turn_slow_after_a_fast_start_are_not_named() -> None:
    """Usual gaps learned while the host was idle (20 ms), then every engine starved
    at once: the others' streams are as slow as this one's, none flows at its pace."""
    g = StreamGaps()
    for e in ("a", "b", "c"):
        flowing(g, e, 0.0, 2.0)
    starved(g, ("a", "b", "c"), 2.0, 40.0)


def test_an_engine_in_a_long_step_is_slow_not_stalled_until_it_steps_without_chunks() -> None:
    """Its streams silent far beyond its usual while the others flow at their pace:
    while its reports say it has not stepped since its streams' latest chunk (a big
    prefill, a front end starved of CPU), it is slow; once they say it steps and its
    streams still get nothing (a hung output loop), it is stalled. Without reports of
    it (None), the gaps alone decide."""
    g = StreamGaps()
    flowing(g, "a", 0.0, 1.0)
    stuck = g.opened("a", 1.0)
    g.chunk(stuck, 1.02)
    other = g.opened("b", 0.0)
    steps = {"a": 1.02}  # when "a" last stepped, as its reports say

    t = 0.0
    while t < 3.0:
        t = round(t + 0.02, 6)
        g.chunk(other, t)
        steps["b"] = t
        assert g.check(t, steps.get) == [], t  # a long step: nothing since its chunk
    steps["a"] = 1.2  # the step of that chunk, its report late in coming
    assert g.check(t, steps.get) == []
    steps["a"] = 2.9  # it steps, and its streams get nothing
    assert [(e, s) for e, s, _ in g.check(t, steps.get)] == [("a", stuck)]

    g = StreamGaps()
    flowing(g, "a", 0.0, 1.0)
    g.chunk(g.opened("a", 1.0), 1.02)
    other = g.opened("b", 0.0)
    for i in range(1, 101):
        g.chunk(other, i * 0.02)
    assert [e for e, _, _ in g.check(2.0, lambda _e: None)] == ["a"]


def test_when_an_engine_last_stepped_is_the_age_of_its_counts_and_of_the_snapshot() -> None:
    """What the gateway passes as ``stepped``: a heartbeat without progress keeps its
    counts' time, so their age grows through a long step; an engine the snapshot
    holds no report of is not known."""
    clock = [100.0]
    core = RouterCore(clock=lambda: clock[0])
    counts = {
        "a": EngineCounts(0, 1, None, 0, 1, reported_ms=1_000_000 - 300),
        "b": EngineCounts(0, 1, None, 0, 1, reported_ms=1_000_000),
    }
    assert core.apply_snapshot(make_snapshot(counts, time_ms=1_000_000))
    clock[0] += 0.2
    assert core.stepped_s("a") == pytest.approx(0.5)
    assert core.stepped_s("b") == pytest.approx(0.2)
    assert core.stepped_s("c") is None
