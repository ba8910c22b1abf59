"""Holding requests while every engine is at its running cap (redisbal.routing.admission),
and learning that cap from the engines' reports (estimates.RunningCap). Pure logic:
snapshots are made by hand, the router's clock is set by the test."""

from __future__ import annotations

import asyncio
import math
import random

import pytest
from support.helpers import make_snapshot

from redisbal.routing.admission import (
    Admission,
    ahead_of,
    free_slots,
    releasable,
    release_delay,
)
from redisbal.routing.estimates import kv_binds, kv_room
from redisbal.routing.policies import RedisbalPolicy
from redisbal.routing.router_core import RouterCore


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def router(client_index: int = 0, client_count: int = 1) -> tuple[RouterCore, Clock]:
    clock = Clock()
    core = RouterCore(client_index, client_count, rng=random.Random(1), clock=clock)
    core.connected = True
    return core, clock


def feed(
    core: RouterCore,
    version: int,
    counts: dict[str, tuple[int, int]],
    admitted: dict[str, int],
) -> None:
    """A snapshot of fresh reports (each at a new time): (waiting, running) and each
    engine's admitted total, all from client 0."""
    t = 1_000_000 + 10 * version
    core.apply_snapshot(
        make_snapshot(
            counts,
            version=version,
            time_ms=t,
            admitted={e: (n,) for e, n in admitted.items()},
        )
    )


def full(core: RouterCore) -> None:
    """Teach the cap (4): a queue on a that outlives a report; both engines full."""
    feed(core, 1, {"a": (0, 4), "b": (0, 2)}, {"a": 4, "b": 2})
    feed(core, 2, {"a": (1, 4), "b": (0, 4)}, {"a": 5, "b": 4})  # a: 1 waiting, just come
    feed(core, 3, {"a": (1, 4), "b": (0, 4)}, {"a": 5, "b": 4})  # it waited through a step
    assert core.running_cap == 4


# -- the running cap ---------------------------------------------------------------------------


def test_a_queue_of_requests_just_come_does_not_teach_the_cap() -> None:
    """A report made before a step's admission shows the requests that came since the
    last one as waiting, whatever room there is: no cap from them."""
    core, _ = router()
    feed(core, 1, {"a": (0, 1), "b": (0, 0)}, {"a": 1, "b": 0})
    feed(core, 2, {"a": (2, 1), "b": (1, 0)}, {"a": 3, "b": 1})  # all of them new
    assert core.running_cap == 0
    assert free_slots(core) is None  # unknown cap: nothing is held


def test_a_queue_that_outlived_a_report_teaches_the_cap() -> None:
    core, _ = router()
    full(core)
    assert free_slots(core) == 0


def test_a_queue_below_what_another_engine_ran_is_not_the_cap() -> None:
    """A queue that waits on the prefill budget or KV room at 3 running, when an engine
    has run 4: the cap is at least 4, so 3 is not it."""
    core, _ = router()
    feed(core, 1, {"a": (0, 4), "b": (0, 3)}, {"a": 4, "b": 3})
    feed(core, 2, {"a": (0, 4), "b": (2, 3)}, {"a": 4, "b": 5})
    feed(core, 3, {"a": (0, 4), "b": (2, 3)}, {"a": 4, "b": 5})  # b's queue waited a step
    assert core.running_cap == 0


def test_free_slots_count_every_routers_routes_on_their_way() -> None:
    core, _ = router()
    feed(core, 1, {"a": (0, 2), "b": (0, 4)}, {"a": 2, "b": 4})
    feed(core, 2, {"a": (0, 2), "b": (1, 4)}, {"a": 2, "b": 5})
    feed(core, 3, {"a": (0, 2), "b": (1, 4)}, {"a": 2, "b": 5})
    assert core.running_cap == 4
    assert free_slots(core) == 2  # a runs 2 of 4
    core.route("a")
    assert free_slots(core) == 1  # this router's route on its way
    core.by_id["a"].others = 1.0  # another router's, as told
    assert free_slots(core) == 0


def plugin_feed(core: RouterCore, version: int, counts: dict[str, tuple[int, int, float]]) -> None:
    """A snapshot as vLLM's plugin or the /metrics sidecar feeds one: (waiting, running,
    KV usage) per engine, no admitted counts."""
    core.apply_snapshot(
        make_snapshot(
            {e: (w, r) for e, (w, r, _) in counts.items()},
            version=version,
            time_ms=1_000_000 + 10 * version,
            kv={e: kv for e, (_, _, kv) in counts.items()},
        )
    )


