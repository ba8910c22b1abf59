"""Engine reporters on a real Redis: validation, tick mode, heartbeat, each step sent,
graceful leave, and Redis outages reported as a status instead of an exception."""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

import orjson
import pytest
import redis
from support.helpers import Barrier, Blocking, await_until, keys_of, score, server_ms, wait_until

from redisbal import AsyncReporter, Counts, InvalidName, InvalidReport, Reporter
from redisbal.errors import InvalidArgument
from redisbal.keys import DeploymentKeys
from redisbal.sim.embedded import RedisServer


@pytest.fixture
def bar(r: redis.Redis, keys: DeploymentKeys) -> Barrier:
    b = Barrier(r, keys)
    b.configure()
    return b


GOOD = {"step": 3, "waiting": 1, "running": 2, "wave": 0}
BAD_REPORTS: list[tuple[str, dict[str, Any]]] = [
    *[("step", {"step": v}) for v in (-1, 1.5, True, 2**32, "3", None)],
    *[("waiting", {"waiting": v}) for v in (-1, 2.0, True, 10**9 + 1, 10**15, "1", None)],
    *[("running", {"running": v}) for v in (-1, 2.0, False, 10**9 + 1, "1", None)],
    *[("wave", {"wave": v}) for v in (-1, 2**20, 0.0, True, "0")],
    *[
        ("kv_usage", {"kv_usage": v})
        for v in (math.nan, math.inf, -math.inf, -0.01, 1.01, True, "0.5", [0.5])
    ],
    *[
        ("admitted", {"admitted": v})
        for v in ([-1], [1.5], "1,2", b"12", [True], [0] * 4097, [10**15], [None], 5)
    ],
    *[("admitted_total", {"admitted_total": v}) for v in (-1, 1.5, True, 10**15, "3", [1])],
]


def test_every_bad_field_raises_naming_it_and_stores_nothing(
    redis_url: str, keys: DeploymentKeys, bar: Barrier
) -> None:
    rep = Reporter(redis_url, keys.deployment, "e0", heartbeat=False)
    try:
        bar.register("e1")  # keeps the barrier open so that state is rich but stable
        assert rep.report(Counts(**GOOD), wait=True).accepted
        assert rep.report(
            Counts(step=3, waiting=4, running=5, kv_usage=0.5, admitted=[1, 2]), wait=True
        ).accepted
        before = bar.dump()
        for field, change in BAD_REPORTS:
            with pytest.raises(InvalidReport) as exc:
                rep.report({**GOOD, **change})
            assert field in str(exc.value), f"{change}: {exc.value}"
            assert bar.dump() == before, f"{change} changed Redis"
        with pytest.raises(TypeError, match="colour"):
            rep.report(Counts(**GOOD, colour=1))  # type: ignore[call-arg]
        assert bar.dump() == before
        assert rep.report(Counts(step=4, waiting=0, running=0), wait=True).accepted  # still usable
    finally:
        rep.close()


@pytest.mark.parametrize(
    ("kwargs", "what"),
    [
        ({"deployment": "a b"}, "deployment"),
        ({"deployment": "x{y}"}, "deployment"),
        ({"deployment": "d" * 65}, "deployment"),
        ({"engines": "{e0}"}, "engine_id"),
        ({"engines": "e 0"}, "engine_id"),
        ({"engines": ""}, "engine_id"),
        ({"engines": 3}, "engine_id"),
    ],
)
def test_bad_names_raise_before_any_key_exists(
    r: redis.Redis, redis_url: str, deployment: str, kwargs: dict[str, Any], what: str
) -> None:
    args = {"deployment": deployment, "engines": "e0", **kwargs}
    names = [str(args["deployment"]), str(args["engines"])]
    before = keys_of(r, names)
    for cls in (Reporter, AsyncReporter):
        with pytest.raises(InvalidName, match=what):
            cls(redis_url, heartbeat=False, **args)
    assert keys_of(r, names) == before


def test_mode_is_validated(redis_url: str, keys: DeploymentKeys) -> None:
    with pytest.raises(InvalidReport, match="mode"):
        Reporter(redis_url, keys.deployment, "e0", mode="sometimes", heartbeat=False)
    rep = Reporter(redis_url, keys.deployment, "e0", mode="tick", heartbeat=False)
    try:
        with pytest.raises(InvalidReport, match="step"):
            rep.report(Counts(step=5, waiting=1, running=1))
    finally:
        rep.close()


