"""The coordinator on a real Redis: lease and fencing, config ownership (also after
FLUSHALL), expected engines, reaping, the stall guard, idle heartbeats, run()/stop()."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import pytest
import redis
from support.helpers import Barrier, text, wait_until

from redisbal.keys import DeploymentKeys, InvalidName
from redisbal.ops.coordinator import Coordinator, CoordinatorConfig
from redisbal.sim.embedded import RedisServer

FAST = {"dead_after_ms": 60_000, "stall_ms": 50, "join_grace_ms": 0, "idle_publish_ms": 3_600_000}


@pytest.fixture
def made() -> Iterator[list[Coordinator]]:
    """Coordinators a test made; their clients are closed afterwards."""
    out: list[Coordinator] = []
    yield out
    for c in out:
        c.stop()
        c.client.close()


def coordinator(
    made: list[Coordinator], url: str, deployment: str, cid: str, **kw: object
) -> Coordinator:
    cfg = CoordinatorConfig(**{**FAST, **kw.pop("config", {})})  # type: ignore[arg-type]
    c = Coordinator(url, deployment, cfg, coordinator_id=cid, **kw)  # type: ignore[arg-type]
    made.append(c)
    return c


def config_of(r: redis.Redis, keys: DeploymentKeys) -> dict[str, str]:
    return {text(k): text(v) for k, v in r.hgetall(keys.config).items()}


# -- lease and fence -------------------------------------------------------------------------


def test_standby_takes_over_after_release_and_the_old_fence_is_refused(
    redis_url: str, keys: DeploymentKeys, made: list[Coordinator], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "redisbal.ops.coordinator")
    c1 = coordinator(made, redis_url, keys.deployment, "c1", lease_ttl_ms=10_000)
    c2 = coordinator(made, redis_url, keys.deployment, "c2", lease_ttl_ms=10_000)
    c1.tick()
    assert c1.stats.leader
    old_fence = c1.stats.fence
    c2.tick()
    assert not c2.stats.leader, "a second coordinator must stand by"
    c2.tick()  # it says so once, naming the holder
    said = [m for m in caplog.messages if "standing by" in m]
    assert said == [f"coordinator c2: standing by (c1 holds the lease of {keys.deployment})"]
    c1.release()
    c2.tick()
    assert c2.stats.leader and c2.stats.fence > old_fence
    c1.tick()
    assert not c1.stats.leader
    # a coordinator that still believes in its old lease is refused by the scripts
    for script, args in (("reap", (1000, str(old_fence))), ("force", ("", str(old_fence)))):
        with pytest.raises(redis.ResponseError, match="fenced"):
            c1.scripts.call(script, *args)
    c2.scripts.call("reap", 1000, str(c2.stats.fence))  # the holder's fence is fine


def test_standby_takes_over_when_the_lease_expires(
    r: redis.Redis, redis_url: str, keys: DeploymentKeys, made: list[Coordinator]
) -> None:
    # a TTL that no pause of a busy machine outlasts
    c1 = coordinator(made, redis_url, keys.deployment, "c1", lease_ttl_ms=600_000)
    c2 = coordinator(made, redis_url, keys.deployment, "c2", lease_ttl_ms=600_000)
    c1.tick()
    c2.tick()
    assert c1.stats.leader and not c2.stats.leader
    # c1 pauses (no renewal); c2 keeps trying, and takes over once the TTL ran out
    c2.tick()
    assert not c2.stats.leader, "taken over within the TTL"
    r.hset(keys.config, "lease_until_ms", "1")  # c1's TTL ran out
    c2.tick()
    assert c2.stats.leader
    assert c2.stats.fence > c1.stats.fence
    with pytest.raises(redis.ResponseError, match="fenced"):
        c1.scripts.call("force", "", str(c1.stats.fence))


def test_run_loop_stops_and_releases_the_lease(
    redis_url: str, keys: DeploymentKeys, made: list[Coordinator]
) -> None:
    c1 = coordinator(made, redis_url, keys.deployment, "c1", lease_ttl_ms=10_000)
    c2 = coordinator(made, redis_url, keys.deployment, "c2", lease_ttl_ms=10_000)
    thread = threading.Thread(target=c1.run, daemon=True)
    thread.start()
    wait_until(lambda: c1.stats.leader and c1.stats.ticks >= 3, timeout=5)
    c1.stop()
    thread.join(timeout=5)
    assert not thread.is_alive(), "run() did not return after stop()"
    assert not c1.stats.leader
    c2.tick()
    assert c2.stats.leader, "the lease was not released (ttl is 10 s)"


def test_run_with_a_duration_returns(
    redis_url: str, keys: DeploymentKeys, made: list[Coordinator]
) -> None:
    c = coordinator(made, redis_url, keys.deployment, "c1")
    c.run(duration_s=0.3)  # returns by itself (pytest's timeout guards a hang)
    assert c.stats.ticks >= 1


# -- config ownership ----------------------------------------------------------------------------


def test_config_is_written_checked_and_restored_after_flushall(
    fresh_server: RedisServer, made: list[Coordinator]
) -> None:
    r = fresh_server.client()
    keys = DeploymentKeys("dep")
    want = {
        "dead_after_ms": "4000",
        "stall_ms": "100",
        "tick_ms": "25",
        "join_grace_ms": "0",
        "idle_publish_ms": "500",
        "expected": "e0,e1",
    }
    cfg = {k: int(v) for k, v in want.items() if k != "expected"}
    c = coordinator(made, fresh_server.url, "dep", "c1", config={**cfg, "expected": ["e0", "e1"]})
    c.tick()
    have = config_of(r, keys)
    assert {k: have.get(k) for k in want} == want
    epoch = r.get(keys.epoch)
    assert epoch is not None
    assert set(Barrier(r, keys).members()) == {"e0", "e1"}
    # someone writes another value: the coordinator puts its own back
    r.hset(keys.config, "dead_after_ms", "999")
    wait_until(lambda: (c.tick(), config_of(r, keys)["dead_after_ms"] == "4000")[1], timeout=5)
    # state lost: config, epoch and expected members come back, in a new epoch
    r.flushall()
    bar = Barrier(r, keys)

    def restored() -> bool:
        c.tick()
        have = config_of(r, keys)
        return {k: have.get(k) for k in want} == want and set(bar.members()) == {"e0", "e1"}

    wait_until(restored, timeout=5, interval=0.05)
    assert r.get(keys.epoch) not in (None, epoch)
    assert bar.barrier() == {"e0": -1.0, "e1": -1.0}, "the new epoch's first snapshot waits"
    r.close()


def test_first_snapshot_waits_for_the_expected_engines(
    r: redis.Redis, redis_url: str, keys: DeploymentKeys, made: list[Coordinator]
) -> None:
    c = coordinator(made, redis_url, keys.deployment, "c1", config={"expected": ["e0", "e1", "e2"]})
    c.tick()
    bar = Barrier(r, keys, epoch="unused")
    bar.report("e0", 1, 1, 1)
    bar.report("e1", 1, 2, 2)
    for _ in range(5):  # the stall guard does not force over an engine never heard of
        c.tick()
        time.sleep(0.02)
    assert bar.snapshot_raw() is None
    bar.report("e2", 1, 3, 3)
    snap = bar.snapshot()
    assert snap is not None and set(snap.engines) == {"e0", "e1", "e2"} and not snap.forced


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"stall_ms": 5000, "dead_after_ms": 5000}, "stall_ms"),
        ({"dead_after_ms": 50}, "dead_after_ms"),
        ({"tick_ms": 0}, "tick_ms"),
        ({"join_grace_ms": -1}, "join_grace_ms"),
        ({"idle_publish_ms": 1.5}, "idle_publish_ms"),
        ({"expected": ["a", "a"]}, "unique"),
    ],
)
def test_config_is_validated(fields: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        CoordinatorConfig(**fields).check()  # type: ignore[arg-type]


def test_bad_expected_engine_name_is_rejected() -> None:
    with pytest.raises(InvalidName, match="expected engine id"):
        CoordinatorConfig(expected=["ok", "not ok"]).check()


# -- housekeeping --------------------------------------------------------------------------------


def test_stall_guard_force_publishes_naming_the_laggard(
    r: redis.Redis, redis_url: str, keys: DeploymentKeys, made: list[Coordinator]
) -> None:
    c = coordinator(made, redis_url, keys.deployment, "c1", config={"expected": ["e0", "e1"]})
    c.tick()
    bar = Barrier(r, keys)
    bar.report("e0", 1, 0, 0)
    bar.report("e1", 1, 0, 0)
    bar.report("e0", 2, 5, 5)
    wait_until(lambda: (c.tick(), c.stats.forced)[1] >= 1, timeout=5, interval=0.02)
    snap = bar.snapshot()
    assert snap is not None and snap.forced and snap.cut == (0, 2)
    assert set(snap.laggards) == {"e1"} and snap.laggards["e1"] >= 50


def test_coordinator_expires_dead_engines(
    r: redis.Redis, redis_url: str, keys: DeploymentKeys, made: list[Coordinator]
) -> None:
    c = coordinator(made, redis_url, keys.deployment, "c1")
    c.tick()
    bar = Barrier(r, keys)
    bar.register("e0", "e1")
    bar.report("e0", 1, 0, 0)
    bar.report("e1", 1, 0, 0)
    bar.report("e0", 2, 0, 0)
    bar.expire_now("e1")
    c.tick()
    assert c.stats.expired == 1
    snap = bar.snapshot()
    assert snap is not None and set(snap.engines) == {"e0"} and snap.gone == {"e1": "expired"}
    assert snap.cut == (0, 2), "the expiry completed the barrier e1 was holding"


def test_idle_heartbeat_republishes_the_current_step(
    r: redis.Redis, redis_url: str, keys: DeploymentKeys, made: list[Coordinator]
) -> None:
    # longer than any pause of a busy machine
    c = coordinator(made, redis_url, keys.deployment, "c1", config={"idle_publish_ms": 600_000})
    c.tick()
    bar = Barrier(r, keys)
    bar.register("e0")
    bar.report("e0", 7, 1, 1)
    first = bar.snapshot()
    assert first is not None
    c.tick()
    assert bar.snapshot().version == first.version, "republished too early"  # type: ignore[union-attr]
    assert c.stats.idle_published == 0
    published = int(r.hget(keys.meta, "pub_ms"))  # type: ignore[arg-type]
    r.hset(keys.meta, "pub_ms", str(published - 600_000))  # idle_publish_ms went by
    c.tick()
    assert c.stats.idle_published == 1
    snap = bar.snapshot()
    assert snap is not None and snap.version > first.version and snap.cut == first.cut
