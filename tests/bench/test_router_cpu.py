"""scripts/router_cpu.py's pure parts: its arguments, the CPU of a process tree, and the
ratios, paired per repetition over the phases that count."""

from __future__ import annotations

import argparse
import subprocess
import sys
from typing import Any

import pytest
from support.scripts import load_script

from redisbal.errors import InvalidArgument

rc = load_script("router_cpu")


def test_rates_are_distinct_positive_numbers() -> None:
    assert rc.parse_rates("20,60") == [20.0, 60.0]
    assert rc.parse_rates(" 5 ") == [5.0]
    for bad in ("", "0", "-1,20", "20,20", "20000", "fast"):
        with pytest.raises(InvalidArgument, match="--rates"):
            rc.parse_rates(bad)


def args(**kw: Any) -> argparse.Namespace:
    given = {"reps": 3, "engines": 8, "duration": 20.0, "warmup_s": 3.0, "cache_blocks": 1280}
    return argparse.Namespace(**(given | kw))


@pytest.mark.parametrize(
    ("kw", "flag"),
    [
        ({"reps": 0}, "--reps"),
        ({"engines": 65}, "--engines"),
        ({"duration": 0.5}, "--duration"),
        ({"warmup_s": 30.0}, "--warmup-s"),
        ({"cache_blocks": 8}, "--cache-blocks"),
    ],
)
def test_arguments_the_run_cannot_use_name_their_flag(kw: dict[str, Any], flag: str) -> None:
    rc.check_args(args())  # the defaults pass
    with pytest.raises(InvalidArgument, match=flag):
        rc.check_args(args(**kw))


def test_a_tree_counts_its_descendants_cpu() -> None:
    """A child that has used 0.3 s of CPU (its own clock, not a wall-clock wait) is in
    its parent's tree; a process gone counts nothing."""
    burn = (
        "import sys, time\n"
        "while time.process_time() < 0.3: pass\n"
        "print('burnt', flush=True); sys.stdin.read()\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", burn], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == b"burnt\n"
        alone = rc.tree_cpu_s(child.pid)
        assert alone >= 0.29  # (/proc counts in ticks of 10 ms)
        assert rc.tree_cpu_s(child.pid) <= alone + 0.05  # idle now
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(10)
    assert rc.tree_cpu_s(child.pid) == 0.0


def phase(target: str, rep: int, router_ms: float, kv_ms: float = 0.0, **kw: Any) -> dict[str, Any]:
    ms = dict.fromkeys(rc.PROCESSES, 0.0)
    ms[target] = router_ms
    ms["kv-events"] = kv_ms
    cache = {"ok": True, "note": "", "gateway_cache_routes": 80.0, "vllm_hits": 90.0}
    row = {"target": target, "rate": 20.0, "rep": rep, "requests": 100, "ok": 100}
    row |= {"ms_per_request": ms, "cache": cache}
    return row | kw


def test_ratios_pair_the_phases_of_one_repetition_and_skip_invalid_ones() -> None:
    rows = [
        phase("gateway", 0, 2.0, 0.5),
        phase("vllm-router", 0, 4.0),
        phase("vllm-router", 1, 1.0),  # the other order
        phase("gateway", 1, 1.5, 0.5),
        phase("gateway", 2, 3.0, 1.0),
        phase("vllm-router", 2, 2.0),
        phase("gateway", 3, 9.0),  # rep 3: vllm-router fell back (not at full strength)
        phase("vllm-router", 3, 1.0, cache={"ok": False, "note": "", "vllm_hits": 0.0}),
        phase("gateway", 4, 9.0, ok=99),  # rep 4: a request failed
        phase("vllm-router", 4, 1.0),
        phase("gateway", 5, 9.0, rate=60.0),  # another rate
        phase("vllm-router", 5, 1.0, rate=60.0),
    ]
    got = rc.paired_ratios(rows, 20.0)
    assert got == {"gateway": [0.5, 1.5, 1.5], "gateway+kv-events": [0.625, 2.0, 2.0]}
    table = rc.ratio_table(rows).splitlines()
    assert "| 20 | 1.50 (0.50-1.50) | 2.00 (0.62-2.00) | 3 |" in table
    assert "| 60 | 9.00 (9.00-9.00) | 9.00 (9.00-9.00) | 1 |" in table
    cpu = rc.cpu_table(rows).splitlines()
    # medians over the valid phases only; the share sent by cache over all of them
    assert cpu[2].startswith("| 20 | gateway | 4 / 5 | 499 / 500 | 2.500 | 0.500 |")
    assert cpu[2].endswith("| 0.80-0.80 |")
    assert cpu[3].startswith("| 20 | vllm-router | 4 / 5 | 500 / 500 | 0.000 | 0.000 | 1.500 |")
    assert cpu[3].endswith("| 0.00-0.90 |")


def test_no_valid_pair_gives_a_dash() -> None:
    rows = [phase("gateway", 0, 2.0)]
    assert rc.paired_ratios(rows, 20.0) == {"gateway": [], "gateway+kv-events": []}
    assert "| 20 | - | - | 0 |" in rc.ratio_table(rows).splitlines()


def counters(**kw: float) -> dict[str, float]:
    zero = ("gateway_cache_routes", "vllm_prefix_cost", "vllm_sticky_hit", "vllm_hits")
    return dict.fromkeys(zero, 0.0) | {"vllm_rendered": 800.0} | kw


def test_a_phase_counts_only_while_its_router_routes_by_cache() -> None:
    assert not rc.cache_note("gateway", counters(), 100)["ok"]
    assert rc.cache_note("gateway", counters(gateway_cache_routes=1), 100)["ok"]
    # vllm-router: FULL_STRENGTH (95 %) decided by prefix (stickiness counts), index hits
    full = counters(vllm_prefix_cost=90, vllm_sticky_hit=5, vllm_hits=70)
    assert rc.cache_note("vllm-router", full, 100)["ok"]
    assert not rc.cache_note("vllm-router", full | {"vllm_sticky_hit": 4}, 100)["ok"]
    assert not rc.cache_note("vllm-router", full | {"vllm_hits": 0}, 100)["ok"]
    assert not rc.cache_note("vllm-router", full, 0)["ok"]  # no request: nothing shown