def test_tick_mode_tags_with_the_server_tick_and_idle_engines_keep_the_barrier_moving(
    r: redis.Redis, redis_url: str, keys: DeploymentKeys, bar: Barrier
) -> None:
    """Independent engines: the barrier tags each report floor(server_ms / tick_ms), and
    the heartbeat reports every tick, so snapshots keep coming while nothing changes."""
    bar.configure(tick_ms=50)
    reps = [
        Reporter(redis_url, keys.deployment, f"e{i}", mode="tick", heartbeat_s=0.05)
        for i in range(2)
    ]
    try:
        for i, rep in enumerate(reps):
            before = server_ms(r) // 50
            res = rep.report(Counts(waiting=i + 1, running=10 * (i + 1)), wait=True)
            after = server_ms(r) // 50
            # the tick number is the (wave, step) pair's single score: wave * 2^32 + step
            assert res.accepted and before <= score(res.wave, res.step) <= after

        def both_in_snapshot() -> bool:
            snap = bar.snapshot()
            return snap is not None and set(snap.engines) == {"e0", "e1"}

        wait_until(both_in_snapshot, timeout=5)
        first = bar.snapshot()
        assert first is not None
        assert {e: (c.waiting, c.running) for e, c in first.engines.items()} == {
            "e0": (1, 10),
            "e1": (2, 20),
        }
        # idle for a while: the heartbeats still move the barrier forward
        wait_until(lambda: bar.snapshot().step >= first.step + 4, timeout=5)  # type: ignore[union-attr]

        snap = bar.snapshot()
        assert snap is not None and snap.version > first.version
        assert score(snap.wave, snap.step) <= server_ms(r) // 50, "a tick ahead of the clock"
    finally:
        for rep in reps:
            rep.close()


def test_heartbeat_keeps_an_idle_engine_alive_past_dead_after(
    redis_url: str, keys: DeploymentKeys, bar: Barrier
) -> None:
    # dead_after 20 heartbeats: a loaded machine may pause the heartbeat thread a while
    bar.configure(dead_after_ms=1000)
    beating = Reporter(redis_url, keys.deployment, "e0", heartbeat_s=0.05)
    silent = Reporter(redis_url, keys.deployment, "e1", heartbeat=False)
    try:
        assert beating.report(Counts(step=1, waiting=0, running=0), wait=True).accepted
        assert silent.report(Counts(step=1, waiting=0, running=0), wait=True).accepted
        started = time.monotonic()
        # expired by a reap, or on the way by one of e0's heartbeat reports
        wait_until(lambda: bar.reap() and "e1" not in bar.members(), timeout=5)
        assert bar.counter("expired") == 1
        while time.monotonic() - started < 2.0:  # twice dead_after
            assert bar.reap()[1] == [] and "e0" in bar.members()
            time.sleep(0.05)
        assert set(bar.members()) == {"e0"}
        snap = bar.snapshot()
        assert snap is not None and set(snap.engines) == {"e0"} and snap.gone == {"e1": "expired"}
    finally:
        beating.close()
        silent.close()


def test_register_is_idempotent_and_close_leaves(
    redis_url: str, keys: DeploymentKeys, bar: Barrier
) -> None:
    with Reporter(redis_url, keys.deployment, "e0", heartbeat=False) as rep:
        assert rep.flush(5)
        assert "e0" in bar.members(), "constructing a reporter registers its engine"
        assert rep.register(wait=True) is False  # a retry is harmless
    with Reporter(redis_url, keys.deployment, "e0", heartbeat=False, register=False) as rep:
        assert rep.flush(5)
        assert "e0" not in bar.members()
        assert rep.register() is None  # handed over, not waited for
        assert rep.flush(5) and "e0" in bar.members()
        assert rep.register(wait=True) is False
        assert rep.report(Counts(step=1, waiting=0, running=0), wait=True).accepted
        # older than the newest handed over: refused at once, without a round trip
        assert rep.report(Counts(step=0, waiting=0, running=0)).status == "stale"
        assert rep.stats().stale == 1
    assert "e0" not in bar.members()
    assert bar.counter("left") == 2


