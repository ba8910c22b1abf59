"""Pure-logic tests of the balance benchmark: metric computations, gap closed and its
noise flag, schedules, and the vLLM baselines' documented timing (no Redis, fast)."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from redisbal.barrier.snapshot import Snapshot
from redisbal.bench.balance import (
    burst_max_over_mean,
    gap_closed,
    gap_within_noise,
    load_imbalance,
    lockstep_efficiency,
    makespan,
    percentile,
    spread,
)
from redisbal.bench.oracle import OraclePolicy, World
from redisbal.bench.scenarios import Scenario, default_scenarios, make_schedule
from redisbal.bench.vllm import (
    VllmCoordinatorEmulation,
    VllmCoordinatorModel,
    compat_snapshot_json,
    reports_before_step,
    vllm_model_for,
)
from redisbal.keys import DeploymentKeys
from redisbal.routing.router_core import RouterCore
from redisbal.sim.model import EngineParams, SimEngine, SimRequest

# -- metrics ----------------------------------------------------------------------------------


def test_load_imbalance_time_weighted_and_skips_low_mean() -> None:
    times = [0.0, 0.01, 0.03, 0.04]
    loads = [
        [2.0, 2.0],  # balanced: 0, weight 0.01
        [3.0, 1.0],  # (3-2)/2 = 0.5, weight 0.02
        [0.0, 1.0],  # mean 0.5 < 1: skipped
        [4.0, 0.0],  # (4-2)/2 = 1.0, weight = median gap 0.01
    ]
    got = load_imbalance(times, loads)
    assert got == pytest.approx((0.0 * 0.01 + 0.5 * 0.02 + 1.0 * 0.01) / 0.04)


def test_load_imbalance_ignores_dead_engines_and_empty_runs() -> None:
    assert load_imbalance([0.0, 0.01], [[2.0, math.nan], [2.0, math.nan]]) == 0.0
    assert load_imbalance([], []) == 0.0
    assert load_imbalance([0.0], [[0.0, 0.0]]) == 0.0
    with pytest.raises(ValueError):
        load_imbalance([0.0], [])


def test_lockstep_efficiency() -> None:
    assert lockstep_efficiency([[4, 4], [4, 2], [0, 0]]) == pytest.approx((1.0 + 0.75) / 2)
    assert lockstep_efficiency([]) == 1.0


def test_burst_max_over_mean_counts_idle_engines() -> None:
    assert burst_max_over_mean([[2, 2, 2, 2]]) == 1.0
    assert burst_max_over_mean([[4, 0, 0, 0], [2, 2, 2, 2]]) == pytest.approx((4.0 + 1.0) / 2)
    assert burst_max_over_mean([[0, 0]]) == 1.0


def test_percentile_and_makespan() -> None:
    xs = list(range(101))
    assert percentile(xs, 99) == pytest.approx(99.0)
    assert percentile([1.0, 2.0], 50) == pytest.approx(1.5)
    assert percentile([], 99) == 0.0
    assert makespan([(0.0, 2.0), (3.0, 4.0)]) == pytest.approx(1.5)


def test_gap_closed_signs() -> None:
    assert gap_closed(2.0, 1.0, 1.0) == pytest.approx(1.0)
    assert gap_closed(2.0, 1.5, 1.0) == pytest.approx(0.5)
    assert gap_closed(2.0, 0.5, 1.0) == pytest.approx(1.5)  # better than the oracle
    assert gap_closed(2.0, 3.0, 1.0) == pytest.approx(-1.0)  # worse than 21617
    assert gap_closed(1.0, 0.5, 1.0) is None  # no gap to close


def test_gap_within_noise_flags_small_gaps() -> None:
    assert gap_within_noise([1.0, 1.2, 1.1], [1.05, 1.0, 1.1]) is True
    assert gap_within_noise([2.0, 2.1, 2.05], [1.0, 1.05, 1.1]) is False
    assert gap_within_noise([2.0], [1.0]) is None
    s = spread([1.0, 2.0, 3.0])
    assert (s.mean, s.lo, s.hi, s.range) == (2.0, 1.0, 3.0, 2.0)
    assert s.std == pytest.approx(1.0)


# -- schedules --------------------------------------------------------------------------------


def test_schedule_is_a_function_of_the_seed() -> None:
    sc = default_scenarios(quick=True)["burst"]
    a, b, c = make_schedule(sc, 1), make_schedule(sc, 1), make_schedule(sc, 2)
    assert a == b
    assert a != c
    assert len(a) == 2 * round(1.5 * 32 * 64)  # two bursts of 1.5x capacity
    first = [x for x in a if x.group == 0]
    assert max(x.t for x in first) < 0.05  # within 50 ms
    assert min(x.t for x in a if x.group == 1) >= 3.0  # every 3 s


def test_skew_schedule_gives_half_to_api_server_zero() -> None:
    sc = default_scenarios(quick=True)["skew"]
    arr = make_schedule(sc, 3)
    share = sum(1 for x in arr if x.client == 0) / len(arr)
    assert 0.47 < share < 0.53
    eq = make_schedule(default_scenarios(quick=True)["burst"], 3)
    assert 0.10 < sum(1 for x in eq if x.client == 0) / len(eq) < 0.15


def test_poisson_schedule_rate_matches_load() -> None:
    sc = Scenario("steady", traffic="poisson", load=0.9, duration_s=4.0)
    arr = make_schedule(sc, 1)
    assert all(0 <= x.t < 4.0 for x in arr)
    assert len(arr) > 1000


# -- the vLLM coordinator emulation -------------------------------------------------------------


def _counts(pub: tuple[float, dict]) -> dict[str, tuple[int, int]]:
    return {e: (c.waiting, c.running) for e, c in pub[1].items()}


def test_vllm_pre_publishes_latest_counts_every_100ms_while_changing() -> None:
    m = VllmCoordinatorModel(buffered=False)
    pubs = m.on_stats(0.0, "a", 1, 0, 0)
    for k in range(1, 60):  # a changed message every 10 ms for 600 ms
        pubs += m.on_stats(k * 10.0, "a", k + 1, k, 0)
    times = [p[0] for p in pubs]
    assert times[0] == 0.0  # the first poll publishes at once (nothing published yet)
    assert [b - a for a, b in itertools.pairwise(times)] == [100.0] * (len(times) - 1)
    # each push carries the counts of the latest message before it
    assert all(_counts(p) == {"a": (int(p[0] / 10), 0)} for p in pubs)


def test_vllm_idle_publishes_every_5s() -> None:
    m = VllmCoordinatorModel(buffered=False)
    m.on_stats(0.0, "a", 1, 1, 1)
    times = [p[0] for p in m.advance(20_000.0)]
    assert times == [0.0, 5000.0, 10000.0, 15000.0]


def test_vllm_21617_pushes_the_previous_steps_copy_first() -> None:
    m = VllmCoordinatorModel(buffered=True)
    m.on_stats(0.0, "a", 1, 1, 0)
    m.on_stats(1.0, "b", 1, 2, 0)
    pubs = m.advance(400.0)  # publishes step 1, then goes quiet
    assert _counts(pubs[-1]) == {"a": (1, 0), "b": (2, 0)}
    m.on_stats(450.0, "b", 1, 3, 0)  # a same-step refresh: stats changed
    # step 2 begins: a reports first; the coordinator keeps a copy as of step 1
    m.on_stats(500.0, "a", 2, 10, 0)
    pubs = m.advance(700.0)
    # the copy goes out at once (no 50 ms wait when a copy is pending)
    assert [p[0] for p in pubs] == [500.0, 600.0]
    assert _counts(pubs[0]) == {"a": (1, 0), "b": (3, 0)}  # a's step-2 counts not in it
    assert _counts(pubs[1]) == {"a": (10, 0), "b": (3, 0)}  # then the latest


def test_vllm_21617_starves_while_messages_keep_coming() -> None:
    # with no copy pending, a poll waits at least 50 ms for silence: a stream of
    # same-step messages every 10 ms never lets it publish (vLLM's behaviour)
    m = VllmCoordinatorModel(buffered=True)
    m.on_stats(0.0, "a", 1, 0, 0)
    m.advance(1.0)
    pubs = []
    for k in range(1, 100):
        pubs += m.on_stats(k * 10.0, "a", 1, k, 0)
    assert pubs == []
    assert _counts(m.advance(990.0 + 51.0)[0]) == {"a": (99, 0)}


def test_vllm_21617_waits_at_least_50ms_without_a_pending_copy() -> None:
    m = VllmCoordinatorModel(buffered=True, min_wait_ms=50.0)
    m.on_stats(0.0, "a", 1, 1, 0)
    m.advance(1000.0)  # publishes; stats no longer changed
    m.on_stats(2000.0, "a", 1, 2, 0)  # same step: no copy pending
    # elapsed since the last publish >> 100 ms, but the poll still waits 50 ms
    assert m.advance(2049.0) == []
    assert len(m.advance(2051.0)) == 1
    pre = VllmCoordinatorModel(buffered=False)
    pre.on_stats(0.0, "a", 1, 1, 0)
    pre.advance(1000.0)
    pre.on_stats(2000.0, "a", 1, 2, 0)
    assert len(pre.advance(2001.0)) == 1  # before 21617: at once


def test_vllm_latest_keeps_50ms_wait_only_in_lockstep() -> None:
    assert vllm_model_for("vllm-latest", "lockstep").min_wait_ms == 50.0
    assert vllm_model_for("vllm-latest", "independent").min_wait_ms == 0.0
    assert vllm_model_for("vllm-latest", "independent").buffered
    assert not vllm_model_for("vllm-pre", "lockstep").buffered
    with pytest.raises(ValueError):
        vllm_model_for("redisbal", "lockstep")


def test_emulation_extracts_only_changed_counts_in_time_order() -> None:
    model = VllmCoordinatorModel(buffered=False)
    emu = VllmCoordinatorEmulation(None, DeploymentKeys("d"), model)
    raw = {
        b"a": b'2\t{"waiting":1,"running":2,"t":20}\n1\t{"waiting":1,"running":1,"t":10}',
        b"b": b'1\t{"waiting":0,"running":0,"t":15}',
    }
    msgs = emu.extract(raw)
    assert [(m[0], m[1]) for m in msgs] == [(10.0, "a"), (15.0, "b"), (20.0, "a")]
    # a heartbeat with the same counts is not a message (vLLM sends on change only)
    raw[b"a"] = b'3\t{"waiting":1,"running":2,"t":40}\n' + raw[b"a"]
    assert emu.extract(raw) == []
    # the record layout with a head line and a report time field is read too
    raw[b"c"] = b'b123\n5\t60\t{"waiting":4,"running":0,"t":60}'
    assert [(m[1], m[3]) for m in emu.extract(raw)] == [("c", 4)]
    # an engine that left disappears from the model
    model.on_stats(50.0, "b", 4, 1, 1)
    del raw[b"b"]
    emu.extract(raw)
    assert "b" not in model.counts


def test_compat_json_is_a_snapshot_without_admitted_counts() -> None:
    model = VllmCoordinatorModel(buffered=False)
    model.on_stats(5.0, "e1", 7, 3, 4)
    (at, counts), *_ = model.advance(500.0)
    snap = Snapshot.from_json(compat_snapshot_json("d", "ep", 9, at, counts))
    assert snap.version == 9 and snap.epoch == "ep"
    assert snap.engines["e1"].waiting == 3 and snap.engines["e1"].running == 4
    assert snap.engines["e1"].admitted is None


# -- engine timing (vLLM: counted only once the scheduler has the request) ------------------


def test_engine_counts_a_request_only_from_the_next_step() -> None:
    """A request that arrives mid-step waits in the input queue: the counts reported
    after that step (waiting, running, admitted) do not include it; the next step's
    scheduling takes it in. The engine's load (metrics, oracle) includes it at once."""
    e = SimEngine("a", EngineParams(running_cap=1), num_clients=2)
    e.arrive(SimRequest(1, 0, 3, 0.0), 0.0)
    assert (len(e.waiting), len(e.running), e.admitted, e.load) == (0, 0, [0, 0], 1)
    assert e.busy()
    e.begin_step(0.001)
    assert (len(e.waiting), len(e.running), e.admitted) == (0, 1, [1, 0])
    e.arrive(SimRequest(2, 1, 3, 0.002), 0.002)  # during the step
    e.end_step(0.02)
    assert (len(e.waiting), len(e.running), e.admitted, e.load) == (0, 1, [1, 0], 2)
    assert e.take_inbox() == 1  # what vLLM >= 41626 counts again before the step
    assert (len(e.waiting), e.admitted) == (1, [1, 1])
    e.begin_step(0.02)
    assert (len(e.waiting), len(e.running)) == (1, 1)  # cap 1: it waits in the scheduler


