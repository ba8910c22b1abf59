"""The real-time comparison's plot (redisbal.bench.plots.plot_policy_seeds): a PNG from
a gateway_policies.py JSON, and a one-line error when no run has the metric."""

from __future__ import annotations

from pathlib import Path

import click
import pytest

from redisbal.bench.plots import plot_overhead, plot_policy_seeds


def doc(metric: str = "ttft_p99_ms") -> dict[str, object]:
    runs = [
        {"policy": p, "seed": s, metric: base + 10 * s}
        for p, base in (("redisbal", 300.0), ("least-inflight", 320.0))
        for s in (1, 2, 3)
    ]
    return {"args": {}, "runs": runs}


def test_writes_a_png(tmp_path: Path) -> None:
    out = plot_policy_seeds(doc(), str(tmp_path / "p.png"))
    assert Path(out).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_missing_metric_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(click.ClickException, match="no run has 'goodput_rps'"):
        plot_policy_seeds(doc(), str(tmp_path / "p.png"), metric="goodput_rps")


def test_the_overhead_plot_writes_a_png_and_names_a_missing_measure(tmp_path: Path) -> None:
    rows = [
        {"target": t, "stream": s, "rep": k, "cpu_ms_per_request": c * (1 + 0.1 * k)}
        for t, c in (("gateway-uvloop", 0.36), ("vllm-router:power_of_two", 0.23))
        for s in (False, True)
        for k in range(3)
    ]
    rows.append({"target": "direct", "stream": False, "rep": 0, "cpu_ms_per_request": None})
    out = plot_overhead(rows, str(tmp_path / "o.png"), base="vllm-router:power_of_two")
    assert Path(out).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(click.ClickException, match="no row has CPU per request"):
        plot_overhead(rows[-1:], str(tmp_path / "none.png"))