async def test_async_reporter_reports_every_step_and_leaves(
    r: redis.Redis, redis_url: str, keys: DeploymentKeys, bar: Barrier
) -> None:
    bar.register("other")  # never reports: no snapshot, so the history is never pruned
    rep = AsyncReporter(redis_url, keys.deployment, "e0", heartbeat=False)
    res = await rep.report(Counts(step=1, waiting=2, running=3, kv_usage=0.25), wait=True)
    assert (res.status, res.version, res.wave, res.step) == ("accepted", 0, 0, 1)
    # report_nowait never waits; three calls before the sender runs: while Redis answers
    # every step reaches it, in order (the barrier's cut of each step needs its counts)
    for step in (2, 3, 4):
        rep.report_nowait(Counts(step=step, waiting=step, running=step))
    await asyncio.sleep(0)
    await await_until(lambda: bar.history("e0")[0] == 4, 10, "the latest report sent")
    assert bar.history("e0") == [4, 3, 2, 1], "a step was coalesced while Redis answered"
    assert rep.stats().coalesced == 0 and rep.stats().sent == 4
    with pytest.raises(InvalidReport, match="waiting"):
        rep.report_nowait(Counts(step=5, waiting=-1, running=0))
    await rep.aclose()
    assert "e0" not in bar.members()


async def test_async_aclose_without_leave_flushes_the_pending_report(
    r: redis.Redis, redis_url: str, keys: DeploymentKeys, bar: Barrier
) -> None:
    rep = AsyncReporter(redis_url, keys.deployment, "e0", heartbeat=False)
    rep.report_nowait(Counts(step=7, waiting=1, running=1))
    await rep.aclose(leave=False)
    assert bar.history("e0") == [7]
    assert "e0" in bar.members()


@pytest.mark.parametrize("cls", [Reporter, AsyncReporter])
def test_reporter_returns_unavailable_when_redis_is_down(
    fresh_server: RedisServer, cls: type[Reporter | AsyncReporter]
) -> None:
    """A Redis outage never raises into the engine loop; after a restart the engine is
    back in the new epoch with its next report (both twins, one flow)."""
    rep = Blocking(cls(fresh_server.url, "dep", "e0", heartbeat=False, backoff_s=0.2))
    try:
        assert rep.report(Counts(step=1, waiting=1, running=1), wait=True).accepted
        old_epoch = fresh_server.client().get(DeploymentKeys("dep").epoch)
        fresh_server.kill()
        assert rep.report(Counts(step=2, waiting=1, running=1), wait=True).status == "unavailable"
        assert rep.report(Counts(step=3, waiting=1, running=1), wait=True).status == "unavailable"
        assert rep.report(Counts(step=4, waiting=4, running=1)).status == "queued"  # never waits
        assert rep.register(wait=True) is False
        assert rep.stats().unavailable >= 2
        assert rep.flush(0.3) is False  # nothing can be delivered yet
        fresh_server.start()
        assert rep.flush(10), rep.stats()
        c = fresh_server.client()
        assert Barrier(c, DeploymentKeys("dep")).history("e0")[0] == 4
        assert c.get(DeploymentKeys("dep").epoch) not in (None, old_epoch)
        assert rep.stats().coalesced >= 1  # steps 2 and 3 were replaced by newer counts
        c.close()
    finally:
        rep.close()  # leave is attempted and fails quietly if Redis is down


