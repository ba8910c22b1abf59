"""Routing policies and RouterCore, without Redis (pure logic, a fake clock, seeded RNGs).

The baselines are tested against their documented behaviour (docs/DESIGN.md: vLLM
before PR 21617, PR 21617, latest). The default ``redisbal`` policy is tested
for its properties, not its formula: no lost bookkeeping, no double counting,
time-based reconciliation, unbiased ties, pinning, balanced start.
"""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
from support.helpers import make_snapshot

from redisbal.barrier.snapshot import EngineCounts, Snapshot
from redisbal.routing.policies import (
    DEFAULT_POLICY,
    POLICIES,
    NoEngines,
    UnknownEngine,
    make_policy,
)
from redisbal.routing.router_core import RouterCore

T0_MS = 5_000_000


class FakeClock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def make_core(
    policy: str = "redisbal",
    client_index: int = 0,
    client_count: int = 1,
    seed: int = 7,
    clock: FakeClock | None = None,
) -> RouterCore:
    core = RouterCore(
        client_index,
        client_count,
        policy,
        clock=clock or FakeClock(),
        rng=random.Random(seed),
    )
    core.connected = True
    return core


def equal(n: int) -> dict[str, tuple[int, int]]:
    return {f"e{i}": (0, 0) for i in range(n)}


def chi_square(counter: Counter[str], names: list[str]) -> float:
    total = sum(counter.values())
    expect = total / len(names)
    return sum((counter[n] - expect) ** 2 / expect for n in names)


# -- vllm-pre ----------------------------------------------------------------------------------


def test_vllm_pre_scores_waiting_times_four_plus_running() -> None:
    core = make_core("vllm-pre")
    core.apply_snapshot(make_snapshot({"e0": (1, 0), "e1": (0, 3), "e2": (0, 5)}))
    assert core.route().engine_id == "e1"  # 3 < 4 (e0) < 5 (e2); w + r would pick e0


def test_vllm_pre_lowest_index_wins_ties_and_bumps_waiting_by_one() -> None:
    core = make_core("vllm-pre", client_index=1, client_count=4)
    core.apply_snapshot(make_snapshot(equal(3)))
    picks = [core.route().engine_id for _ in range(6)]
    assert picks == ["e0", "e1", "e2", "e0", "e1", "e2"]
    assert [core.policy.vw[e] for e in ("e0", "e1", "e2")] == [2, 2, 2], "+1, not +client_count"


def test_vllm_pre_replaces_its_view_with_each_snapshot() -> None:
    """The documented weakness: local bumps vanish when a snapshot arrives."""
    core = make_core("vllm-pre")
    core.apply_snapshot(make_snapshot({"e0": (0, 0), "e1": (1, 0)}, version=1))
    for _ in range(3):
        core.route("e0")
    assert core.policy.vw["e0"] == 3
    core.apply_snapshot(make_snapshot({"e0": (0, 0), "e1": (1, 0)}, version=2))
    assert core.policy.vw["e0"] == 0
    assert core.route().engine_id == "e0"


# -- vllm-21617 --------------------------------------------------------------------------------


def test_vllm_21617_bumps_by_client_count() -> None:
    core = make_core("vllm-21617", client_count=4)
    core.apply_snapshot(make_snapshot({"e0": (2, 0), "e1": (3, 0)}))
    assert core.route().engine_id == "e0"
    assert core.policy.vw["e0"] == 2 + 4
    assert core.route().engine_id == "e1"  # 6*4 > 3*4


@pytest.mark.parametrize("client_index", range(4))
def test_vllm_21617_staggers_the_start_index(client_index: int) -> None:
    core = make_core("vllm-21617", client_index=client_index, client_count=4)
    core.apply_snapshot(make_snapshot(equal(8)))
    assert core.route().engine_id == f"e{2 * client_index}"


# -- vllm-latest -------------------------------------------------------------------------------