def test_engines_report_before_the_step_except_for_vllm_before_41626() -> None:
    for p in ("vllm-latest", "redisbal", "oracle", "random", "round-robin"):
        assert reports_before_step(p)
    for p in ("vllm-pre", "vllm-21617"):
        assert not reports_before_step(p)


# -- oracle -----------------------------------------------------------------------------------


def test_oracle_counts_requests_in_transit_and_skips_dead_engines() -> None:
    world = World()
    for eid in ("a", "b", "c"):
        world.engines[eid] = SimEngine(eid, EngineParams())
        world.transit[eid] = 0
    world.engines["a"].arrive(SimRequest(1, 0, 5, 0.0), 0.0)
    world.transit["b"] = 1
    world.dead.add("c")
    core = RouterCore(0, 1, OraclePolicy(world), rng=random.Random(1))
    core.set_engines(["a", "b", "c"])
    picks = {core.route().engine_id for _ in range(1)}
    assert picks <= {"a", "b"}
    world.engines["a"].inbox.clear()
    world.engines["a"].admitted = [0]
    world.transit["b"] = 0
    seen = set()
    for _ in range(50):  # all tied: the tie-break is random, never the dead engine
        seen.add(OraclePolicy(world).pick(core).engine_id)
    assert seen == {"a", "b"}


