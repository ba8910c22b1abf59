"""Experiment (not the default policy): the water-fill model of everyone's routes.

    python scripts/waterfill_experiment.py [POLICIES] [SCENARIOS]
    # default: redisbal,wf,vllm-21617,oracle  burst,skew,straggler

The default policy counts each of its own routes since the snapshot 1/share times
(it stands for everyone's). "wf" instead assumes all routes since the snapshot,
its own x 1/share, fill the engines as one water-fill over the snapshot loads,
and takes its share of each engine's fill, one route at a time (granularity 1
instead of 1/share), breaking ties by the same per-router rotation as the
default's dither. O(N) per route, so only for the simulator at 32 x 8. Runs the
discrete-event simulator (``bench_scale.simulate``), 5 seeds, and prints mean and
std of burst_max_over_mean, load_imbalance and p99_queue_delay_s. Result:
docs/BENCHMARKS.md, "The default policy: what was kept and what was dropped".
"""

from __future__ import annotations

import sys

from redisbal.bench_scale import print_seed_stats
from redisbal.policies import POLICIES, EngineView, RedisbalPolicy, RouterCore


class WaterfillPolicy(RedisbalPolicy):
    name = "wf"

    def reset(self, core: RouterCore) -> None:
        self._dither(core)

    def pick(self, core: RouterCore) -> EngineView:
        engines = core.engines
        w = core.pending_weight  # 1 / share
        own = sum(e.pending for e in engines)
        total = (own + 1) * w  # everyone's routes since the snapshot, this one included
        base = [e.running + e.waiting - (e.aged if self.use_age else 0.0) for e in engines]
        level, acc, bs = min(base), 0.0, sorted(base)
        for k, b in enumerate(bs):  # the level L with sum(max(0, L - b)) = total
            nxt = bs[k + 1] if k + 1 < len(bs) else float("inf")
            if acc + (nxt - b) * (k + 1) >= total:
                level = b + (total - acc) / (k + 1)
                break
            acc += (nxt - b) * (k + 1)
        return min(
            engines,
            key=lambda e: (
                e.pending - max(0.0, level - base[engines.index(e)]) / w + 0.999 * e.dither / w
            ),
        )

    def routed(self, core: RouterCore, eng: EngineView) -> None:
        pass


def main() -> int:
    POLICIES["wf"] = WaterfillPolicy
    pols = (sys.argv[1] if len(sys.argv) > 1 else "redisbal,wf,vllm-21617,oracle").split(",")
    names = (sys.argv[2] if len(sys.argv) > 2 else "burst,skew,straggler").split(",")
    print_seed_stats(pols, names)
    return 0


if __name__ == "__main__":
    sys.exit(main())
