"""scripts/gateway_overhead.py's tables, from rows as its runs write them: medians are
true medians, and each target's CPU is set against the peer's of the same repetition."""

from __future__ import annotations

from types import ModuleType
from typing import Any

from support.scripts import load_script


def load() -> ModuleType:
    return load_script("gateway_overhead")


def row(target: str, rep: int, cpu: float | None) -> dict[str, Any]:
    return {"target": target, "stream": False, "rate": 500.0, "rep": rep, "cpu_ms_per_request": cpu}


def test_cpu_is_set_against_the_peer_of_the_same_repetition() -> None:
    g = load()
    rows = [row("direct", 0, None), row("direct", 1, None)]
    # host noise moves both in a repetition: 2x in rep 0, 1.5x in rep 1, 1.6x in rep 2
    rows += [row("peer", 0, 0.2), row("gw", 0, 0.4), row("peer", 1, 0.4), row("gw", 1, 0.6)]
    rows += [row("peer", 2, 0.25), row("gw", 2, 0.4), row("gw", 3, 9.9)]  # rep 3: no peer
    table = g.ratios(rows, "peer")
    assert "| whole | 500 | gw | 1.600 (1.500-2.000) | 3 |" in table.splitlines()
    assert "direct" not in table and "| peer |" not in table
    assert g._median([1.0, 2.0, 3.0, 4.0]) == 2.5  # (not the upper middle)