def test_vllm_latest_inflight_floor_survives_a_snapshot() -> None:
    """max(client_count * inflight, waiting + running): a snapshot that does not yet
    show this router's requests cannot make the engine look empty."""
    snap = {"e0": (0, 0), "e1": (1, 0)}
    latest = make_core("vllm-latest", client_count=2)
    older = make_core("vllm-21617", client_count=2)
    decisions = []
    for core in (latest, older):
        core.apply_snapshot(make_snapshot(snap, version=1))
        decisions.append([core.route("e0") for _ in range(3)])
        core.apply_snapshot(make_snapshot(snap, version=2))
    # the view was replaced (waiting 0), but 3 requests are still in flight: 2 * 3
    assert latest.policy.score(latest, latest.by_id["e0"]) == 2 * 3  # type: ignore[attr-defined]
    assert latest.policy.pick(latest).engine_id == "e1"
    assert older.policy.pick(older).engine_id == "e0", "21617 has no floor"
    for d in decisions[0]:
        latest.finished(d)
    assert latest.policy.score(latest, latest.by_id["e0"]) == 0  # type: ignore[attr-defined]
    assert latest.policy.pick(latest).engine_id == "e0"


def test_vllm_latest_kv_pressure_penalty() -> None:
    core = make_core("vllm-latest")
    core.apply_snapshot(make_snapshot({"e0": (2, 0), "e1": (2, 3)}, kv={"e0": 0.9}))
    e0 = core.by_id["e0"]
    # max(0, 2 + 0) + 2 * 6 * (0.9 - 0.5): no x4 on waiting in today's vLLM
    assert core.policy.score(core, e0) == pytest.approx(2 + 2 * 6 * 0.4)  # type: ignore[attr-defined]
    assert core.route().engine_id == "e1"  # 6.8 > 5
    core = make_core("vllm-latest")
    core.apply_snapshot(make_snapshot({"e0": (2, 0), "e1": (2, 3)}, kv={"e0": 0.5}))
    assert core.route().engine_id == "e0", "no penalty at or below 50% kv usage"


def test_vllm_latest_rotates_the_tie_break_and_21617_does_not() -> None:
    picks: dict[str, list[str]] = {}
    for name in ("vllm-latest", "vllm-21617"):
        core = make_core(name, client_index=1, client_count=2)
        core.apply_snapshot(make_snapshot(equal(4)))
        picks[name] = [core.policy.pick(core).engine_id for _ in range(8)]
    assert set(picks["vllm-latest"]) == {"e0", "e1", "e2", "e3"}
    assert set(picks["vllm-21617"]) == {"e2"}


# -- random, round-robin -----------------------------------------------------------------------


def test_random_is_uniform_and_ignores_load() -> None:
    core = make_core("random", seed=3)
    snap = equal(8)
    snap["e0"] = (500, 500)
    core.apply_snapshot(make_snapshot(snap))
    got = Counter(core.route().engine_id for _ in range(4000))
    assert chi_square(got, list(snap)) < 24.32  # 7 dof, p = 0.001


def test_round_robin_is_staggered_per_client() -> None:
    core = make_core("round-robin", client_index=1, client_count=2)
    core.apply_snapshot(make_snapshot({"e0": (9, 9), "e1": (0, 0), "e2": (0, 0), "e3": (0, 0)}))
    assert [core.route().engine_id for _ in range(5)] == ["e2", "e3", "e0", "e1", "e2"]


# -- redisbal (default): properties -------------------------------------------------------------


def test_default_policy_is_redisbal() -> None:
    assert DEFAULT_POLICY == "redisbal"
    assert RouterCore().policy.name == "redisbal"
    assert set(POLICIES) == {
        "redisbal",
        "random",
        "round-robin",
        "least-inflight",
        "vllm-pre",
        "vllm-21617",
        "vllm-latest",
    }


def test_redisbal_keeps_bookkeeping_when_the_snapshot_predates_recent_routes() -> None:
    """Time-based: the reports in the snapshot are older than the routes, so the routes
    stay pending; wiping them would send the next request back to e0."""
    clock = FakeClock(100.0)
    core = make_core(clock=clock)
    core.apply_snapshot(make_snapshot({"e0": (0, 0), "e1": (2, 0)}, version=1, time_ms=T0_MS))
    for _ in range(3):
        core.route("e0")
    clock.t = 100.2
    # published 200 ms after the reports it holds: the reports are from before t=100.0
    snap = make_snapshot(
        {"e0": (0, 0), "e1": (2, 0)}, version=2, time_ms=T0_MS + 200, reported_ms=T0_MS
    )
    assert core.apply_snapshot(snap)
    assert core.by_id["e0"].pending == 3
    assert core.route().engine_id == "e1"


