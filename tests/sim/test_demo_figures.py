"""What `redisbal demo` computes and prints about what users feel, without processes:
the TTFT arithmetic (engine's decode time on the wire, API server's own clock), the
figures, the comparison table and its verdict."""

from __future__ import annotations

import pytest

from redisbal.sim.api_sim import latency_figures
from redisbal.sim.demo_compare import compare_table, verdict
from redisbal.sim.engine_sim import EngineSimRunner
from redisbal.sim.model import EngineParams, SimRequest
from redisbal.sim.transport import DoneMsg, ttft_s


def test_done_msg_round_trips_and_reads_a_bare_rid() -> None:
    msg = DoneMsg(17, 412.5)
    assert msg.encode() == "17 412.500"
    assert DoneMsg.decode(msg.encode().encode()) == msg
    assert DoneMsg.decode(b"17") == DoneMsg(17, None)  # a sender that does not tell
    with pytest.raises(ValueError):
        DoneMsg.decode(b"x 1.0")


def test_ttft_is_the_api_servers_latency_minus_the_engines_decode_time() -> None:
    assert ttft_s(1.0, 400.0) == pytest.approx(0.6)
    assert ttft_s(0.25, 0.0) == pytest.approx(0.25)  # one token: first token is the end
    assert ttft_s(0.3, 300.5) == 0.0  # two clocks ticking apart never make it negative


def test_engine_sends_decode_time_from_the_end_of_the_admitting_step() -> None:
    """A request admitted in the step [0.0, 0.1] has its first token at 0.1 (as
    redisbal.sim.model has it); it ends at 0.3 after 3 tokens: decode time 200 ms."""
    runner = EngineSimRunner("redis://unused", "d", ["0"], params=EngineParams(running_cap=1))
    eng = runner.engines["0"]
    a = SimRequest(rid=1, client_index=0, output_len=3, routed_at=0.0)
    b = SimRequest(rid=2, client_index=0, output_len=1, routed_at=0.0)
    eng.arrive(a, 0.0)
    eng.arrive(b, 0.0)
    for t in (0.0, 0.1, 0.2):  # b waits for a's slot
        eng.begin_step(t)
        runner.end_step(eng, t + 0.1)
    assert a.finished_at == pytest.approx(0.3) and b.finished_at == -1.0
    msg = runner.done_msg(a)
    assert msg.rid == 1 and msg.decode_ms == pytest.approx(200.0)
    eng.begin_step(0.3)
    runner.end_step(eng, 0.45)
    assert runner.done_msg(b).decode_ms == 0.0  # its only token was its first
    assert runner.first_token == {}  # nothing left behind


def test_latency_figures_goodput_counts_ttft_within_the_objective_per_second_of_load() -> None:
    ttft = [10.0, 20.0, 30.0, 600.0]
    e2e = [100.0, 200.0, 300.0, 900.0]
    fig = latency_figures(ttft, e2e, 500.0, 2.0)
    assert fig["ttft_p50_ms"] == 30.0 and fig["ttft_p99_ms"] == 600.0
    assert fig["e2e_p99_ms"] == 900.0
    assert fig["goodput_rps"] == 1.5 and fig["slo_attainment"] == 0.75
    assert "goodput_rps" not in latency_figures(ttft, e2e, None, 2.0)
    assert latency_figures([], [], 500.0, 2.0)["ttft_p99_ms"] is None


ROWS = [
    ("redisbal", {"ttft_p50_ms": 30.0, "ttft_p99_ms": 300.0, "e2e_p99_ms": 2000.0,
                  "goodput_rps": 90.0, "load_imbalance": 0.5}),
    ("round-robin", {"ttft_p50_ms": 40.0, "ttft_p99_ms": 600.0, "e2e_p99_ms": 2500.0,
                     "goodput_rps": 70.0, "load_imbalance": 0.9}),
    ("vllm-latest", {"ttft_p50_ms": 31.0, "ttft_p99_ms": 310.0, "e2e_p99_ms": 2100.0,
                     "goodput_rps": 89.0, "load_imbalance": None}),
]  # fmt: skip


def test_compare_table_has_a_row_per_policy_with_its_figures() -> None:
    lines = compare_table(ROWS).splitlines()
    assert lines[0].split()[:4] == ["policy", "TTFT", "p50", "TTFT"]
    assert "load imbalance (diagnostic)" in lines[0]
    assert lines[2].split() == [
        "redisbal", "30.0", "ms", "300.0", "ms", "2000.0", "ms", "90.00", "req/s", "0.50"
    ]  # fmt: skip
    assert lines[3].split()[0] == "round-robin" and lines[4].split()[-1] == "-"


def test_verdict_says_what_better_means_and_by_how_much() -> None:
    lines = verdict(ROWS, 500.0, noise=0.15)
    assert lines[0].startswith("better = lower TTFT p99") and "within 500 ms" in lines[0]
    assert "under 15 % are run-to-run noise" in lines[1]
    assert lines[2] == (
        "redisbal vs round-robin: redisbal better, TTFT p99 50 % lower "
        "(TTFT p99 300 vs 600 ms; goodput 90.00 vs 70.00 req/s)"
    )
    assert lines[3].startswith("redisbal vs vllm-latest: within noise (TTFT p99 300 vs 310")
    flipped = verdict([ROWS[1], ROWS[0]], 500.0, noise=0.15)
    assert flipped[2].startswith("round-robin vs redisbal: redisbal better, TTFT p99 50 % lower")
    # a lower p99 with less goodput is not "better"
    mixed = ("round-robin", {**ROWS[1][1], "goodput_rps": 95.0})
    assert verdict([ROWS[0], mixed], 500.0, noise=0.15)[2] == (
        "redisbal vs round-robin: mixed, redisbal's TTFT p99 50 % lower, round-robin's goodput "
        "higher (TTFT p99 300 vs 600 ms; goodput 90.00 vs 95.00 req/s)"
    )
    assert verdict([mixed, ROWS[0]], 500.0, noise=0.15)[2].startswith(
        "round-robin vs redisbal: mixed, redisbal's TTFT p99 50 % lower, round-robin's goodput"
    )