@pytest.mark.parametrize("before", [True, False], ids=["before-and-after", "after-only"])
def test_engine_sim_reports_a_step_before_running_it(
    r: redis.Redis, redis_url: str, keys: DeploymentKeys, before: bool
) -> None:
    """`redisbal engine-sim` reports right before each step (vLLM >= PR 41626), with
    that step's tag and the requests it took from its input queue; with
    --report-after-step-only the step shows up only once it has ended."""
    from redisbal.sim.engine_sim import EngineSimRunner
    from redisbal.sim.model import EngineParams
    from redisbal.sim.transport import NO_BURST, RequestMsg, SimKeys

    params = EngineParams(base_step_s=60.0)  # one long step (stop() ends it): look inside it
    runner = EngineSimRunner(
        redis_url, keys.deployment, ["e0"], params=params, report_before_step=before
    )

    def newest_step_line() -> tuple[int, dict[str, Any]] | None:
        rec = r.hget(keys.reports, "e0")
        lines = rec.decode().split("\n")[1:] if rec else []
        if not lines:
            return None
        score_s, _ms, body = lines[0].split("\t", 2)
        return int(score_s), orjson.loads(body)

    async def scenario() -> tuple[int, dict[str, Any]] | None:
        task = asyncio.create_task(runner.run(duration_s=120.0))
        await asyncio.to_thread(wait_until, lambda: r.hexists(keys.reports, "e0"), 10)
        msg = RequestMsg(client_index=0, rid=1, burst=NO_BURST, output_len=50)
        queue = SimKeys(keys.deployment).requests("e0")
        t0 = time.monotonic()
        r.rpush(queue, msg.encode())
        # the engine pulls it and starts its 60 s step (ending >= t0 + 60): look inside it
        await asyncio.to_thread(wait_until, lambda: r.llen(queue) == 0, 10, "the pull")
        if before:
            await asyncio.to_thread(
                wait_until, lambda: (x := newest_step_line()) and x[0] > 0, 10, "a step report"
            )
        seen = newest_step_line()
        inside = time.monotonic() - t0 < 59.9  # a hang guard: the step is far from over
        runner.stop()
        await task
        assert inside, "the machine stalled for a minute: the step may have ended"
        return seen

    seen = asyncio.run(scenario())
    if before:
        assert seen is not None
        step, body = seen
        assert step == 2**32 + 1  # the first wave's first step: score = wave * 2^32 + step
        assert (body["wave"], body["step"], body["waiting"], body["running"]) == (1, 1, 1, 0)
        assert body["adm"] == [1]
    else:  # still the report the runner makes at start: the step shows up at its end
        assert seen is not None
        assert (seen[0], seen[1]["wave"], seen[1]["step"]) == (0, 0, 0)


def test_stats_and_metrics_count_what_the_sender_did(
    redis_url: str, keys: DeploymentKeys, bar: Barrier
) -> None:
    """Reporter counters (attributes and the Prometheus collector) say what was queued,
    sent, coalesced and refused; nothing is counted twice."""
    from prometheus_client import CollectorRegistry

    from redisbal.ops.client_metrics import ReporterMetrics

    registry = CollectorRegistry()
    metrics = ReporterMetrics(registry)
    bar.register("other")  # holds the barrier: no snapshot, no pruning
    rep = metrics.bind(Reporter(redis_url, keys.deployment, "e0", heartbeat=False))
    try:
        assert rep.report(Counts(step=1, waiting=1, running=1), wait=True).accepted
        assert rep.report(Counts(step=0, waiting=1, running=1)).status == "stale"  # refused at once
        for step in range(2, 40):
            assert rep.report(Counts(step=step, waiting=step, running=1)).status == "queued"
        assert rep.flush(5)
        st = rep.stats()
        assert st.queued == 39 and st.stale == 1 and st.errors == st.unavailable == 0
        assert st.sent + st.coalesced == st.queued and st.sent == st.accepted
        assert bar.history("e0")[0] == 39  # the newest counts always arrive
        label = {"deployment": keys.deployment, "engine": "e0"}
        for name in ("queued", "sent", "coalesced", "stale"):
            value = registry.get_sample_value(f"redisbal_reporter_reports_{name}_total", label)
            assert value == getattr(st, name), name
    finally:
        rep.close()


def test_one_sender_carries_several_engines_in_one_pipeline(
    redis_url: str, keys: DeploymentKeys, bar: Barrier
) -> None:
    """Reporters sharing a sender: their reports travel together (a pipeline of report
    calls, FCALL on Redis 7, EVALSHA on 6.2) and each engine's newest counts land."""
    from redisbal.reporting.sender import ReportSender

    sender = ReportSender(redis_url, threaded=True)
    reps = [
        Reporter(redis_url, keys.deployment, f"e{i}", sender=sender, heartbeat=False)
        for i in range(3)
    ]

    async def hand_over(step: int) -> None:
        # on the sender's own loop, with no await between them: the three reports are
        # all waiting when its task runs next, whatever the machine's speed
        for rep in reps:
            rep.report(Counts(step=step, waiting=step, running=1))

    assert sender.background is not None
    try:
        for step in range(1, 30):
            sender.background.run(hand_over(step), 5)
        assert all(rep.flush(5) for rep in reps)
        assert [bar.history(f"e{i}")[0] for i in range(3)] == [29, 29, 29]
        assert all(rep.stats().errors == 0 and rep.stats().sent >= 1 for rep in reps)
        assert sender.batches < sum(rep.stats().sent for rep in reps)  # some went together
        snap = bar.snapshot()
        assert snap is not None and snap.step == 29 and not snap.forced
    finally:
        for rep in reps:
            rep.close()
        sender.close()