def test_redisbal_keeps_bookkeeping_with_admitted_counts() -> None:
    core = make_core()
    core.apply_snapshot(make_snapshot({"e0": (0, 0), "e1": (2, 0)}, version=1))
    for _ in range(3):
        core.route("e0")
    # e0 has received one of the three so far (it is in e0's waiting)
    core.apply_snapshot(
        make_snapshot({"e0": (1, 0), "e1": (2, 0)}, version=2, admitted={"e0": (1,), "e1": (0,)})
    )
    assert core.by_id["e0"].pending == 2
    assert core.route().engine_id == "e1"  # e0: 1 + 2 pending = 3 > 2


def test_redisbal_does_not_double_count_routes_the_snapshot_includes() -> None:
    core = make_core()
    core.apply_snapshot(make_snapshot({"e0": (0, 0), "e1": (4, 0)}, version=1))
    for _ in range(3):
        core.route("e0")
    # every route reached e0 and is in its waiting count: pending must drop to 0
    core.apply_snapshot(
        make_snapshot({"e0": (3, 0), "e1": (4, 0)}, version=2, admitted={"e0": (3,), "e1": (0,)})
    )
    assert core.by_id["e0"].pending == 0
    assert core.loads() == {"e0": 3, "e1": 4}
    assert core.route().engine_id == "e0"  # 3 < 4; counted twice it would be 6


def test_redisbal_admitted_uses_this_routers_index() -> None:
    core = make_core(client_index=2, client_count=3)
    core.apply_snapshot(make_snapshot(equal(2), version=1))
    for _ in range(4):
        core.route("e0")
    core.apply_snapshot(make_snapshot(equal(2), version=2, admitted={"e0": (9, 9, 3)}))
    assert core.by_id["e0"].pending == 1


def test_redisbal_time_based_reconciliation_without_admitted() -> None:
    """Without admitted counts, a report made after a step holds the requests that came
    before the step began (the engine's previous report), not those that came during
    it: an engine takes them only when its next step begins (vLLM's input queue)."""
    clock = FakeClock(100.0)
    core = make_core(clock=clock)

    def report(at_ms: int, counts: dict[str, tuple[int, int]], version: int) -> None:
        # reports made at T0 + at_ms, published 100 ms later and adopted at once
        clock.t = 100.0 + (at_ms + 100) / 1000
        snap = make_snapshot(
            counts, version=version, time_ms=T0_MS + at_ms + 100, reported_ms=T0_MS + at_ms
        )
        core.apply_snapshot(snap)

    report(0, equal(2), 1)  # a step of e0 begins at T0
    clock.t = 100.2
    for _ in range(3):
        core.route("e0")  # during that step: in e0's input queue
    report(400, {"e0": (0, 1), "e1": (0, 0)}, 2)  # made at its end: not in it
    assert core.by_id["e0"].pending == 3
    clock.t = 100.55
    core.route("e0")  # during the next step
    report(800, {"e0": (3, 1), "e1": (0, 0)}, 3)  # the three are in this one
    assert core.by_id["e0"].pending == 1
    assert core.loads()["e0"] == 3 + 1 + 1
    report(800, {"e0": (3, 1), "e1": (0, 0)}, 4)  # the same report again: the same cut
    assert core.by_id["e0"].pending == 1


def test_ended_requests_take_off_at_most_what_the_counts_hold() -> None:
    """Without admitted counts each own end stands for the share weight's worth of ends,
    but never for more than the counts hold: through an outage, with no new counts,
    every request they held ends, and the engine that happened to hold more of this
    router's must not look emptier than empty."""
    clock = FakeClock(100.0)
    core = make_core(clock=clock, client_count=2)  # each own end stands for 2

    def report(at_ms: int, counts: dict[str, tuple[int, int]], version: int) -> None:
        clock.t = 100.0 + (at_ms + 100) / 1000
        snap = make_snapshot(
            counts, version=version, time_ms=T0_MS + at_ms + 100, reported_ms=T0_MS + at_ms
        )
        core.apply_snapshot(snap)

    report(0, equal(2), 1)
    clock.t = 100.2
    routes = [core.route("e0") for _ in range(4)]
    report(400, {"e0": (1, 4), "e1": (1, 4)}, 2)
    report(800, {"e0": (1, 4), "e1": (1, 4)}, 3)  # they run (one more waits)
    clock.t = 100.85
    for d in routes:
        core.finished(d)
    e0 = core.by_id["e0"]
    assert e0.done == 4
    assert e0.aged == 5.0  # 4 x 2 ends, but the counts held only 5 requests
    assert core.route().engine_id == "e0"  # 5 - 5 against 5: still the lighter