# -- the default policy's water-filling across many routers --------------------------------------


def _fill(n: int, c: int, routes: int, residual: int, seed: int = 5) -> tuple[int, int]:
    """c routers share one snapshot of n engines with residual loads 0..6*residual and
    route ``routes`` requests between them (no newer snapshot): the spread of total load."""
    from redisbal.barrier.snapshot import EngineCounts

    loads = {f"e{i:04d}": (i % 7) * residual for i in range(n)}
    counts = {e: EngineCounts(w, 0, None, 0, 1, 0, (0,) * c) for e, w in loads.items()}
    snap = Snapshot("d", "ep", 1, 0, 1, False, {}, {}, (), 0, counts)
    cores = [RouterCore(i, c, "redisbal", rng=random.Random(i)) for i in range(c)]
    for core in cores:
        core.connected = True
        core.apply_snapshot(snap)
    rng = random.Random(seed)
    got: dict[str, int] = dict.fromkeys(loads, 0)
    for _ in range(routes):
        got[cores[rng.randrange(c)].route().engine_id] += 1
    total = [loads[e] + got[e] for e in loads]
    return min(total), max(total)


def test_many_routers_water_fill_without_overshooting_the_lowest_engines() -> None:
    # 48 routes per engine on top of residual loads 0..30: the ideal is ~63 everywhere.
    # Without the stratified dither every router fills the same lowest engines in
    # lumps of client_count: the spread is 52..74 here (30..84 at 1024 x 64).
    lo, hi = _fill(256, 32, 256 * 48, 5)
    assert hi - lo <= 10, (lo, hi)
    lo, hi = _fill(32, 8, 32 * 48, 5)
    assert hi - lo <= 4, (lo, hi)


