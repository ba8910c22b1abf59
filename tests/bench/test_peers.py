"""The benchmark's peer routers (redisbal.bench.peer_policies), each on its defining behaviour,
on a RouterCore fed hand-built snapshots (no Redis, a fake clock, seeded RNGs)."""

from __future__ import annotations

import bisect
import random

import pytest
from support.helpers import make_snapshot

from redisbal.bench.peer_policies import (
    PEER_POLICIES,
    REFERENCE_KV_BLOCKS,
    BoundedLoadHashPolicy,
    LlmdPolicy,
    SglangCacheAwarePolicy,
    _point,
    make_peer,
)
from redisbal.routing.policies import Policy
from redisbal.routing.router_core import RouterCore
from redisbal.routing.state import Decision, RequestInfo


class FakeClock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class FixedRng(random.Random):
    """random() returns the given values in turn (0.5 once they run out)."""

    def __init__(self, values: list[float]) -> None:
        super().__init__(0)
        self.values = values

    def random(self) -> float:
        return self.values.pop(0) if self.values else 0.5


def make_core(policy: Policy, seed: int = 7) -> RouterCore:
    core = RouterCore(0, 1, policy, clock=FakeClock(), rng=random.Random(seed))
    core.connected = True
    return core


def idle(*names: str) -> dict[str, tuple[int, int]]:
    return dict.fromkeys(names, (0, 0))


def pin(core: RouterCore, engine: str, times: int, **request: object) -> list[Decision]:
    return [core.route(engine, **request) for _ in range(times)]  # type: ignore[arg-type]


# -- p2c ---------------------------------------------------------------------------------------


def test_p2c_takes_the_lesser_in_flight_of_its_two_samples() -> None:
    core = make_core(make_peer("p2c"))
    core.apply_snapshot(make_snapshot(idle("e0", "e1", "e2")))
    pin(core, "e0", 3)
    pin(core, "e2", 1)  # e1 (0 in flight) is the least loaded of all
    core.rng = FixedRng([0.1, 0.9])  # samples e0, then e2 (the second of the other two)
    assert core.route().engine_id == "e2", "the lesser of the two samples, not the global min"


def test_p2c_samples_two_distinct_engines_and_the_first_wins_a_tie() -> None:
    core = make_core(make_peer("p2c"))
    core.apply_snapshot(make_snapshot(idle("e0", "e1", "e2")))
    pin(core, "e0", 1)
    pin(core, "e2", 1)
    core.rng = FixedRng([0.9, 0.1])  # e2 then e0: tied, the first sampled wins
    assert core.route().engine_id == "e2"
    core.rng = FixedRng([0.1, 0.9])  # e0 then e2 (now 1 vs 2)
    assert core.route().engine_id == "e0"
    # with two engines both are always sampled: the one in flight is never chosen
    two = make_core(make_peer("p2c"))
    two.apply_snapshot(make_snapshot(idle("a", "b")))
    pin(two, "a", 1)
    picks = set()
    for _ in range(20):
        d = two.route()
        picks.add(d.engine_id)
        two.finished(d)
    assert picks == {"b"}


def test_p2c_ignores_the_snapshot_queues() -> None:
    core = make_core(make_peer("p2c"))
    core.apply_snapshot(make_snapshot({"a": (500, 500), "b": (0, 0)}))
    picks = [core.route().engine_id for _ in range(10)]
    assert sorted(picks) == ["a"] * 5 + ["b"] * 5  # in-flight counts alternate them


# -- sglang cache_aware ------------------------------------------------------------------------


def test_sglang_follows_the_longest_prefix_when_balanced() -> None:
    pol = SglangCacheAwarePolicy()
    core = make_core(pol)
    core.apply_snapshot(make_snapshot(idle("e0", "e1", "e2")))
    first = core.route(blocks=[1, 2, 3, 4]).engine_id  # no match: the smallest tree
    assert pol.tree_size(first) == 4
    assert core.route(blocks=[1, 2, 3, 5]).engine_id == first  # 3/4 > 0.3
    other = core.route(blocks=[9, 10]).engine_id  # no match: an empty tree
    assert other != first
    assert pol.tree_size(other) == 2
    # a match of 1/4 is not above cache_threshold (0.3): the smallest tree again
    third = core.route(blocks=[9, 20, 21, 22]).engine_id
    assert third not in (first, other)