def test_redisbal_takes_its_ended_requests_off_counts_without_admitted() -> None:
    """Without admitted counts, a request that ends after the engine's counts were made
    weighs in them until its next report: the router takes it off as it ends (``aged``,
    x its pending weight, as its pending routes count), and a pending route that ends
    stops being pending. An end seen within the transit allowance of the counts may
    precede them, and is not taken off."""
    clock = FakeClock(100.0)
    core = make_core(clock=clock, client_count=2)  # each own route stands for 2

    def report(at_ms: int, counts: dict[str, tuple[int, int]], version: int) -> None:
        clock.t = 100.0 + (at_ms + 100) / 1000  # published 100 ms after, adopted at once
        snap = make_snapshot(
            counts, version=version, time_ms=T0_MS + at_ms + 100, reported_ms=T0_MS + at_ms
        )
        core.apply_snapshot(snap)

    report(0, equal(2), 1)
    clock.t = 100.2
    routes = [core.route("e0") for _ in range(5)]  # in e0's input queue
    report(400, {"e0": (0, 3), "e1": (0, 5)}, 2)
    report(800, {"e0": (0, 8), "e1": (0, 5)}, 3)  # the five run now
    e0 = core.by_id["e0"]
    assert (e0.pending, e0.done, e0.aged) == (0, 0, 0.0)
    clock.t = 100.803  # within the transit of the counts (made at 100.8)
    core.finished(routes[0])
    assert (e0.done, e0.aged) == (0, 0.0)
    clock.t = 100.85
    for d in routes[1:]:
        core.finished(d)
    assert (e0.done, e0.aged) == (4, 8.0)
    assert core.route().engine_id == "e0"  # 8 - 8 against 5: the policy heard of it
    late = core.route("e0")
    assert e0.pending == 2
    clock.t = 100.86
    core.finished(late)  # pending, never to be counted
    assert (e0.pending, e0.done) == (1, 4)
    report(1200, {"e0": (0, 2), "e1": (0, 5)}, 4)  # made after the ends: none weighs
    assert (e0.done, e0.aged) == (0, 0.0)
    # a route that ends while pending, in counts made before its end: it weighs there
    clock.t = 101.31
    taken = core.route("e0")
    report(1400, {"e0": (0, 2), "e1": (0, 5)}, 5)  # made at 101.4: not in it
    clock.t = 101.65
    core.finished(taken)  # it began at 101.4 and ended now: pending no more
    assert (e0.pending, e0.done) == (0, 0)
    report(1600, {"e0": (0, 3), "e1": (0, 5)}, 6)  # made at 101.6: it was running then
    assert (e0.done, e0.aged) == (1, 2.0)


def test_redisbal_breaks_ties_without_bias() -> None:
    """Every snapshot shows all engines equal and every route included (admitted), so
    each route is a pure tie: the choice must be uniform over the engines."""
    names = [f"e{i}" for i in range(8)]

    def run(policy: str) -> float:
        core = make_core(policy, seed=11)
        got: Counter[str] = Counter()
        for v in range(1, 3201):
            adm = {e: (got[e],) for e in names}
            core.apply_snapshot(make_snapshot(equal(8), version=v, admitted=adm))
            got[core.route().engine_id] += 1
        return chi_square(got, names)

    assert run("redisbal") < 24.32  # 7 dof, p = 0.001
    assert run("vllm-pre") > 1000, "the harness must be able to see a biased tie-break"


def test_redisbal_spreads_a_burst_evenly_between_snapshots() -> None:
    core = make_core(seed=5)
    core.apply_snapshot(make_snapshot(equal(8)))
    got = Counter(core.route().engine_id for _ in range(80))
    assert set(got.values()) == {10}


def test_redisbal_avoids_loaded_engines() -> None:
    core = make_core()
    core.apply_snapshot(make_snapshot({"e0": (10, 10), "e1": (0, 5), "e2": (3, 3)}))
    got = Counter(core.route().engine_id for _ in range(6))
    assert got["e0"] == 0 and got["e1"] >= got["e2"]


KV_USAGE = {"e0": 0.9, "e1": 0.5}


