"""The figures of a load run (redisbal loadgen): each request's outcome, and the
summary of many: TTFT, inter-token and end-to-end latency percentiles, throughput,
errors and goodput against a TTFT objective."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Result:
    ok: bool
    status: int
    lag: float  # how late it was sent, s
    ttft: float | None = None
    e2e: float = 0.0
    tokens: int = 0
    gaps: list[float] = field(default_factory=list)
    error: str | None = None
    target: int = 0  # which of the URLs it went to


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def summarize(
    results: list[Result],
    elapsed: float,
    slo_ttft_s: float | None = None,
    window_s: float | None = None,
) -> dict[str, Any]:
    ok = [r for r in results if r.ok]

    def ms(v: float | None) -> float | None:
        return None if v is None else round(v * 1000, 3)

    ttft = [r.ttft for r in ok if r.ttft is not None]
    gaps = [g for r in ok for g in r.gaps]
    e2e = [r.e2e for r in ok]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error or "?"] = errors.get(r.error or "?", 0) + 1
    return {
        "requests": len(results),
        "ok": len(ok),
        "errors": errors,
        "elapsed_s": round(elapsed, 3),
        "throughput_rps": round(len(ok) / elapsed, 2) if elapsed > 0 else None,
        "tokens_per_s": round(sum(r.tokens for r in ok) / elapsed, 1) if elapsed > 0 else None,
        "ttft_p50_ms": ms(percentile(ttft, 0.5)),
        "ttft_p99_ms": ms(percentile(ttft, 0.99)),
        "itl_p50_ms": ms(percentile(gaps, 0.5)),
        "itl_p99_ms": ms(percentile(gaps, 0.99)),
        "e2e_p50_ms": ms(percentile(e2e, 0.5)),
        "e2e_p99_ms": ms(percentile(e2e, 0.99)),
        "lag_p99_ms": ms(percentile([r.lag for r in results], 0.99)),
        **_goodput(ttft, len(results), window_s or elapsed, slo_ttft_s),
    }


def _goodput(
    ttft: list[float], requests: int, window: float, slo_ttft_s: float | None
) -> dict[str, Any]:
    """Requests answered with their first token within the TTFT objective: per second of
    the load's window (``--duration``; the same for every server given the same
    schedule, unlike the run's end, which one long answer moves) and as a share of all
    requests sent."""
    if slo_ttft_s is None:
        return {}
    good = sum(t <= slo_ttft_s for t in ttft)
    return {
        "slo_ttft_ms": round(slo_ttft_s * 1000, 3),
        "goodput_rps": round(good / window, 2) if window > 0 else None,
        "slo_attainment": round(good / requests, 4) if requests else None,
    }
