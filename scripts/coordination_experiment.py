"""Experiment (not a policy to ship): is the burst gap to the oracle about coordination?

    python scripts/coordination_experiment.py [SCENARIOS]   # default: burst,skew,straggler

The oracle routes on every engine's exact instantaneous state. A redisbal router
knows less in two ways: its snapshot is stale (completions since the engines'
reports are unknown), and it sees only its own routes since the snapshot (the
other routers' it estimates as its own x 1/share). "coord" keeps the staleness
and removes the second gap: it scores each engine by the snapshot's waiting +
running plus every router's pending routes to it (each reconciled exactly with the
engine's admitted counts, as redisbal does for its own), read from all routers at
once, which no real router can do without I/O on the hot path (invariant 8). If
"coord" is close to the oracle, what holds redisbal back is not knowing the other
routers' latest routes; if it is close to redisbal, it is the snapshot's age.
Runs the discrete-event simulator (``bench_scale.simulate``), seeds 1-5, and
prints mean and std of burst_max_over_mean, load_imbalance and p99_queue_delay_s;
"coord-Xms" shares each router's pending at most every X ms ("coord-0ms": read
live, the bound); the others' routes since their last share are then unknown.
Result: docs/BENCHMARKS.md, "Is the burst gap about coordination?".
"""

from __future__ import annotations

import sys

from redisbal.bench_scale import print_seed_stats
from redisbal.policies import POLICIES, EngineView, Policy, RedisbalPolicy, RouterCore


class CoordinatedPolicy(Policy):
    """JSQ on snapshot waiting + running + every router's pending (random tie-break),
    the others' as they were delay_s ago (0: live), as routers that exchange their
    routes with that latency, and estimate nothing, would see them."""

    name = "coord"
    delay_s = 0.0
    # the current run's routers and their recent routes: id(core) -> (core, [(time, engine)])
    routers: dict[int, tuple[RouterCore, list[tuple[float, str]]]] = {}

    def reset(self, core: RouterCore) -> None:
        if id(core) not in self.routers:
            self.routers[id(core)] = (core, [])

    def routed(self, core: RouterCore, eng: EngineView) -> None:
        self.reset(core)
        recent = self.routers[id(core)][1]
        now = core.clock()
        recent.append((now, eng.engine_id))
        while recent and recent[0][0] < now - self.delay_s - 1.0:
            recent.pop(0)  # (a second of history is plenty)

    def others(self, core: RouterCore, eid: str, since: float) -> int:
        """The other routers' pending on engine eid, without their routes after since."""
        total = 0
        for k, (other, recent) in self.routers.items():
            if k == id(core):
                continue
            v = other.by_id.get(eid)
            if v is None:
                continue
            unseen = sum(1 for t, x in recent if x == eid and t > since) if self.delay_s > 0 else 0
            total += max(0, v.pending - unseen)
        return total

    def pick(self, core: RouterCore) -> EngineView:
        self.reset(core)
        since = core.clock() - self.delay_s
        best: list[EngineView] = []
        best_load = float("inf")
        for e in core.engines:
            load = e.waiting + e.running + e.pending + self.others(core, e.engine_id, since)
            if load < best_load:
                best, best_load = [e], load
            elif load == best_load:
                best.append(e)
        return best[int(core.rng.random() * len(best))]


class HybridPolicy(RedisbalPolicy, CoordinatedPolicy):
    """redisbal's score with the others' routes known up to delay_s ago: snapshot load
    + this router's pending + the others' as of delay_s ago + this router's routes of
    the last delay_s counted (1/share - 1) more times (for everyone's unseen ones) +
    the stratified dither. O(N) per route (a scan, not the heap)."""

    name = "hybrid"
    delay_s = 0.001

    def reset(self, core: RouterCore) -> None:
        self._dither(core)
        CoordinatedPolicy.reset(self, core)

    def routed(self, core: RouterCore, eng: EngineView) -> None:
        CoordinatedPolicy.routed(self, core, eng)

    def pick(self, core: RouterCore) -> EngineView:
        if id(core) not in self.routers:
            self.reset(core)
        now = core.clock()
        since = now - self.delay_s
        mine = [x for t, x in self.routers[id(core)][1] if t > since]
        extra = core.pending_weight - 1.0
        best: list[EngineView] = []
        best_load = float("inf")
        for e in core.engines:
            eid = e.engine_id
            load: float = e.waiting + e.running + e.pending + self.others(core, eid, since)
            load += mine.count(eid) * extra + e.dither
            if self.use_age:
                load -= e.aged
            if load < best_load:
                best, best_load = [e], load
            elif load == best_load:
                best.append(e)
        return best[int(core.rng.random() * len(best))]


def hybrid_with_delay(delay_ms: float) -> type[HybridPolicy]:
    return type(f"Hybrid{delay_ms:g}", (HybridPolicy,), {"delay_s": delay_ms / 1000.0})


def coord_with_delay(delay_ms: float) -> type[CoordinatedPolicy]:
    return type(f"Coord{delay_ms:g}", (CoordinatedPolicy,), {"delay_s": delay_ms / 1000.0})


def main() -> int:
    coord = (0.0, 0.05, 0.2, 1.0)
    hybrid = (0.05, 0.2, 1.0)
    for d in coord:
        POLICIES[f"coord-{d:g}ms"] = coord_with_delay(d)
    for d in hybrid:
        POLICIES[f"hybrid-{d:g}ms"] = hybrid_with_delay(d)
    names = (sys.argv[1] if len(sys.argv) > 1 else "burst,skew,straggler").split(",")
    pols = ["vllm-21617", "redisbal", *(f"coord-{d:g}ms" for d in coord)]
    pols += [*(f"hybrid-{d:g}ms" for d in hybrid), "oracle"]
    print_seed_stats(pols, names, before_run=CoordinatedPolicy.routers.clear)
    return 0


if __name__ == "__main__":
    sys.exit(main())