def kv_core(caps: int) -> RouterCore:
    """The default (running requests counted by their KV where it binds:
    ``use_kv_load``), fed as vLLM's plugin feeds it: e0 runs 2 long requests in 90 % of
    its cache, e1 runs 5 short ones in 50 %; both declared a running cap of ``caps``."""
    core = make_core()
    assert core.policy.use_kv_load  # type: ignore[attr-defined]
    core.set_declared_caps({"e0": caps, "e1": caps})
    core.apply_snapshot(make_snapshot({"e0": (0, 2), "e1": (0, 5)}, kv=KV_USAGE))
    return core


def test_where_the_kv_cache_binds_a_running_request_counts_by_the_kv_it_holds() -> None:
    """With a cap of 256 the caches (2.2 and 10 requests of the sizes they run) bind long
    before the slots: 7 requests fill 1.4 caches, so a cache holds 5 of the size the
    engines run, e0 counts 0.9 x 5 = 4.5 and e1 2.5, and e1 takes the request though it
    runs more."""
    core = kv_core(256)
    score = core.policy.score
    e0, e1 = core.by_id["e0"], core.by_id["e1"]
    assert score(core, e0) - e0.dither == pytest.approx(4.5)
    assert score(core, e1) - e1.dither == pytest.approx(2.5)
    assert {core.route().engine_id for _ in range(2)} == {"e1"}
    core = kv_core(256)
    core.policy.use_kv_load = False  # type: ignore[attr-defined]  # (redisbal-kvload)
    core.apply_snapshot(make_snapshot({"e0": (0, 2), "e1": (0, 5)}, version=2, kv=KV_USAGE))
    assert core.route().engine_id == "e0"


def test_completions_since_the_counts_free_the_kv_of_the_requests_they_ended() -> None:
    """Where running requests count by their KV, the completions since an engine's
    counts (``aged``: this router's ends x 1 / share) take off the share of its KV load
    the requests they ended held: 4 of e1's 5 ended free 4 / 5 of its 2.5, not 4
    requests (which read it as 1.5 below empty)."""
    core = kv_core(256)
    e1 = core.by_id["e1"]
    e1.aged = 4.0
    assert core.policy.score(core, e1) - e1.dither == pytest.approx(2.5 * (1 - 4 / 5))
    e1.aged = 5.0
    assert core.policy.score(core, e1) - e1.dither == pytest.approx(0.0)


def test_where_the_kv_cache_binds_an_engine_that_queues_counts_a_full_cache() -> None:
    """e1 queues one request though its running ones hold half its cache: the queue's
    head does not fit there (vLLM admits in order), so a request sent to e1 waits for
    it. e1 counts a full cache (5) plus its queue, above e0's 4.5, and e0 takes the
    request; read by what e1's running requests hold (``use_kv_queue`` off), e1 would
    count 2.5 + 1 and take it."""
    counts = {"e0": (0, 2), "e1": (1, 5)}
    core = kv_core(256)
    core.apply_snapshot(make_snapshot(counts, version=2, kv=KV_USAGE))
    e1 = core.by_id["e1"]
    assert core.policy.score(core, e1) - e1.dither == pytest.approx(5.0 + 1.0)
    assert core.route().engine_id == "e0"
    core = kv_core(256)
    core.policy.use_kv_queue = False  # type: ignore[attr-defined]  # (redisbal-kvqueue)
    core.apply_snapshot(make_snapshot(counts, version=2, kv=KV_USAGE))
    assert core.policy.score(core, core.by_id["e1"]) - core.by_id["e1"].dither == pytest.approx(3.5)
    assert core.route().engine_id == "e1"


def test_where_slots_bind_a_running_request_counts_one_whatever_its_kv() -> None:
    """With a cap of 4 the caches hold about as many requests as the slots (2.2 and 10,
    at least half of 4): a running request holds a slot, so e0 counts 2 and takes it."""
    core = kv_core(4)
    e0 = core.by_id["e0"]
    assert core.policy.score(core, e0) - e0.dither == pytest.approx(2.0)
    assert core.route().engine_id == "e0"


def test_engines_that_say_nothing_of_their_kv_count_their_requests() -> None:
    core = make_core()
    core.apply_snapshot(make_snapshot({"e0": (0, 2), "e1": (0, 5)}))
    e1 = core.by_id["e1"]
    assert core.policy.score(core, e1) - e1.dither == pytest.approx(5.0)


# -- pinning, start, errors (every policy) ----------------------------------------------------


