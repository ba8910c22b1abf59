"""Balance metrics of the benchmark: pure functions over what a run recorded.

Kept apart from the harness so that every number the benchmark reports comes
from a small function with unit tests (``tests/bench/test_bench.py``); what each metric
means and why is in docs/BENCHMARKS.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from redisbal.errors import InvalidArgument

METRICS = (
    "burst_max_over_mean",
    "load_imbalance",
    "lockstep_efficiency",
    "p99_queue_delay_s",
    "makespan_s",
)
# metrics where a larger value is better (all others: lower is better)
HIGHER_IS_BETTER = frozenset({"lockstep_efficiency"})


def load_imbalance(
    times: Sequence[float], loads: Sequence[Sequence[float]], min_mean: float = 1.0
) -> float:
    """Time-averaged (max - mean) / mean of per-engine load over the samples whose mean
    is at least ``min_mean``. Each sample weighs the time until the next one (the last
    one weighs the median interval), so a late sample under event-loop lag does not
    over- or under-count. NaN entries are engines not live at that sample. Returns 0.0
    when no sample qualifies (nothing queued: nothing to balance)."""
    if len(times) != len(loads):
        raise InvalidArgument("times and loads must have the same length")
    n = len(times)
    if n == 0:
        return 0.0
    gaps = [times[i + 1] - times[i] for i in range(n - 1)]
    typical = sorted(gaps)[len(gaps) // 2] if gaps else 1.0
    total_w = acc = 0.0
    for i, row in enumerate(loads):
        live = [x for x in row if not math.isnan(x)]
        if not live:
            continue
        mean = sum(live) / len(live)
        if mean < min_mean:
            continue
        w = gaps[i] if i < n - 1 else typical
        if w <= 0:
            continue
        acc += w * (max(live) - mean) / mean
        total_w += w
    return acc / total_w if total_w > 0 else 0.0


def lockstep_efficiency(running_rows: Sequence[Sequence[float]]) -> float:
    """Mean over steps (or samples) of mean running / max running across engines;
    rows where no engine runs anything are skipped. 1.0: every batch was even."""
    acc = 0.0
    k = 0
    for row in running_rows:
        live = [x for x in row if not math.isnan(x)]
        if not live:
            continue
        top = max(live)
        if top <= 0:
            continue
        acc += (sum(live) / len(live)) / top
        k += 1
    return acc / k if k else 1.0


def burst_max_over_mean(per_burst_counts: Sequence[Sequence[int]]) -> float:
    """Per burst, max / mean of the requests assigned to each engine (engines that got
    none count as 0), averaged over bursts with at least one request."""
    vals = []
    for counts in per_burst_counts:
        total = sum(counts)
        if total <= 0 or not counts:
            continue
        vals.append(max(counts) / (total / len(counts)))
    return sum(vals) / len(vals) if vals else 1.0


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation; 0.0 for no values."""
    if not values:
        return 0.0
    if not 0 <= q <= 100:
        raise InvalidArgument("q must be in 0..100")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def makespan(groups: Sequence[tuple[float, float]]) -> float:
    """Mean over groups (bursts, or the whole run for Poisson traffic) of
    (last completion - first arrival)."""
    spans = [end - start for start, end in groups if end >= start]
    return sum(spans) / len(spans) if spans else 0.0


def gap_closed(vllm21617: float, redisbal: float, oracle: float) -> float | None:
    """(vllm21617 - redisbal) / (vllm21617 - oracle); None when the denominator is 0
    (no gap to close). 1.0: as good as the oracle; > 1: better; < 0: worse than 21617."""
    den = vllm21617 - oracle
    if den == 0 or math.isnan(den):
        return None
    return (vllm21617 - redisbal) / den


@dataclass(frozen=True)
class Spread:
    mean: float
    lo: float
    hi: float
    std: float
    n: int

    @property
    def range(self) -> float:
        return self.hi - self.lo


def spread(values: Sequence[float]) -> Spread:
    """Mean, min, max and (sample) standard deviation over seeds."""
    if not values:
        raise InvalidArgument("no values")
    n = len(values)
    m = sum(values) / n
    sd = math.sqrt(sum((v - m) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
    return Spread(m, min(values), max(values), sd, n)


def gap_within_noise(vllm21617: Sequence[float], oracle: Sequence[float]) -> bool | None:
    """True when |mean(vllm21617) - mean(oracle)| is not larger than the seed spread
    (the larger min-max range of the two); None with a single seed (no spread known)."""
    if len(vllm21617) < 2 or len(oracle) < 2:
        return None
    a, b = spread(vllm21617), spread(oracle)
    return abs(a.mean - b.mean) <= max(a.range, b.range)
