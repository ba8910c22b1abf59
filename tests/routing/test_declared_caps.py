"""A running cap the engines declared (redisbal.running_caps) in the router's room:
known from the first report, before any queue formed, where the learned cap
(estimates.RunningCap) waits for one. Pure logic (snapshots made by hand), and a
router's feed reading the caps from a real Redis."""

from __future__ import annotations

import asyncio
import logging
import random

import pytest
import redis
from support.helpers import Barrier, await_until, make_snapshot

from redisbal import AsyncReporter, Counts
from redisbal.keys import DeploymentKeys
from redisbal.routing.admission import free_slots
from redisbal.routing.estimates import engine_cap, room
from redisbal.routing.policies import RedisbalPolicy
from redisbal.routing.router import AsyncRouter
from redisbal.routing.router_core import RouterCore


def plugin_router() -> RouterCore:
    core = RouterCore(0, 1, rng=random.Random(1), clock=lambda: 100.0)
    core.connected = True
    return core


def plugin_feed(core: RouterCore, version: int, counts: dict[str, tuple[int, int]]) -> None:
    """A snapshot as vLLM's plugin feeds one: (waiting, running), no admitted counts."""
    core.apply_snapshot(make_snapshot(counts, version=version, time_ms=1_000_000 + 10 * version))


def test_the_declared_cap_bounds_the_room_from_the_first_report() -> None:
    core = plugin_router()
    core.set_declared_caps({"a": 4, "b": 4})
    plugin_feed(core, 1, {"a": (0, 3), "b": (0, 4)})
    assert core.running_cap == 0  # nothing learned: no queue formed
    a, b = core.by_id["a"], core.by_id["b"]
    assert (engine_cap(a, core.running_cap), engine_cap(b, core.running_cap)) == (4, 4)
    assert room(a, core.running_cap, 1.0) == 1 and room(b, core.running_cap, 1.0) == 0
    assert free_slots(core) == 1  # a's one free slot: holding can count it
    core.route("a")
    assert free_slots(core) == 0  # every engine full: a request would be held


def test_without_a_declared_cap_nothing_is_known_before_a_queue() -> None:
    """The same reports without declared caps: the room is unknown, nothing held."""
    core = plugin_router()
    plugin_feed(core, 1, {"a": (0, 3), "b": (0, 4)})
    assert free_slots(core) is None


def test_an_engine_without_a_declared_cap_keeps_the_room_unknown() -> None:
    """One engine that declared none (a mixed deployment): its room is unknown, so
    nothing is held (routed at once where the router is unsure)."""
    core = plugin_router()
    core.set_declared_caps({"a": 4})
    plugin_feed(core, 1, {"a": (0, 4), "b": (0, 4)})
    assert core.by_id["b"].declared_cap == 0
    assert free_slots(core) is None


def test_caps_reach_engines_seen_later_and_leave_with_them() -> None:
    core = plugin_router()
    core.set_declared_caps({"a": 2, "c": 8})
    plugin_feed(core, 1, {"a": (0, 0)})
    plugin_feed(core, 2, {"a": (0, 0), "c": (0, 1)})  # c comes after the caps were read
    assert core.by_id["c"].declared_cap == 8
    core.set_declared_caps({"a": 2})  # c left: its cap is gone from the hash
    assert core.by_id["c"].declared_cap == 0


def test_a_queue_below_the_declared_cap_does_not_lower_it() -> None:
    """A queue at 3 running (KV room or the prefill budget held it back) teaches a learned
    cap of 3; an engine that declared 8 keeps 8 (docs/DESIGN.md)."""
    core = plugin_router()
    core.set_declared_caps({"a": 8})
    plugin_feed(core, 1, {"a": (2, 3), "b": (2, 3)})
    plugin_feed(core, 2, {"a": (2, 3), "b": (2, 3)})  # a queue in two reports in a row
    assert core.running_cap == 3  # learned
    assert engine_cap(core.by_id["a"], core.running_cap) == 8
    assert engine_cap(core.by_id["b"], core.running_cap) == 3