@pytest.mark.parametrize("policy", list(POLICIES))
def test_pinning_routes_to_the_engine_and_rejects_unknown_or_dead(policy: str) -> None:
    core = make_core(policy)
    core.apply_snapshot(make_snapshot(equal(4), version=1))
    d = core.route("e2")
    assert (d.engine_id, d.pinned) == ("e2", True)
    assert core.by_id["e2"].routed == 1 and core.by_id["e2"].inflight == 1
    with pytest.raises(UnknownEngine, match=r"'e9'.*not in the current snapshot.*e0, e1, e2, e3"):
        core.route("e9")
    gone = {"e0": (0, 0), "e1": (0, 0), "e2": (0, 0)}
    core.apply_snapshot(make_snapshot(gone, version=2, gone={"e3": "expired"}))
    with pytest.raises(UnknownEngine, match=r"'e3'.*it expired"):
        core.route("e3")
    assert "e3" not in {core.route().engine_id for _ in range(40)}
    core.apply_snapshot(make_snapshot({"e0": (0, 0)}, version=3, gone={"e1": "left"}))
    with pytest.raises(UnknownEngine, match=r"'e1'.*it left"):
        core.route("e1")


@pytest.mark.parametrize("policy", list(POLICIES))
def test_no_engines_is_a_clear_error(policy: str) -> None:
    core = make_core(policy)
    with pytest.raises(NoEngines, match="no engine known"):
        core.route()
    core.apply_snapshot(make_snapshot({}, version=1))
    with pytest.raises(NoEngines):
        core.route()


def test_balanced_start_before_the_first_snapshot() -> None:
    core = make_core()
    core.connected = False
    core.set_engines(["e0", "e1", "e2", "e3"])
    decisions = [core.route() for _ in range(8)]
    assert Counter(d.engine_id for d in decisions) == dict.fromkeys(("e0", "e1", "e2", "e3"), 2)
    assert all(d.degraded and d.version == 0 for d in decisions)
    # once a snapshot arrived, set_engines no longer overrides it
    core.apply_snapshot(make_snapshot({"e0": (0, 0)}))
    core.set_engines(["x", "y"])
    assert list(core.by_id) == ["e0"]


def test_finished_is_idempotent() -> None:
    core = make_core("vllm-latest", client_count=2)
    core.apply_snapshot(make_snapshot(equal(2)))
    d1, d2 = core.route("e0"), core.route("e0")
    core.finished(d1)
    core.finished(d1)
    assert core.by_id["e0"].inflight == 1
    core.finished(d2)
    core.finished(d2)
    assert core.by_id["e0"].inflight == 0


def test_failed_tells_redis_once_per_ejection_and_again_after_a_failed_probe() -> None:
    clock = FakeClock()
    core = make_core(clock=clock)
    core.apply_snapshot(make_snapshot(equal(4)))
    assert core.failed(core.route("e0"), "5xx")
    assert not any(core.failed(core.route("e0"), "5xx") for _ in range(10))
    clock.t += core.suspect_s
    probe = core.route()
    assert probe.engine_id == "e0" and probe.probe
    assert core.failed(probe, "5xx")  # ejected again, for longer
    assert core.outcomes.health("e0").level == 1


def test_with_shadow_probes_a_probing_engine_gets_copies_one_at_a_time() -> None:
    """The gateway's way: the probe owed to a probing engine is a route of its own
    (``Decision.shadow``) beside the request's, which goes to a choosable engine; one
    probe at a time; its answer recovers the engine, a probe taken back frees the way,
    and every route's end leaves nothing in flight."""
    clock = FakeClock()
    core = make_core(clock=clock)
    core.shadow_probes = True
    core.apply_snapshot(make_snapshot(equal(4)))
    assert core.failed(core.route("e0"), "first_byte_timeout")
    clock.t += core.suspect_s
    d = core.route()
    assert d.engine_id != "e0" and not d.probe
    shadow = d.shadow
    assert shadow is not None and shadow.engine_id == "e0" and shadow.probe
    assert shadow.seq != d.seq and core.by_id["e0"].inflight == 1
    others = [core.route() for _ in range(20)]  # one probe at a time
    assert all(o.engine_id != "e0" and o.shadow is None for o in others)
    core.unroute(shadow)  # never sent: the next request probes
    again = core.route()
    assert again.shadow is not None and again.shadow.engine_id == "e0"
    core.answered(again.shadow, 0.01)
    assert "e0" not in core.excluded()
    for x in (d, *others, again, again.shadow):
        core.finished(x)
    assert all(e.inflight == 0 for e in core.known)
    assert core.counters["probes"] == 2