def test_kv_room_is_the_free_cache_over_what_a_running_request_holds() -> None:
    assert kv_room(4, 0.8) == pytest.approx(1.0)  # 4 requests hold 80 %: one more fits
    assert kv_room(10, 0.5) == pytest.approx(10.0)
    assert kv_room(3, None) == kv_room(0, 0.4) == kv_room(3, 0.0) == math.inf  # unknown


def test_nothing_is_held_while_an_engine_is_kv_bound() -> None:
    """An engine whose KV room (in requests the size of those it runs) is below its free
    slots admits by request size: whether it would queue the next request is a guess,
    so nothing is held while any engine is so bounded, however full its cache."""
    core, _ = router()
    plugin_feed(core, 1, {"a": (0, 4, 0.8), "b": (0, 10, 0.5)})
    assert core.running_cap == 0  # no cap known: the KV cache is all that bounds them
    assert kv_binds(core.by_id["a"], 0)
    assert free_slots(core) is None
    plugin_feed(core, 2, {"a": (2, 4, 0.95), "b": (0, 10, 0.9)})  # a queues: still a guess
    assert free_slots(core) is None
    core.set_declared_caps({"a": 64, "b": 64})  # vLLM's cap, far above what KV lets run
    assert kv_binds(core.by_id["b"], core.running_cap)  # 10 + 1.1 of 64
    assert free_slots(core) is None


def test_an_engine_whose_slots_bind_before_its_kv_cache_is_held_for() -> None:
    """Where the running cap binds first (8 slots, a cache a tenth full), the KV room
    says nothing more: full by its slots, requests are held. So too where the cache
    holds about as many requests as the cap (6 running, room for 1.5 more, of 8): the
    slots bind within the estimate's error, and a cache that fills there does not turn
    holding off for every engine."""
    core, _ = router()
    core.set_declared_caps({"a": 8, "b": 8})
    plugin_feed(core, 1, {"a": (0, 8, 0.1), "b": (0, 8, 0.12)})
    assert not kv_binds(core.by_id["a"], core.running_cap)
    assert free_slots(core) == 0
    plugin_feed(core, 2, {"a": (0, 8, 0.1), "b": (1, 6, 0.8)})
    assert not kv_binds(core.by_id["b"], core.running_cap)  # 6 + 1.5 of 8
    assert free_slots(core) == 1  # b: its KV room 1.5 less the one it queues, rounded up


def test_an_engine_that_says_nothing_of_its_kv_cache_or_cap_is_never_full() -> None:
    """Unsure is not full: while one engine's room is unbounded, nothing is held."""
    core, _ = router()
    plugin_feed(core, 1, {"a": (3, 4, 0.99), "b": (0, 0, 0.0)})
    assert free_slots(core) is None


def test_without_admitted_counts_a_queue_in_two_reports_in_a_row_teaches_the_cap() -> None:
    """vLLM's plugin and the sidecar send counts made after the step's admission and no
    admitted counts: a queue in two reports in a row waited through a step."""
    core, _ = router()
    plugin_feed(core, 1, {"a": (0, 4, 0.2), "b": (0, 3, 0.2)})
    plugin_feed(core, 2, {"a": (2, 4, 0.2), "b": (0, 4, 0.2)})
    assert core.running_cap == 0  # one report's queue: it may have just come
    plugin_feed(core, 3, {"a": (0, 4, 0.2), "b": (0, 4, 0.2)})
    plugin_feed(core, 4, {"a": (1, 4, 0.2), "b": (0, 4, 0.2)})
    assert core.running_cap == 0  # a queue gone and come again
    plugin_feed(core, 5, {"a": (1, 4, 0.2), "b": (0, 4, 0.2)})
    assert core.running_cap == 4
    assert free_slots(core) == 0  # the KV room is ample, the slots are not


def test_a_queue_with_no_kv_room_for_it_does_not_teach_the_cap() -> None:
    """A queue that outlived a report on an engine whose KV cache had no room for it is
    KV-bound: its running count is set by the request sizes, not a slot count."""
    core, _ = router()
    kv = {"a": 0.97, "b": 0.5}
    t = 1_000_000
    for v, (wa, adm_a) in enumerate([(0, 4), (1, 5), (1, 5)], start=1):
        counts = {"a": (wa, 4), "b": (0, 2)}
        snap = make_snapshot(
            counts, version=v, time_ms=t + 10 * v, admitted={"a": (adm_a,), "b": (2,)}, kv=kv
        )
        core.apply_snapshot(snap)
    assert core.running_cap == 0  # the same reports with room in the cache teach 4 (above)


