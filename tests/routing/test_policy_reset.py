"""The default policy's per-snapshot reset is written for speed (scores inlined, see
RedisbalPolicy._heap); these tests hold it to the straightforward computation: the
same heap entries (scores, random draws, generations) and so the same picks."""

from __future__ import annotations

import heapq
import random
import zlib
from typing import Any

import orjson
import pytest
from support.helpers import make_snapshot

from redisbal.barrier.snapshot import Rosters, Snapshot
from redisbal.routing.policies import RedisbalPolicy
from redisbal.routing.router_core import RouterCore
from redisbal.routing.state import EngineView, RoutingState

Entry = tuple[float, float, int, str]


class Reference(RedisbalPolicy):
    """RedisbalPolicy with its reset as first written: score() called for each engine."""

    def _dither(self, core: RoutingState) -> None:
        super()._dither(core)  # (for its routes-per-snapshot bookkeeping)
        snap = core.snapshot
        salt = (snap.version if snap is not None else 0).to_bytes(8, "little", signed=False)
        w = core.share_weight
        w = min(w, max(1.0, self.dither_gain * self.routes_per_snapshot * w))
        base = core.client_index / core.client_count
        for e in core.engines:
            phi = zlib.crc32(salt, zlib.crc32(e.engine_id.encode())) / 4294967296.0
            e.dither = (base + phi) % 1.0 * w

    def _heap(self, core: RoutingState) -> list[tuple[float, float, int, EngineView]]:
        heap = [(self.score(core, e), core.rng.random(), e.gen, e) for e in core.engines]
        heapq.heapify(heap)
        return heap


def entries(policy: RedisbalPolicy) -> list[Entry]:
    return [(s, r, g, e.engine_id) for s, r, g, e in policy.heap]


def snapshot(
    version: int,
    rng: random.Random,
    core: RouterCore,
    adm: dict[str, list[int]],
    compact: bool,
    kv: bool,
) -> bytes:
    """A cut with new counts of adm's engines: compact, or full with admitted counts
    for most engines (exact reconciliation, share and speed estimates, aged loads);
    core's routes are admitted (index 1) some of them late. ``kv``: some engines tell
    their KV usage (no cap is known, so their KV cache binds: running requests count
    by their KV); else none does (the inlined score)."""
    engines = list(adm)
    time_ms = 1_000_000 + 20 * version
    counts = {
        e: (
            rng.randint(0, 4),
            rng.randint(5, 30),
            rng.choice([None, rng.random()]) if kv else None,
            rng.randint(0, 15),
        )
        for e in engines
    }
    head: dict[str, Any] = {
        "deployment": "d",
        "epoch": "ep",
        "version": version,
        "wave": 0,
        "step": version,
        "forced": False,
        "laggards": {},
        "gone": {},
        "joining": [],
        "time_ms": time_ms,
        "stalled": {rng.choice(engines): 500} if rng.random() < 0.05 else {},
        "suspect": {},
    }
    if compact:
        flat = [x for c in counts.values() for x in c]
        doc = head | {"roster": len(engines), "ids": engines, "incs": ["-"] * len(engines)}
        return orjson.dumps(doc | {"counts": flat})
    full = {}
    for i, (e, (w, r, kv, age)) in enumerate(counts.items()):
        prev, routed = adm[e], core.by_id[e].routed if e in core.by_id else 0
        adm[e] = [a + rng.randint(5, 15) * (1 + i % 3) for a in prev]  # some engines faster
        adm[e][1] = max(prev[1], routed - rng.randint(0, 5))
        c = {"wave": 0, "step": version, "waiting": w, "running": r, "kv": kv, "t": time_ms - age}
        full[e] = c | ({"adm": adm[e]} if rng.random() < 0.9 else {})
    return orjson.dumps(head | {"engines": full})


@pytest.mark.parametrize(
    "settings",
    [{}, {"use_age": False}, {"use_speed": True}, {"p2c_from": 4}],
    ids=["default", "no-age", "speed", "p2c"],
)
@pytest.mark.parametrize("kv", [False, True], ids=["slots", "kv-bound"])
@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_reset_makes_the_straightforward_heap_and_picks(
    seed: int, settings: dict[str, Any], kv: bool
) -> None:
    now = [100.0]
    cores: list[RouterCore] = []
    for cls in (RedisbalPolicy, Reference):
        policy = cls()
        for k, v in settings.items():
            setattr(policy, k, v)
        core = RouterCore(1, 4, policy, clock=lambda: now[0], rng=random.Random(seed))
        core.connected = True
        cores.append(core)
    rng = random.Random(seed)
    engines = [f"e{i}" for i in range(rng.randint(30, 60))]
    adm = {e: [0] * 4 for e in engines}
    seen_aged = seen_cost = seen_speed = seen_kv = 0
    for version in range(1, 90):
        compact = version > 60 and version % 3 == 0
        raw = snapshot(version, rng, cores[0], adm, compact, kv)
        for core in cores:
            assert core.apply_snapshot(Snapshot.from_json(raw, Rosters()))
        policies = [core.policy for core in cores]
        assert isinstance(policies[0], RedisbalPolicy) and isinstance(policies[1], Reference)
        assert entries(policies[0]) == entries(policies[1])
        seen_aged += any(e.aged for e in cores[0].engines)
        seen_cost += any(e.pending_cost for e in cores[0].engines)
        seen_speed += any(e.speed != 1.0 for e in cores[0].engines)
        seen_kv += policies[0]._kv_full > 0
        outstanding: list[list[Any]] = []
        for _ in range(rng.randint(0, 60)):
            now[0] += rng.random() * 0.002
            kw: dict[str, Any] = {}
            if rng.random() < 0.2:
                kw["key"] = f"k{rng.randint(0, 9)}"
            if rng.random() < 0.8:
                kw["prompt_tokens"] = rng.randint(1, 3000)
            pin = rng.choice(engines) if rng.random() < 0.05 else None
            decisions = [core.route(pin, **kw) for core in cores]
            assert decisions[0].engine_id == decisions[1].engine_id
            outstanding.append(decisions)
            if rng.random() < 0.3:
                done = outstanding.pop(rng.randrange(len(outstanding)))
                end = rng.choice(["finished", "finished", "unroute", "failed"])
                for core, d in zip(cores, done, strict=True):
                    getattr(core, end)(d)
                assert entries(policies[0]) == entries(policies[1])
        now[0] += 0.02
    assert cores[0].rng.random() == cores[1].rng.random()  # as many draws on both
    assert seen_cost > 10
    if settings.get("use_age", True):
        assert seen_aged > 10  # the age term was exercised
    if settings.get("use_speed"):
        assert seen_speed > 10  # and the speed term
    assert (seen_kv > 10) if kv else (seen_kv == 0)  # running counted by KV, or never


def test_a_subclass_score_is_used_by_reset() -> None:
    class Busiest(RedisbalPolicy):
        def score(self, core: RoutingState, e: EngineView) -> float:
            return -float(e.running)

    core = RouterCore(0, 1, Busiest(), rng=random.Random(1))
    core.apply_snapshot(make_snapshot({"e0": (0, 3), "e1": (0, 9), "e2": (0, 5)}))
    assert core.route().engine_id == "e1"