def test_bench_scenarios_add_a_procs_variant() -> None:
    from redisbal.bench.report import finite as _finite
    from redisbal.bench.suite import BenchConfig, bench_scenarios

    cfg = BenchConfig(["burst", "skew"], ["redisbal"], [1], router_processes=["skew"])
    scs = bench_scenarios(cfg)
    assert list(scs) == ["burst", "skew", "skew-procs"]
    assert scs["skew-procs"].router_processes and not scs["skew"].router_processes
    assert _finite({"a": [math.nan, 1.0], "b": math.inf}) == {"a": [None, 1.0], "b": None}


def test_speed_aware_option_learns_a_slow_engine_from_completions() -> None:
    """RedisbalPolicy.use_speed (off by default): an engine completing half as many
    requests per running request gets speed ~0.5 and its queue counts double."""
    from redisbal.barrier.snapshot import EngineCounts
    from redisbal.routing.policies import RedisbalPolicy

    def snaps(k: int) -> Snapshot:
        counts = {}
        for e in ("a", "b", "c", "d"):
            done = k * (10 if e == "d" else 20)  # per 100 ms; d is the slow one
            # 30 waiting: more than came since the last snapshot, so the cap (64) is known
            counts[e] = EngineCounts(30, 64, None, 0, k, 1000 + 100 * k, (done + 94,))
        return Snapshot("d", "ep", k, 0, k, False, {}, {}, (), 1000 + 100 * k, counts)

    class SpeedAware(RedisbalPolicy):
        use_speed = True

    for policy, slow_speed in ((SpeedAware(), 0.5), (RedisbalPolicy(), 1.0)):
        core = RouterCore(0, 1, policy, rng=random.Random(1))
        core.connected = True
        for k in range(1, 31):
            core.apply_snapshot(snaps(k))
        if slow_speed == 1.0:
            assert all(e.speed == 1.0 for e in core.engines)  # not estimated when off
            continue
        assert core.by_id["d"].speed == pytest.approx(0.5, rel=0.05)
        assert core.by_id["a"].speed == 1.0  # inside the dead band around the median
        got = {core.route().engine_id for _ in range(6)}
        assert "d" not in got  # 64 + 30 / 0.5 = 124 > 64 + 30 + routed so far