def test_a_refused_route_leaves_no_phantom_load() -> None:
    core = make_core("redisbal", client_count=1)
    snap = make_snapshot({e: (0, 0) for e in ("e0", "e1")}, admitted={"e0": (0,), "e1": (0,)})
    core.apply_snapshot(snap)
    for _ in range(5):  # refused: the engine never admitted them
        core.finished(core.route("e0"))
    core.apply_snapshot(
        make_snapshot({"e0": (0, 0), "e1": (0, 0)}, version=2, admitted={"e0": (0,), "e1": (0,)})
    )
    assert core.by_id["e0"].pending == 0
    assert core.loads() == {"e0": 0.0, "e1": 0.0}


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_request_routed_before_an_engine_left_does_not_end_one_after_it_came_back(
    policy: str,
) -> None:
    core = make_core(policy)
    core.apply_snapshot(make_snapshot(equal(2)))
    before = core.route("e0")
    core.apply_snapshot(make_snapshot({"e1": (0, 0)}, version=2, gone={"e0": "left"}))
    assert "e0" not in core.by_id
    core.apply_snapshot(make_snapshot(equal(2), version=3))
    after = core.route("e0")
    core.finished(before)  # ended on the engine's former self: nothing of the new one
    assert core.by_id["e0"].inflight == 1
    core.unroute(before)
    assert (core.by_id["e0"].inflight, core.by_id["e0"].routed) == (1, 1)
    core.finished(after)
    assert core.by_id["e0"].inflight == 0


@pytest.mark.parametrize(
    ("client_index", "client_count"),
    [(0, 0), (0, -1), (0, True), (0, 1.5), (0, "2"), (-1, 2), (2, 2), (True, 2), (0.0, 2)],
)
def test_client_index_and_count_are_validated(client_index: object, client_count: object) -> None:
    with pytest.raises(ValueError, match=r"client_(index|count)"):
        RouterCore(client_index, client_count)  # type: ignore[arg-type]


def test_unknown_policy_name_lists_the_choices() -> None:
    with pytest.raises(ValueError, match=r"unknown policy 'best'.*redisbal.*vllm-latest"):
        make_policy("best")


# -- snapshot ordering and degraded (invariants 4 and 8, pure) -----------------------------------


def test_older_versions_are_ignored_and_a_new_epoch_is_adopted() -> None:
    core = make_core()
    snaps: list[Snapshot] = [make_snapshot({"e0": (v, 0)}, version=v, epoch="a") for v in (1, 2, 3)]
    assert core.apply_snapshot(snaps[2])
    assert not core.apply_snapshot(snaps[0])
    assert not core.apply_snapshot(snaps[2])  # same version: not newer
    assert core.snapshot is snaps[2] and core.counters["ignored_old"] == 2
    assert core.by_id["e0"].waiting == 3
    fresh = make_snapshot({"e5": (0, 0)}, version=1, epoch="b")
    assert core.apply_snapshot(fresh)
    # e0 stays routable while it may still re-register in the new epoch (test_restart_routing)
    assert core.snapshot is fresh and list(core.by_id) == ["e5", "e0"]
    assert core.counters["epochs"] == 1
    later = make_snapshot({"e5": (0, 0)}, version=2, epoch="b", time_ms=1_000_000 + 1000)
    assert core.apply_snapshot(later) and list(core.by_id) == ["e5"]


def test_degraded_when_disconnected_or_stale() -> None:
    clock = FakeClock(10.0)
    core = make_core(clock=clock)
    assert core.degraded  # no snapshot yet
    core.apply_snapshot(make_snapshot(equal(2)))
    assert not core.degraded and not core.route().degraded
    clock.t += core.stale_after_s + 0.1
    assert core.degraded and core.route().degraded
    clock.t -= core.stale_after_s
    core.connected = False
    assert core.degraded
    assert core.counters["degraded_routes"] == 1


# -- measured variants of the default policy (docs/BENCHMARKS.md) -------------------------


def _counts(w: int, r: int, t_ms: int, adm: int) -> EngineCounts:
    return EngineCounts(w, r, None, 0, 1, t_ms, (adm,))