def test_the_slot_policies_score_by_the_declared_cap() -> None:
    """The policies that weigh free slots (sed's slots form) read the declared cap too."""
    policy = RedisbalPolicy()
    policy.use_slots = True
    core = RouterCore(0, 1, policy, rng=random.Random(1))
    core.connected = True
    core.set_declared_caps({"a": 2, "b": 8})
    plugin_feed(core, 1, {"a": (0, 2), "b": (0, 2)})
    # a is at its cap: one more waits there behind a full batch; b runs 2 of 8
    a, b = policy.score(core, core.by_id["a"]), policy.score(core, core.by_id["b"])
    assert a - core.by_id["a"].dither == 4.0 and b - core.by_id["b"].dither == 2.0
    assert core.route().engine_id == "b"


async def test_a_router_reads_the_caps_the_engines_declared(
    r: redis.Redis, redis_url: str, keys: DeploymentKeys
) -> None:
    """Real Redis: a reporter declares its engines' cap, a router's feed reads it when it
    sees them (before any queue), and drops it when one leaves."""
    Barrier(r, keys).configure()
    rep = AsyncReporter(redis_url, keys.deployment, ["e0", "e1"], running_cap=4, mode="tick")
    other = AsyncReporter(redis_url, keys.deployment, "e2", mode="tick")  # declares none
    router = AsyncRouter(redis_url, keys.deployment)
    try:
        await rep.register()
        await other.register()
        await rep.report_many({e: Counts(None, 0, 1) for e in ("e0", "e1")})
        await other.report(Counts(None, 0, 1))
        await router.start(wait=5.0)
        core = router.core

        def caps() -> dict[str, int]:
            return {e: v.declared_cap for e, v in core.by_id.items()}

        await await_until(lambda: caps() == {"e0": 4, "e1": 4, "e2": 0}, 5.0, "the caps read")
        assert core.running_cap == 0  # none learned: the declared ones are known anyway
        await rep.aclose()  # e0 and e1 leave: their caps with them
        await await_until(lambda: "e0" not in core.declared and "e1" not in core.declared, 10.0)
    finally:
        await router.aclose()
        await rep.aclose()
        await other.aclose()


async def test_a_router_user_that_cannot_read_the_caps_routes_on_with_one_warning(
    r: redis.Redis, redis_url: str, keys: DeploymentKeys, caplog: pytest.LogCaptureFixture
) -> None:
    """A router user made by the ACL lines of before (no HGETALL of running_caps): the
    feed stays up, one warning says what to grant, and no cap is known."""
    Barrier(r, keys).configure()
    d = keys.deployment
    r.execute_command(
        "ACL", "SETUSER", f"old-router-{d}", "reset", "on", ">pw",
        f"~redisbal:{{{d}}}:snapshot", f"~redisbal:{{{d}}}:members", "resetchannels",
        f"&redisbal:{{{d}}}:snapshots", "-@all", "+ping", "+get", "+zrange", "+subscribe",
    )  # fmt: skip
    url = redis_url.replace("://", f"://old-router-{d}:pw@", 1)  # tcp or unix socket
    rep = AsyncReporter(redis_url, d, "e0", running_cap=4, mode="tick")
    router = AsyncRouter(url, d, tell_routes=False)
    try:
        await rep.register()
        await rep.report(Counts(None, 0, 1))
        with caplog.at_level(logging.WARNING, "redisbal.routing.router"):
            await router.start(wait=5.0)
            await await_until(lambda: "e0" in router.core.by_id, 5.0)
            await asyncio.sleep(0.3)  # a few feed rounds
        assert not router.core.degraded
        assert router.core.by_id["e0"].declared_cap == 0
        warned = [m for m in caplog.messages if "declared running caps" in m]
        assert len(warned) == 1 and "HGETALL" in warned[0], caplog.messages
    finally:
        await router.aclose()
        await rep.aclose()
        r.execute_command("ACL", "DELUSER", f"old-router-{d}")