# -- holding ----------------------------------------------------------------------------------


async def test_a_request_is_not_held_while_a_slot_is_free() -> None:
    core, _ = router()
    feed(core, 1, {"a": (0, 1), "b": (0, 0)}, {"a": 1, "b": 0})
    adm = Admission(core, 1.0)
    assert await adm.enter() == 0.0
    assert adm.held_total == 0


async def test_held_requests_go_in_order_one_per_freed_slot() -> None:
    core, _ = router()
    full(core)
    adm = Admission(core, 5.0)
    core.on_update = adm.wake
    order: list[int] = []

    async def request(n: int) -> None:
        await adm.enter()
        order.append(n)
        core.route()  # (right after, as the gateway does)

    tasks = [asyncio.create_task(request(n)) for n in range(3)]
    await asyncio.sleep(0.01)
    assert adm.held == 3 and order == []
    feed(core, 4, {"a": (1, 4), "b": (0, 3)}, {"a": 5, "b": 4})  # b finished one
    await asyncio.sleep(0.01)
    assert order == [0] and adm.held == 2  # one slot: one request, the first
    feed(core, 5, {"a": (0, 3), "b": (0, 4)}, {"a": 5, "b": 5})  # b took it; a finished two
    await asyncio.sleep(0.01)
    assert order == [0, 1] and adm.held == 1
    adm.close()
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2]
    assert adm.held_total == 3


async def test_a_held_request_goes_where_this_routers_own_request_ended() -> None:
    """Fed as vLLM's plugin feeds it (no admitted counts), a request of this router that
    its engine's counts hold frees its slot when it ends, before any report says so:
    the held request goes there at once, not a report later, and not to the other."""
    core, clock = router()
    plugin_feed(core, 1, {"a": (0, 1, 0.01), "b": (0, 1, 0.01)})
    mine = [core.route(), core.route()]  # one to each
    assert sorted(d.engine_id for d in mine) == ["a", "b"]
    clock.t += 1.0
    for v in (2, 3):  # both run 2 and queue 1 through two reports: cap 2
        plugin_feed(core, v, {"a": (1, 2, 0.01), "b": (1, 2, 0.01)})
    clock.t += 1.0
    plugin_feed(core, 4, {"a": (0, 2, 0.01), "b": (0, 2, 0.01)})  # full, nothing queued
    assert core.running_cap == 2 and free_slots(core) == 0
    adm = Admission(core, 5.0)
    core.on_update = adm.wake
    routed: list[str] = []

    async def request() -> None:
        await adm.enter()
        routed.append(core.route().engine_id)

    task = asyncio.create_task(request())
    await asyncio.sleep(0.01)
    assert adm.held == 1
    ended = next(d for d in mine if d.engine_id == "b")
    clock.t += 0.1
    core.finished(ended)  # (the counts still show it running)
    await asyncio.sleep(0.01)
    assert routed == ["b"] and adm.held == 0
    await task
    plugin_feed(core, 5, {"a": (0, 2, 0.01), "b": (0, 2, 0.01)})  # b took it instead
    assert free_slots(core) == 0  # the end counted once


async def test_a_standing_queue_lets_each_engine_queue_one_request_past_the_cap() -> None:
    """Over capacity a slot freed at the engine is filled a step late from the router:
    once the oldest held request has waited the policy's ``stand_s``, each engine may
    queue one request past its running cap, the least-loaded first."""
    core, _ = router()
    full(core)  # cap 4: a runs 4 with 1 waiting, b runs 4
    policy = core.policy
    assert isinstance(policy, RedisbalPolicy)
    policy.stand_s = 3600.0  # (not standing yet)
    adm = Admission(core, 5.0)
    core.on_update = adm.wake
    order: list[str] = []

    async def request() -> None:
        await adm.enter()
        order.append(core.route().engine_id)

    tasks = [asyncio.create_task(request()) for _ in range(3)]
    await asyncio.sleep(0.01)
    feed(core, 4, {"a": (1, 4), "b": (0, 4)}, {"a": 5, "b": 4})  # nothing freed
    await asyncio.sleep(0.01)
    assert order == [] and adm.held == 3
    policy.stand_s = 0.05
    await asyncio.sleep(0.06)  # the queue stands now
    feed(core, 5, {"a": (1, 4), "b": (0, 4)}, {"a": 5, "b": 4})
    await asyncio.sleep(0.01)
    assert order == ["b"] and adm.held == 2  # one past b's cap; a has one queued
    adm.close()
    await asyncio.gather(*tasks)