def test_engines_completing_a_few_requests_a_second_get_a_speed_and_an_age() -> None:
    """8 slots of 1.6 s requests finish 5 a second (2.5 on the half-speed engine): the
    decayed completions settle at rate x half-life / ln 2, which must clear the least
    trusted, or the speed terms and the default's age correction never turn on."""
    from redisbal.barrier.snapshot import EngineCounts
    from redisbal.routing.policies import RedisbalPolicy

    def snap(k: int) -> Snapshot:  # one every 100 ms, each report 50 ms old
        counts = {}
        for e in ("a", "b", "c", "d"):
            done = k // (4 if e == "d" else 2)  # d finishes one every 400 ms, others 200
            counts[e] = EngineCounts(0, 8, None, 0, k, 950 + 100 * k, (done + 8,))
        return Snapshot("d", "ep", k, 0, k, False, {}, {}, (), 1000 + 100 * k, counts)

    class SpeedAware(RedisbalPolicy):
        use_speed = True

    for policy in (SpeedAware(), RedisbalPolicy()):
        core = RouterCore(0, 1, policy, rng=random.Random(1))
        core.connected = True
        for k in range(1, 201):  # 20 s
            core.apply_snapshot(snap(k))
        d, a = core.by_id["d"], core.by_id["a"]
        # age: 8 running x 5 / 8 completions per running-second x 0.05 s
        assert a.aged == pytest.approx(8 * 5 / 8 * 0.05, rel=0.1)
        assert d.aged == pytest.approx(a.aged / 2, rel=0.1)
        if policy.use_speed:
            assert d.speed == pytest.approx(0.5, rel=0.1) and a.speed == 1.0


def test_sed_option_weighs_the_whole_queue_and_the_request_by_speed() -> None:
    """RedisbalPolicy.use_sed (off by default): score = (running + queued + 1) / speed,
    so a half-speed engine is chosen only once its count is under half the others';
    use_dither=False leaves every engine's offset at 0."""
    from redisbal.barrier.snapshot import EngineCounts
    from redisbal.routing.policies import RedisbalPolicy

    def snaps(k: int, running: dict[str, int]) -> Snapshot:
        counts = {}
        for e in ("a", "b", "c", "d"):
            done = k * (10 if e == "d" else 20)  # per 100 ms; d is the slow one
            counts[e] = EngineCounts(0, running[e], None, 0, k, 1000 + 100 * k, (done + 74,))
        return Snapshot("d", "ep", k, 0, k, False, {}, {}, (), 1000 + 100 * k, counts)

    class Sed(RedisbalPolicy):
        use_sed = True
        use_dither = False

    even = dict.fromkeys("abcd", 8)
    core = RouterCore(0, 1, Sed(), rng=random.Random(1))
    core.connected = True
    for k in range(1, 31):
        core.apply_snapshot(snaps(k, even))
    assert core.by_id["d"].speed == pytest.approx(0.5, rel=0.05)
    assert all(e.dither == 0.0 for e in core.engines)
    # equal counts: d's (8 + 1) / 0.5 = 18 loses to every other engine's 9 (and the
    # default policy, blind to speed, would take d as soon as it is the shortest)
    assert "d" not in {core.route().engine_id for _ in range(3)}
    core.apply_snapshot(snaps(31, {"a": 8, "b": 8, "c": 8, "d": 3}))
    assert core.route().engine_id == "d"  # (3 + 1) / 0.5 = 8 < 9
    default = RouterCore(0, 1, RedisbalPolicy(), rng=random.Random(1))
    default.connected = True
    for k in range(1, 31):
        default.apply_snapshot(snaps(k, {"a": 8, "b": 8, "c": 8, "d": 7}))
    assert default.route().engine_id == "d"


