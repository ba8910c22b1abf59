"""A custom routing policy plugged in through the public API only (``redisbal.*``),
routing on real snapshots from a real redis-server."""

from __future__ import annotations

import pytest
from support.helpers import await_until

import redisbal
from redisbal import Counts


async def test_a_custom_scorer_routes_on_what_the_public_view_shows(
    redis_url: str, deployment: str
) -> None:
    """The scorer sees each engine's snapshot counts, kv_usage, report age and this
    router's own pending / in-flight routes; the lowest score wins."""
    seen: dict[str, tuple[int, int, float | None, int, int, float]] = {}

    def kv_first(core: redisbal.RoutingState, e: redisbal.EngineView) -> float:
        seen[e.engine_id] = (e.waiting, e.running, e.kv_usage, e.pending, e.inflight, e.age_s)
        kv = 1.0 if e.kv_usage is None else e.kv_usage
        return kv + e.inflight  # least KV cache in use, then fewest of my requests

    policy = redisbal.ScoringPolicy(kv_first, name="kv-first")
    assert isinstance(policy, redisbal.Policy) and policy.name == "kv-first"
    reps = [redisbal.Reporter(redis_url, deployment=deployment, engines=e) for e in ("a", "b", "c")]
    router = redisbal.AsyncRouter(redis_url, deployment, 0, 1, policy=policy)
    await router.start()
    try:
        for rep, kv, running in zip(reps, (0.9, 0.2, 0.5), (3, 50, 7), strict=True):
            assert rep.report(
                Counts(step=1, waiting=1, running=running, kv_usage=kv), wait=True
            ).accepted
        await await_until(lambda: router.snapshot is not None and len(router.snapshot.engines) == 3)
        first = router.route()
        # "b" has the least KV in use although it runs the most: the scorer decided
        assert first.engine_id == "b"
        waiting, running, kv, pending, inflight, age = seen["b"]
        assert (waiting, running, kv) == (1, 50, 0.2)
        assert (pending, inflight) == (0, 0) and age >= 0.0
        # the route counts as mine: b now scores 0.2 + 1, so "c" (0.5), then "a" (0.9)
        assert [router.route().engine_id for _ in range(2)] == ["c", "a"]
        assert seen["b"][3:5] == (1, 1), "pending / in-flight of my earlier route"
        router.finished(first)
        assert router.route().engine_id == "b"
    finally:
        await router.aclose()
        for rep in reps:
            rep.close()


def test_a_scoring_policy_needs_a_callable() -> None:
    with pytest.raises(TypeError, match="callable"):
        redisbal.ScoringPolicy(0.5)  # type: ignore[arg-type]