def test_ahead_only_once_the_oldest_held_request_waited_stand_s() -> None:
    core, _ = router()
    full(core)
    policy = core.policy
    assert isinstance(policy, RedisbalPolicy)
    policy.stand_s = 0.5
    assert [ahead_of(core, w) for w in (None, 0.0, 0.49, 0.5, 3.0)] == [0, 0, 0, 1, 1]
    assert free_slots(core, ahead=1) == 1  # b's one past the cap; a has it queued
    policy.stand_s = None  # never
    assert ahead_of(core, 3.0) == 0
    assert RouterCore(policy="least-inflight").policy.stand_s is None


async def test_a_request_is_held_at_most_max_s() -> None:
    core, _ = router()
    full(core)
    adm = Admission(core, 0.05)
    held = await adm.enter()
    assert held >= 0.05
    assert adm.timed_out == 1 and adm.held == 0


async def test_a_released_request_whose_client_left_gives_its_slot_to_the_next() -> None:
    core, _ = router()
    full(core)
    adm = Admission(core, 5.0)
    core.on_update = adm.wake
    first = asyncio.create_task(adm.enter())
    second = asyncio.create_task(adm.enter())
    await asyncio.sleep(0.01)
    feed(core, 4, {"a": (1, 4), "b": (0, 3)}, {"a": 5, "b": 4})  # one slot: the first
    first.cancel()  # its client left before it routed
    with pytest.raises(asyncio.CancelledError):
        await first
    assert await asyncio.wait_for(second, 1.0) > 0  # the slot went to the second


async def test_without_a_fresh_snapshot_every_held_request_goes() -> None:
    core, clock = router()
    full(core)
    adm = Admission(core, 5.0)
    tasks = [asyncio.create_task(adm.enter()) for _ in range(2)]
    await asyncio.sleep(0.01)
    clock.t += core.stale_after_s + 1  # the feed went quiet: routing is degraded
    await asyncio.wait_for(asyncio.gather(*tasks), 2.0)  # (the periodic look again)
    assert adm.timed_out == 0


def test_routers_take_turns_that_turn_with_each_snapshot() -> None:
    """While they tell each other their routes, each router releases a turn after the
    one before it (so it hears what that one routed); the order turns per snapshot."""
    cores = [router(i, 3)[0] for i in range(3)]
    for c in cores:
        full(c)  # version 3
    assert [release_delay(c) for c in cores] == [0.0, 0.0, 0.0]  # nothing told yet
    for c in cores:
        for other in cores:
            if other is not c:
                c.hear(other.told())
    assert all(c.told_routes.live for c in cores)
    delays = [release_delay(c) for c in cores]
    assert delays == [0.0, pytest.approx(0.008), pytest.approx(0.016)]  # (index + 3) % 3
    for c in cores:
        feed(c, 4, {"a": (1, 4), "b": (0, 4)}, {"a": 5, "b": 4})
    assert [release_delay(c) for c in cores] != delays
    assert release_delay(router()[0]) == 0.0  # alone: at once


def test_without_told_routes_a_router_releases_its_share_of_the_free_slots() -> None:
    """Every router sees the same free slots and none hears what the others send
    there: each takes its share (here a third), not all of them."""
    core, _ = router(0, 3)
    full(core)
    assert not core.told_routes.live
    assert releasable(core, 0) == 0
    share = core.share  # (estimated from the admitted counts: about, not exactly, 1/3)
    assert 0.1 < share < 0.9
    for free in (1, 3):
        taken = [releasable(core, free) for _ in range(4000)]
        assert set(taken) <= {int(free * share), int(free * share) + 1}
        assert abs(sum(taken) / len(taken) - free * share) < 0.05  # its share, on average
    alone, _ = router()
    full(alone)
    assert releasable(alone, 3) == 3


def test_only_the_default_policy_holds() -> None:
    assert RedisbalPolicy.holds
    assert not any(
        getattr(RouterCore(policy=p).policy, "holds", False)
        for p in ("least-inflight", "round-robin", "vllm-latest", "random")
    )


async def test_a_request_after_one_held_to_the_bound_takes_a_free_slot_at_once() -> None:
    core, _ = router()
    full(core)
    adm = Admission(core, 0.05)
    assert await adm.enter() >= 0.05  # held to the bound: its entry stays behind
    feed(core, 4, {"a": (1, 4), "b": (0, 3)}, {"a": 5, "b": 4})  # (no wake: none set)
    assert await adm.enter() == 0.0