def test_sglang_goes_to_the_least_loaded_only_past_both_thresholds() -> None:
    """Imbalanced iff max - min > 64 and max > min * 1.5 (SGLang's defaults), on
    this router's own in-flight counts."""
    core = make_core(SglangCacheAwarePolicy())
    core.apply_snapshot(make_snapshot(idle("e0", "e1")))
    pin(core, "e0", 1, blocks=[1, 2, 3])
    pin(core, "e0", 69)  # e0: 70 in flight, e1: 0; 70 > 0 * 1.5 and 70 - 0 > 64
    assert core.route(blocks=[1, 2, 3]).engine_id == "e1", "imbalanced: least loaded"
    # the least-loaded route still went into e1's tree
    assert core.policy.tree_size("e1") == 3  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("e0_load", "e1_load", "expect"),
    [
        (70, 10, "e0"),  # diff 60 <= 64: balanced, the cache wins
        (200, 135, "e0"),  # diff 65 but 200 <= 135 * 1.5: balanced
        (200, 130, "e1"),  # diff 70 and 200 > 195: imbalanced
    ],
)
def test_sglang_needs_both_thresholds(e0_load: int, e1_load: int, expect: str) -> None:
    pol = SglangCacheAwarePolicy()
    core = make_core(pol)
    core.apply_snapshot(make_snapshot(idle("e0", "e1")))
    pin(core, "e0", 1, blocks=[7, 8])
    pin(core, "e0", e0_load - 1)
    pin(core, "e1", e1_load)
    assert core.route(blocks=[7, 8, 9]).engine_id == expect


def test_sglang_without_blocks_goes_to_the_smallest_tree_in_a_fixed_order() -> None:
    pol = SglangCacheAwarePolicy()
    core = make_core(pol)
    core.apply_snapshot(make_snapshot(idle("e0", "e1", "e2")))
    # empty text: match rate 0, smallest tree; nothing is inserted, so it stays smallest
    picks = {core.route().engine_id for _ in range(10)}
    assert len(picks) == 1
    (only,) = picks
    assert only == pol.order[0]


def test_sglang_tree_evicts_each_tenants_least_recent_leaves_at_its_limit() -> None:
    pol = SglangCacheAwarePolicy(max_tree_blocks=4)
    core = make_core(pol)
    core.apply_snapshot(make_snapshot(idle("e0", "e1")))
    pin(core, "e0", 1, blocks=[1, 2, 3])
    pin(core, "e1", 1, blocks=[1, 2, 4])  # shares blocks 1, 2 with e0
    pin(core, "e0", 1, blocks=[7, 8, 9])
    assert pol.tree_size("e0") == 4  # 3 and then 2 went: the old prompt's leaves first
    assert pol.tree_size("e1") == 3
    assert pol.prefix_match([7, 8, 9]) == (3, "e0")
    assert pol.prefix_match([1, 2, 3])[0] == 2  # block 2 is still e1's; 3 is gone
    assert set(pol.nodes[1]) == {"e0", "e1"}
    assert set(pol.nodes[2]) == {"e1"}


def test_sglang_tree_limit_scales_with_the_engines_kv_cache() -> None:
    assert SglangCacheAwarePolicy().max_tree_blocks == 2**20  # 2**26 chars / 64 per block
    small = make_peer("sglang-cache-aware", kv_blocks=1000)
    assert small.max_tree_blocks == round(1000 * 2**20 / REFERENCE_KV_BLOCKS)  # type: ignore[attr-defined]


# -- llm-d -------------------------------------------------------------------------------------


def test_llmd_score_arithmetic_on_a_hand_computed_example() -> None:
    pol = LlmdPolicy()
    core = make_core(pol)
    snap = make_snapshot(
        {"a": (0, 5), "b": (4, 5), "c": (2, 5)}, kv={"a": 0.5, "b": 0.25, "c": 0.1}
    )
    core.apply_snapshot(snap)
    pin(core, "b", 1, blocks=[1, 2, 3, 4])
    pin(core, "c", 1, blocks=[1, 2])
    core.request = RequestInfo(blocks=(1, 2, 3, 4))
    scores = pol.scores(core)
    core.request = None
    # queue: (4 - w) / 4; kv: 1 - usage; prefix: blocks held / 4; weights 2, 2, 3
    assert scores["a"] == pytest.approx(2 * 1.0 + 2 * 0.5 + 3 * 0.0)  # 3.0
    assert scores["b"] == pytest.approx(2 * 0.0 + 2 * 0.75 + 3 * 1.0)  # 4.5
    assert scores["c"] == pytest.approx(2 * 0.5 + 2 * 0.9 + 3 * 0.5)  # 4.3
    assert core.route(blocks=[1, 2, 3, 4]).engine_id == "b"
    assert core.route(blocks=[50, 51]).engine_id == "a"  # no prefix: queue + KV


def test_llmd_prefix_walk_stops_at_the_first_block_no_engine_holds() -> None:
    pol = LlmdPolicy(kv_blocks=2)  # an LRU of two block hashes per engine
    core = make_core(pol)
    core.apply_snapshot(make_snapshot(idle("a", "b")))
    pin(core, "a", 1, blocks=[1, 2, 3])  # hash 1 is evicted, 2 and 3 stay
    assert pol.match([1, 2, 3]) == {}
    assert pol.match([2, 3]) == {"a": 2}
    assert 1 not in pol.hash_to_pods


def test_llmd_breaks_ties_at_random_and_does_not_bump_its_own_routes() -> None:
    core = make_core(LlmdPolicy())
    core.apply_snapshot(make_snapshot(idle("a", "b", "c")))
    picks = [core.route().engine_id for _ in range(300)]
    assert {p: picks.count(p) > 50 for p in "abc"} == dict.fromkeys("abc", True)


