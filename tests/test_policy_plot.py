"""The real-time comparison's plot (redisbal.bench.plots.plot_policy_seeds): a PNG from
a gateway_policies.py JSON, and a one-line error when no run has the metric."""

from __future__ import annotations

from pathlib import Path

import click
import pytest

from redisbal.bench.plots import plot_policy_seeds


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
