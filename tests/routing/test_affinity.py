"""What route() is told about a request: key affinity with bounded load, routes that
count by their size, and the checks on the arguments (pure logic, no Redis)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from support.helpers import make_snapshot

from redisbal.routing.policies import Policy, RedisbalPolicy
from redisbal.routing.router_core import RouterCore
from redisbal.routing.state import EngineView, RequestInfo, RoutingState


def cores(n_routers: int, loads: dict[str, tuple[int, int]], **kw: object) -> list[RouterCore]:
    out = []
    adm = {e: (0,) * n_routers for e in loads}
    for i in range(n_routers):
        core = RouterCore(i, n_routers, rng=random.Random(i), **kw)  # type: ignore[arg-type]
        core.apply_snapshot(make_snapshot(loads, admitted=adm))
        core.connected = True
        out.append(core)
    return out


def test_every_router_puts_a_key_on_the_same_engine() -> None:
    routers = cores(8, {f"e{i}": (0, 10) for i in range(16)})
    for key in (f"session-{k}" for k in range(50)):
        homes = set()
        for r in routers:
            d = r.route(key=key)
            homes.add(d.engine_id)
            r.unroute(d)  # placement only: no router's own routes pile up between snapshots
        assert len(homes) == 1


def test_a_key_leaves_its_engine_when_a_queued_request_would_wait_there() -> None:
    loads = {f"e{i}": (0, 64) for i in range(8)}  # full batches everywhere
    (core,) = cores(1, loads)
    home = core.route(key="s").engine_id
    core.unroute(core.route(key="s"))
    # the home has 3 queued, the others none: a cached prefix is not worth the wait
    queued = {**loads, home: (3, 64)}
    core.apply_snapshot(make_snapshot(queued, version=2, admitted={e: (1,) for e in loads}))
    assert core.route(key="s").engine_id != home


def test_keys_spread_over_the_engines() -> None:
    (core,) = cores(1, {f"e{i}": (0, 10) for i in range(8)})
    home = Counter()
    for k in range(800):
        d = core.route(key=f"k{k}")
        home[d.engine_id] += 1
        core.unroute(d)  # measure placement only, not the bound
    assert set(home) == {f"e{i}" for i in range(8)}
    assert max(home.values()) < 3 * min(home.values())


def test_keys_that_never_come_back_route_by_load_and_keys_that_do_by_the_ring() -> None:
    loads = {f"e{i}": (0, 4) for i in range(8)}
    (core,) = cores(1, loads)
    policy = core.policy
    assert isinstance(policy, RedisbalPolicy)
    (ref,) = cores(1, loads)  # where the ring puts a key (a given key is always followed)

    def home(key: str) -> str:
        d = ref.route(key=key)
        ref.unroute(d)
        return d.engine_id

    # a new key per request: keys do not count, and load decides
    for k in range(300):
        core.unroute(core.route(key=f"once-{k}", key_guessed=True))
    assert policy.key_repeats(core) < policy.affinity_repeats
    light = {**loads, "e3": (0, 3)}  # the least loaded, by less than affinity_slack
    core.apply_snapshot(make_snapshot(light, version=2, admitted={e: (1,) for e in loads}))
    keys = [f"new-{k}" for k in range(40) if home(f"new-{k}") != "e3"][:10]
    for key in keys:
        d = core.route(key=key, key_guessed=True)
        assert d.engine_id == "e3"  # the least-loaded engine, not the key's
        core.unroute(d)
    before = policy.repeats
    for key in keys:  # the same keys given (X-Redisbal-Key, route(key=...)): followed
        d = core.route(key=key)
        assert d.engine_id == home(key)
        core.unroute(d)
    assert policy.repeats == before  # and not counted
    # keys that come back: each goes where this router sent it (its cache), while that
    # engine is about as free as the least loaded; and new keys now go by the ring
    for _ in range(10):
        for key in keys:
            d = core.route(key=key, key_guessed=True)
            assert d.engine_id == "e3"
            core.unroute(d)
    assert policy.key_repeats(core) >= policy.affinity_repeats
    shifted = {**loads, "e5": (0, 3)}  # e3 is no longer the least loaded, by one request
    core.apply_snapshot(make_snapshot(shifted, version=3, admitted={e: (2,) for e in loads}))
    for key in keys:
        d = core.route(key=key, key_guessed=True)
        assert d.engine_id == "e3"
        core.unroute(d)
    fresh = [f"fresh-{k}" for k in range(40) if home(f"fresh-{k}") not in ("e3", "e5")][:10]
    for key in fresh:
        d = core.route(key=key, key_guessed=True)
        assert d.engine_id == home(key)
        core.unroute(d)
    hot = {**loads, "e3": (6, 8)}  # a queue where the keys went: they leave it
    core.apply_snapshot(make_snapshot(hot, version=4, admitted={e: (3,) for e in loads}))
    for key in keys:
        d = core.route(key=key, key_guessed=True)
        assert d.engine_id != "e3"
        core.unroute(d)


def test_a_router_counts_the_returns_it_does_not_see() -> None:
    routers = cores(16, {f"e{i}": (0, 4) for i in range(8)})
    rng = random.Random(0)
    for k in range(6000):  # every key sent twice, each time through any of 16 routers
        for _ in range(2):
            r = routers[rng.randrange(16)]
            r.unroute(r.route(key=f"user-{k}", key_guessed=True))
    for r in routers:
        policy = r.policy
        assert isinstance(policy, RedisbalPolicy)
        # half the requests come back, 1/16 of those to the router that saw the first
        assert policy.repeats < policy.affinity_repeats
        assert policy.key_repeats(r) == pytest.approx(min(1.0, 16 * policy.repeats))
        assert policy.key_repeats(r) >= policy.affinity_repeats


def test_a_loaded_home_sends_the_key_clockwise_and_it_comes_back() -> None:
    loads = {f"e{i}": (0, 10) for i in range(8)}
    (core,) = cores(1, loads)
    home = core.route(key="s").engine_id
    core.unroute(core.route(key="s"))
    hot = {**loads, home: (30, 64)}  # far above 1.25 x (mean + one route)
    core.apply_snapshot(make_snapshot(hot, version=2, admitted={e: (1,) for e in loads}))
    moved = core.route(key="s").engine_id
    assert moved != home
    assert core.route(key="s").engine_id == moved  # the key's second engine, not a random one
    core.apply_snapshot(make_snapshot(loads, version=3, admitted={e: (3,) for e in loads}))
    assert core.route(key="s").engine_id == home


def test_without_a_known_running_cap_kv_room_keeps_a_key_home() -> None:
    loads = {f"e{i}": (0, 4) for i in range(8)}  # no queue anywhere: the cap is unknown
    (core,) = cores(1, loads)
    home = core.route(key="s").engine_id
    core.unroute(core.route(key="s"))
    assert core.running_cap == 0
    busier = {**loads, home: (0, 9)}  # 5 more running than the rest: not within one request
    for version, kv, stays in ((2, 0.5, True), (3, 0.95, False)):
        kvs = {e: 0.3 for e in loads} | {home: kv}
        adm = {e: (version,) for e in loads}
        core.apply_snapshot(make_snapshot(busier, version=version, kv=kvs, admitted=adm))
        d = core.route(key="s")
        assert (d.engine_id == home) is stays, (kv, d.engine_id)
        core.unroute(d)


def test_a_hot_key_is_bounded_not_piled_on_one_engine() -> None:
    (core,) = cores(1, {f"e{i}": (0, 0) for i in range(8)})
    got = Counter(core.route(key="hot").engine_id for _ in range(80))
    assert max(got.values()) <= 1.25 * (80 / 8 + 1) + 1


def sized() -> RedisbalPolicy:
    """The default policy with ``use_cost`` on: routes count by their size."""
    policy = RedisbalPolicy()
    policy.use_cost = True
    return policy


def test_with_use_cost_a_large_route_counts_more_than_a_small_one() -> None:
    (core,) = cores(1, {"a": (0, 0), "b": (0, 0)}, policy=sized())
    for _ in range(50):  # the typical size
        core.unroute(core.route(prompt_tokens=1000, output_tokens=100))
    big = core.route(engine_id="a", prompt_tokens=20000, output_tokens=2000)
    small = core.route(engine_id="b", prompt_tokens=100, output_tokens=10)
    views = {e.engine_id: e for e in core.known}
    assert views["a"].pending == views["b"].pending == 1
    assert views["a"].pending_cost > 5 * views["b"].pending_cost
    # the next request without a size goes where the small one went
    assert core.route().engine_id == "b"
    core.finished(big)
    core.finished(small)


def test_costs_of_routes_the_snapshot_counted_are_dropped() -> None:
    (core,) = cores(1, {"a": (0, 0)}, policy=sized())
    for size in (100, 100, 5000):
        core.route(prompt_tokens=size, output_tokens=50)
    e = core.known[0]
    assert e.pending == 3
    # the engine admitted the two oldest: the newest (the large one) is still pending
    core.apply_snapshot(make_snapshot({"a": (2, 0)}, version=2, admitted={"a": (2,)}))
    assert e.pending == 1
    assert e.pending_cost == pytest.approx(e.costs[0]) and len(e.costs) == 1
    assert e.pending_cost > 1.0


def test_routes_without_a_size_count_one() -> None:
    (core,) = cores(1, {"a": (0, 0)})
    for _ in range(4):
        core.route()
    assert core.known[0].pending_cost == 4.0


class Recorder(Policy):
    name = "recorder"

    def __init__(self) -> None:
        self.seen: list[RequestInfo | None] = []

    def pick(self, core: RoutingState) -> EngineView:
        self.seen.append(core.request)
        return core.engines[0]

    def routed(self, core: RoutingState, eng: EngineView) -> None:
        self.seen.append(core.request)


def test_a_policy_reads_the_request_in_pick_and_routed_and_only_then() -> None:
    rec = Recorder()
    core = RouterCore(0, 1, rec)
    core.apply_snapshot(make_snapshot({"a": (0, 0)}))
    core.route(key="k", prompt_tokens=10, blocks=[1, 2])
    core.route()
    info = RequestInfo("k", 10, None, (1, 2))
    assert rec.seen == [info, info, None, None]
    assert core.request is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"key": 3}, "key must be a str"),
        ({"key": "x" * 2000}, "key must be a str of at most 1024"),
        ({"prompt_tokens": -1}, "prompt_tokens must be a whole number"),
        ({"output_tokens": 2.5}, "output_tokens must be a whole number"),
        ({"prompt_tokens": True}, "prompt_tokens must be a whole number"),
        ({"blocks": ["a"]}, "blocks must be integers"),
        ({"blocks": [1, 2, True]}, "blocks must be integers"),
        ({"key": "k", "key_guessed": 1}, "key_guessed must be True or False"),
    ],
)
def test_bad_request_info_is_a_clear_error_and_routes_nothing(
    kwargs: dict[str, object], message: str
) -> None:
    (core,) = cores(1, {"a": (0, 0)})
    with pytest.raises(ValueError, match=message):
        core.route(**kwargs)  # type: ignore[arg-type]
    assert core.known[0].routed == 0 and core.request is None


def test_by_default_every_route_counts_one() -> None:
    """The default (``use_cost`` off): a route holds one slot whatever its prompt, so
    pending counts routes, not sizes."""
    (core,) = cores(1, {"a": (0, 0), "b": (0, 0)})
    for _ in range(50):
        core.unroute(core.route(prompt_tokens=1000, output_tokens=100))
    core.route(engine_id="a", prompt_tokens=20000, output_tokens=2000)
    core.route(engine_id="b", prompt_tokens=100, output_tokens=10)
    views = {e.engine_id: e for e in core.known}
    assert views["a"].pending_cost == views["b"].pending_cost == 1.0


def test_a_router_forgets_its_oldest_keys_first() -> None:
    (core,) = cores(1, {f"e{i}": (0, 4) for i in range(8)})
    policy = core.policy
    assert isinstance(policy, RedisbalPolicy)
    policy.recent_keys = 3
    for key in ("a", "b", "c", "a", "d"):  # "a" came back before "d": "b" is the oldest
        core.unroute(core.route(key=key, key_guessed=True))
    before = policy.repeats
    core.unroute(core.route(key="a", key_guessed=True))
    assert policy.repeats > before  # still remembered
    before = policy.repeats
    core.unroute(core.route(key="b", key_guessed=True))
    assert policy.repeats < before  # forgotten: a new key


def test_a_guessed_key_does_not_follow_its_engine_out_of_the_deployment() -> None:
    loads = {f"e{i}": (0, 4) for i in range(4)}
    (core,) = cores(1, loads)
    d = core.route(key="u", key_guessed=True)
    core.unroute(d)
    went = d.engine_id
    d = core.route(key="u", key_guessed=True)
    core.unroute(d)
    assert d.engine_id == went  # where its cache is
    rest = {e: v for e, v in loads.items() if e != went}
    core.apply_snapshot(make_snapshot(rest, version=2, admitted={e: (1,) for e in rest}))
    assert core.route(key="u", key_guessed=True).engine_id in rest
