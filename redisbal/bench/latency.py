"""What users of an LLM service feel: pure metric functions of the quality benchmark
(``redisbal.bench.quality``), each over what a simulated run recorded.

A request that had not produced its first token (or finished) when the run ended
counts with the time it had waited so far (censored: a lower bound), so a policy
cannot look better by leaving requests unserved.
"""

from __future__ import annotations

from collections.abc import Sequence

from redisbal.bench.balance import percentile
from redisbal.errors import InvalidArgument

# name -> one line for ``redisbal bench --help`` and the tables' legend
QUALITY_METRICS = {
    "ttft_p50_s": "time to first token, median: routing to the end of the step that prefilled it",
    "ttft_p99_s": "time to first token, 99th percentile (what the slowest 1% wait)",
    "e2e_p99_s": "end-to-end latency (routing to last token), 99th percentile",
    "goodput_rps": "requests/s whose first token came within the scenario's TTFT SLO",
    "prefix_hit_rate": "prompt tokens found in the engine's prefix cache / prompt tokens",
    "makespan_s": "first arrival to last completion (mean per burst for burst traffic)",
    "lockstep_efficiency": "lockstep runs: sum over steps of mean running / of max running",
    "load_imbalance": "diagnostic: time-averaged (max - mean) / mean of requests per engine",
    "burst_max_over_mean": "diagnostic: per burst, max / mean requests an engine got",
}
HIGHER_IS_BETTER = frozenset({"goodput_rps", "prefix_hit_rate", "lockstep_efficiency"})


def waits(starts: Sequence[float], ends: Sequence[float], end_of_run: float) -> list[float]:
    """end - start per request; an end < 0 (never reached) counts as end_of_run - start."""
    if len(starts) != len(ends):
        raise InvalidArgument("starts and ends must have the same length")
    return [(e if e >= 0 else end_of_run) - s for s, e in zip(starts, ends, strict=True)]


def ttft_percentiles(ttfts: Sequence[float]) -> tuple[float, float]:
    """(p50, p99) of the times to first token."""
    return percentile(ttfts, 50), percentile(ttfts, 99)


def goodput(ttfts: Sequence[float], slo_s: float, window_s: float) -> float:
    """Requests per second served with a TTFT within ``slo_s``, over a measurement
    window of ``window_s`` seconds of arrivals. Completion is not required: a run
    ends before the longest outputs (up to 4,096 tokens, over a minute) could
    finish, and what routing decides is when a request starts."""
    if window_s <= 0:
        raise InvalidArgument("window_s must be > 0")
    return sum(1 for t in ttfts if t <= slo_s) / window_s


def hit_rate(cached_tokens: int, prompt_tokens: int) -> float:
    """Cached prompt tokens / prompt tokens (0.0 without prompt tokens)."""
    return cached_tokens / prompt_tokens if prompt_tokens > 0 else 0.0


def lockstep_efficiency_sum(running_rows: Sequence[Sequence[float]]) -> float:
    """Sum over steps of the mean running count / sum over steps of the max: the share
    of a lockstep deployment's step slots doing work (a step lasts as long as its
    fullest engine's). 1.0 for no rows."""
    num = den = 0.0
    for row in running_rows:
        if not row:
            continue
        top = max(row)
        if top <= 0:
            continue
        num += sum(row) / len(row)
        den += top
    return num / den if den > 0 else 1.0