# -- consistent hashing with bounded loads -----------------------------------------------------


def clockwise(pol: BoundedLoadHashPolicy, key: str) -> list[str]:
    """The distinct engines clockwise from the key's point."""
    at = bisect.bisect_left(pol.ring, _point(key.encode()))
    out: list[str] = []
    for k in range(len(pol.ring)):
        eid = pol.owner[(at + k) % len(pol.ring)].engine_id
        if eid not in out:
            out.append(eid)
    return out


def test_chbl_keeps_a_key_on_its_engine_until_the_bound_then_moves_clockwise() -> None:
    pol = BoundedLoadHashPolicy()
    core = make_core(pol)
    core.apply_snapshot(make_snapshot(idle("e0", "e1", "e2", "e3")))
    for e in ("e0", "e1", "e2", "e3"):
        pin(core, e, 2)  # 8 in flight
    home, nxt = clockwise(pol, "session-42")[:2]
    # capacity ceil(1.25 (m + 1) / 4): m=8 -> 3, m=9 -> 4, m=10 -> 4
    d1 = core.route(key="session-42")
    d2 = core.route(key="session-42")
    assert (d1.engine_id, d2.engine_id) == (home, home)  # 3 then 4 in flight there
    assert core.route(key="session-42").engine_id == nxt, "home is at the bound"
    core.finished(d1)
    assert core.route(key="session-42").engine_id == home  # room again


def test_chbl_is_consistent_across_routers_and_hashes_the_first_block_without_a_key() -> None:
    a, b = make_core(BoundedLoadHashPolicy(), seed=1), make_core(BoundedLoadHashPolicy(), seed=2)
    for core in (a, b):
        core.apply_snapshot(make_snapshot(idle(*(f"e{i}" for i in range(8)))))
    keys = [f"k{i}" for i in range(40)]
    assert [a.route(key=k).engine_id for k in keys] == [b.route(key=k).engine_id for k in keys]
    c = make_core(BoundedLoadHashPolicy())
    c.apply_snapshot(make_snapshot(idle(*(f"e{i}" for i in range(8)))))
    first = c.route(blocks=[99, 1]).engine_id
    c.route(first)  # its load now 2 of m=2: capacity ceil(1.25 * 3 / 8) = 1, so it is full
    assert c.route(blocks=[99, 2]).engine_id != first
    # with neither key nor blocks: the least in flight
    for e in c.engines:
        if e.inflight == 0 and e.engine_id != "e5":
            c.route(e.engine_id)
    assert c.route().engine_id == "e5"


# -- all of them -------------------------------------------------------------------------------


def _run(name: str, seed: int) -> list[str]:
    core = make_core(make_peer(name), seed=seed)
    core.apply_snapshot(make_snapshot({f"e{i}": (i % 3, i % 5) for i in range(16)}))
    req = random.Random(99)
    out, live = [], []
    for i in range(400):
        blocks = [req.randrange(6)]  # chained, as block hashes are
        for _ in range(req.randrange(4)):
            blocks.append(blocks[-1] * 31 + req.randrange(4) + 7)
        d = core.route(key=f"s{req.randrange(30)}" if i % 2 else None, blocks=blocks)
        out.append(d.engine_id)
        live.append(d)
        if req.random() < 0.4:
            core.finished(live.pop(req.randrange(len(live))))
    return out


@pytest.mark.parametrize("name", list(PEER_POLICIES))
def test_each_peer_is_deterministic_with_a_seeded_rng(name: str) -> None:
    assert _run(name, 5) == _run(name, 5)
    assert make_peer(name).name == name


def test_make_peer_rejects_unknown_names_and_bad_sizes() -> None:
    with pytest.raises(ValueError, match="unknown peer policy 'nope'; choose from p2c"):
        make_peer("nope")
    with pytest.raises(ValueError, match="kv_blocks must be a whole number"):
        make_peer("llmd", kv_blocks=0)
    assert make_peer("llmd", kv_blocks=500).lru_capacity == 500  # type: ignore[attr-defined]
    assert make_peer("p2c", kv_blocks=500).name == "p2c"  # not sized by the KV cache


def test_peer_gateway_gives_the_gateway_every_keyword_it_requires() -> None:
    """scripts/peer_gateway.py serves the variants and emulations through the gateway's
    own _serve: a keyword the gateway gained must come from its defaults, not a
    TypeError at the benchmark's start."""
    import inspect

    from support.scripts import load_script

    from redisbal.gateway import cli

    script = load_script("peer_gateway")
    given = dict.fromkeys(script.SET_HERE, None)
    kw = script.serve_kwargs(**given)
    params = inspect.signature(cli._serve).parameters.values()
    required = {p.name for p in params if p.kind is p.KEYWORD_ONLY and p.default is p.empty}
    assert required <= set(kw)
    assert kw["max_attempts"] == 3 and kw["host"] is None  # a default, and given over it
    inspect.signature(cli._serve).bind("redis://x", "d", **kw)