def test_slots_option_puts_free_slots_first_then_queues_by_speed() -> None:
    """RedisbalPolicy.use_slots (off by default): once the running cap is known (8:
    an engine whose queue outlived a report runs 8), an engine where the request would queue scores
    above any with a free slot, and among full ones by what is queued over speed."""
    from redisbal.barrier.snapshot import EngineCounts
    from redisbal.routing.policies import RedisbalPolicy

    def snaps(k: int, wr: dict[str, tuple[int, int]]) -> Snapshot:
        counts = {}
        for e, (w, r) in wr.items():
            done = k * (10 if e == "d" else 20)  # per 100 ms; d is the slow one
            counts[e] = EngineCounts(w, r, None, 0, k, 1000 + 100 * k, (done + 74,))
        return Snapshot("d", "ep", k, 0, k, False, {}, {}, (), 1000 + 100 * k, counts)

    class Slots(RedisbalPolicy):
        use_slots = True
        use_dither = False

    # queues longer than what came since the last snapshot (20): the cap (8) is known
    full = {"a": (25, 8), "b": (26, 8), "c": (26, 8), "d": (24, 8)}
    for policy, want in ((Slots(), "a"), (RedisbalPolicy(), "d")):
        core = RouterCore(0, 1, policy, rng=random.Random(1))
        core.connected = True
        for k in range(1, 31):
            core.apply_snapshot(snaps(k, full))
        assert core.running_cap == 8
        # slots: a = 33 + 26 x 8 = 241 beats d = 32 + 25 x 8 / 0.5 = 432; default: d, 32 < 33
        assert core.route().engine_id == want
    core = RouterCore(0, 1, Slots(), rng=random.Random(1))
    core.connected = True
    for k in range(1, 31):
        core.apply_snapshot(snaps(k, {**full, "c": (0, 7)}))
    assert core.route().engine_id == "c"  # a free slot first


def test_simulated_vllm_pushes_each_replace_every_routers_view(monkeypatch) -> None:
    """On the simulated clock every push of the vLLM coordinator model reaches every
    router and is adopted (vLLM: ``self.lb_engines = sliced_counts`` at each push);
    none is dropped as "older" than the previous one."""
    from redisbal.bench import scale as bench_scale

    seen = {"applied": 0, "ignored": 0}
    orig = RouterCore.apply_snapshot

    def counting(self: RouterCore, snap: Snapshot) -> bool:
        ok = orig(self, snap)
        seen["applied" if ok else "ignored"] += 1
        return ok

    monkeypatch.setattr(RouterCore, "apply_snapshot", counting)
    sc = Scenario("t", engines=4, clients=2, bursts=1, burst_factor=1.0, drain_s=0.5)
    bench_scale.simulate("vllm-pre", 1, sc)
    assert seen["ignored"] == 0
    assert seen["applied"] > 2 * 3  # several pushes, each to both routers


def test_bench_options_belong_to_their_benchmark() -> None:
    """``redisbal bench`` is the routing-quality benchmark; the balance benchmark's
    options need --real-time (or --sim-clock / --scale-only) and the quality
    benchmark's are refused with it, each with a one-line error before any run."""
    from click.testing import CliRunner

    from redisbal.bench.cli import bench_command

    runner = CliRunner()
    for args, msg in (
        (["--quick"], "--quick applies to the balance benchmark (--real-time)"),
        (["--plot", "x"], "--plot applies to the balance benchmark"),
        (["--real-time", "--sizes", "8x32"], "--sizes applies to the routing-quality benchmark"),
        (["--sim-clock", "--pass-output"], "--pass-output applies to the routing-quality"),
        (["--sizes", "9x9"], "unknown size: 9x9"),
        (["--scenarios", "skew"], "unknown scenario: skew"),
        (["--policies", "nope"], "unknown policy: nope"),
    ):
        res = runner.invoke(bench_command, args)
        assert res.exit_code == 2, (args, res.output)
        assert msg in res.output and "Traceback" not in res.output, (args, res.output)
    help_text = runner.invoke(bench_command, ["--help"]).output
    for metric in ("ttft_p99_s", "goodput_rps", "prefix_hit_rate", "lockstep_efficiency"):
        assert metric in help_text
