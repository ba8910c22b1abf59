"""Experiment (not the default policy): weigh the snapshot's load by ALPHA < 1.

    python scripts/load_weight_experiment.py [ALPHAS] [SCENARIOS]
    # default: 1,0.5,0.25,0  burst,skew,straggler

The default policy scores an engine as its snapshot load (running + waiting, aged)
plus its pending routes x 1/share plus the dither. Here the load term is scaled by
ALPHA (1 = the default; 0 = spread own routes only, reconciled with what engines
report having admitted). Runs the discrete-event simulator
(``bench_scale.simulate``), seeds 1-5, next to round-robin, vllm-21617 and the
oracle, and prints mean and std of burst_max_over_mean, load_imbalance and
p99_queue_delay_s. Result: docs/BENCHMARKS.md, "The default policy: what was kept
and what was dropped".
"""

from __future__ import annotations

import sys

from redisbal.bench_scale import print_seed_stats
from redisbal.policies import POLICIES, EngineView, Policy, RedisbalPolicy, RouterCore


def load_weighted(alpha: float) -> type[Policy]:
    class LoadWeighted(RedisbalPolicy):
        name = f"alpha={alpha:g}"

        def score(self, core: RouterCore, e: EngineView) -> float:
            load = e.running + e.waiting - (e.aged if self.use_age else 0.0)
            return alpha * load + e.pending * core.pending_weight + e.dither

    return LoadWeighted


def main() -> int:
    alphas = [float(a) for a in (sys.argv[1] if len(sys.argv) > 1 else "1,0.5,0.25,0").split(",")]
    names = (sys.argv[2] if len(sys.argv) > 2 else "burst,skew,straggler").split(",")
    pols = []
    for a in alphas:
        name = "redisbal" if a == 1 else f"alpha={a:g}"
        if a != 1:
            POLICIES[name] = load_weighted(a)
        pols.append(name)
    pols += ["round-robin", "vllm-21617", "oracle"]
    print_seed_stats(pols, names)
    return 0


if __name__ == "__main__":
    sys.exit(main())