@pytest.mark.parametrize("cls", [Reporter, AsyncReporter], ids=["sync", "async"])
def test_url_is_registered_kept_after_a_state_loss_and_removed_on_leave(
    r: redis.Redis,
    redis_url: str,
    keys: DeploymentKeys,
    cls: type,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``url=`` is where gateways send the engine's requests: the sender writes it to
    the deployment's urls hash, again every URL_REFRESH_S (so a flushed or restarted
    Redis gets it back), and a graceful leave removes it. A bad URL raises at once."""
    from redisbal.reporting import sender

    monkeypatch.setattr(sender, "URL_REFRESH_S", 0.2)
    with pytest.raises(ValueError, match="url"):
        cls(redis_url, keys.deployment, "e0", url="ftp://nowhere")
    rep = Blocking(cls(redis_url, keys.deployment, "e0", url="http://127.0.0.1:8400"))
    try:
        rep.register()
        steps = iter(range(1, 10**6))

        def url_after_a_step() -> bool:
            # (a report waited for: the asyncio twin's sender runs while it is awaited)
            rep.report(Counts(step=next(steps), waiting=0, running=1), wait=True)
            return r.hget(keys.urls, "e0") == b"http://127.0.0.1:8400"

        wait_until(url_after_a_step, 5, "the url written")
        r.delete(keys.urls)  # the state lost
        wait_until(url_after_a_step, 5, "the url written again")
    finally:
        rep.close()
    assert r.hget(keys.urls, "e0") is None, "a graceful leave keeps the url"


@pytest.mark.parametrize("cls", [Reporter, AsyncReporter], ids=["sync", "async"])
def test_running_cap_is_declared_kept_after_a_state_loss_and_removed_on_leave(
    r: redis.Redis,
    redis_url: str,
    keys: DeploymentKeys,
    cls: type,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``running_cap=`` is declared once per engine in the deployment's running_caps
    hash (never in a report), written again as the URL is, and removed on a graceful
    leave; ``add()`` may give an engine its own. Routers read it with running_caps.fetch."""
    from redisbal import running_caps
    from redisbal.reporting import sender

    monkeypatch.setattr(sender, "URL_REFRESH_S", 0.2)
    rep = Blocking(cls(redis_url, keys.deployment, "e0", running_cap=256))
    rep.add("e1", running_cap=8)
    rep.add("e2")  # the reporter's own
    try:
        rep.register()
        steps = iter(range(1, 10**6))

        def caps_after_a_step() -> bool:
            counts = {e: Counts(step=next(steps), waiting=0, running=1) for e in rep.engines}
            for e, c in counts.items():
                rep.report(c, engine=e, wait=True)
            return running_caps.fetch_sync(r, keys) == {"e0": 256, "e1": 8, "e2": 256}

        wait_until(caps_after_a_step, 5, "the caps written")
        r.delete(keys.running_caps)  # the state lost
        wait_until(caps_after_a_step, 5, "the caps written again")
    finally:
        rep.close()
    assert r.hlen(keys.running_caps) == 0, "a graceful leave keeps a cap"


@pytest.mark.parametrize("cap", [0, -1, 2.0, True, "8", 10**7], ids=lambda v: repr(v)[:12])
def test_a_bad_running_cap_is_a_one_line_error_before_any_key(
    r: redis.Redis, redis_url: str, keys: DeploymentKeys, cap: object
) -> None:
    with pytest.raises(InvalidArgument, match="running_cap") as exc:
        Reporter(redis_url, keys.deployment, "e0", running_cap=cap)
    assert "\n" not in str(exc.value)
    assert r.exists(*keys.all_keys()) == 0


def test_running_caps_read_back_skips_what_another_client_wrote_badly(
    r: redis.Redis, keys: DeploymentKeys, caplog: pytest.LogCaptureFixture
) -> None:
    from redisbal import running_caps

    bad = {"zero": "0", "neg": "-3", "x y": "8", "f": "2.5", b"e\xff": "8", "bin": b"\xff8"}
    r.hset(keys.running_caps, mapping={"ok": "64", **bad})  # (the last two: not UTF-8)
    assert running_caps.fetch_sync(r, keys) == {"ok": 64}
    assert len([m for m in caplog.messages if "ignoring a bad entry" in m]) == 6