def test_age_weighting_discounts_an_older_report_by_its_expected_completions() -> None:
    """use_age: an engine's reported load is read in the light of its age: the
    completions expected since the report, running x (1 - exp(-rate x age)), are
    subtracted."""
    core = make_core()
    assert core.policy.use_age  # type: ignore[attr-defined]
    t = T0_MS
    # two reports 1 s apart: 40 running, 40 completed each -> 1 completion/s per request
    for k, adm in enumerate((40, 80)):
        snap = make_snapshot(
            {e: _counts(0, 40, t + 1000 * k, adm) for e in ("a", "b")},
            version=k + 1,
            time_ms=t + 1000 * k,
        )
        core.apply_snapshot(snap)
    assert core.by_id["a"].aged == 0.0
    # b's report is 500 ms older than the cut: at 1/s, 40 x (1 - e^-0.5) = 15.7 expected
    snap = make_snapshot(
        {"a": _counts(0, 40, t + 2000, 120), "b": _counts(0, 40, t + 1500, 100)},
        version=3,
        time_ms=t + 2000,
    )
    core.apply_snapshot(snap)
    assert core.by_id["a"].aged == 0.0
    assert core.by_id["b"].aged == pytest.approx(40 * (1 - math.exp(-0.5)), rel=0.05)
    assert {core.route().engine_id for _ in range(10)} == {"b"}


def test_an_old_report_never_ages_below_empty() -> None:
    """A busy engine's report seconds old is read as fewer of its requests left, never
    as fewer than none: leaving out the dither, it scores no lower than an idle engine
    (linear in the age, a 10 s old report of 16 running at 1/s scored 16 - 160)."""
    core = make_core()
    t = T0_MS
    for k, adm in enumerate((16, 32)):  # 16 running, 16 ended a second: 1/s per request
        counts = {"a": _counts(0, 16, t + 1000 * k, adm), "b": _counts(0, 0, t + 1000 * k, 0)}
        core.apply_snapshot(make_snapshot(counts, version=k + 1, time_ms=t + 1000 * k))
    snap = make_snapshot(
        {"a": _counts(0, 16, t + 1000, 32), "b": _counts(0, 0, t + 11_000, 0)},
        version=3,
        time_ms=t + 11_000,
    )
    core.apply_snapshot(snap)
    a = core.by_id["a"]
    assert a.age_s == pytest.approx(10.0)
    assert 15.9 < a.aged < 16.0  # 16 x (1 - e^-10)
    b, score = core.by_id["b"], core.policy.score
    # (which of two near-empty engines wins is the dither's: not asserted)
    assert score(core, a) - a.dither >= score(core, b) - b.dither


def test_age_weighting_can_be_switched_off() -> None:
    core = make_core()
    core.policy.use_age = False  # type: ignore[attr-defined]
    snap = make_snapshot(
        {"a": _counts(0, 40, T0_MS, 40), "b": _counts(0, 40, T0_MS - 500, 40)},
        time_ms=T0_MS,
    )
    core.apply_snapshot(snap)
    assert core.by_id["b"].aged == 0.0


class _FixedRng(random.Random):
    def __init__(self, values: list[float]) -> None:
        super().__init__(0)
        self.values = values

    def random(self) -> float:
        return self.values.pop(0) if self.values else 0.5


def test_power_of_two_choices_takes_the_lower_of_two_sampled_engines() -> None:
    core = make_core(client_count=1)
    core.policy.p2c_from = 2  # type: ignore[attr-defined]
    core.apply_snapshot(make_snapshot({"e0": (0, 9), "e1": (0, 1), "e2": (0, 0)}))
    core.rng = _FixedRng([0.1, 0.5])  # samples e0 and e1: e1 is lower; e2 is not seen
    assert core.route().engine_id == "e1"
    core.rng = _FixedRng([0.1, 0.1])  # the same engine twice: it wins
    assert core.route().engine_id == "e0"


def test_least_inflight_counts_only_its_own_unfinished_requests() -> None:
    core = RouterCore(0, 2, "least-inflight")
    core.apply_snapshot(make_snapshot({"a": (50, 50), "b": (0, 0), "c": (0, 0)}))
    picks = [core.route() for _ in range(6)]
    # blind to the snapshot's queues: two each
    assert sorted(d.engine_id for d in picks) == ["a", "a", "b", "b", "c", "c"]
    for d in picks:
        if d.engine_id != "c":
            core.finished(d)
    assert {core.route().engine_id for _ in range(4)} == {"a", "b"}
