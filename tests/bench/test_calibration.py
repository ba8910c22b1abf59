"""The simulator set up as a real-time run was (redisbal.bench.calibration), trace
replay with shared system prompts, and the burst traces: pure logic, simulated clock."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from redisbal.bench.calibration import (
    Calibration,
    CalibrationError,
    engine_from_args,
    feed_from_args,
    pair_verdicts,
    ranking,
    replay,
    scenario_for,
    simulate_run,
    slow_engines,
)
from redisbal.bench.quality import simulate
from redisbal.routing.router_core import RouterCore
from redisbal.sim.report_as import LOAD_ONLY, REPORT_AS
from redisbal.sim.workload import TraceError, parse_trace

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
RUN = {"engines": 2, "gateways": 2, "running_cap": 8, "slo_ttft_ms": 1500, "slow": []}


def test_engine_arguments_map_to_the_model_in_its_units() -> None:
    p = engine_from_args(
        [
            "--base-step-ms",
            "36",
            "--per-seq-ms",
            "0.45",
            "--prefill-token-us",
            "36",
            "--kv-tokens",
            "16384",
        ],
        8,
    )
    assert p.running_cap == 8
    assert p.base_step_s == pytest.approx(0.036) and p.per_seq_s == pytest.approx(0.00045)
    assert p.prefill_per_token_s == pytest.approx(36e-6) and p.kv_capacity_tokens == 16384
    assert p.prefill_s == engine_from_args([], 8).prefill_s  # engine-sim's default
    for bad in (["--mode", "tick"], ["--kv-tokens", "lots"], ["--base-step-ms"]):
        with pytest.raises(CalibrationError) as e:
            engine_from_args(bad, 8)
        assert "\n" not in str(e.value)


def test_slow_engines_give_a_share_and_one_factor() -> None:
    assert slow_engines([], 8) == (0.0, 1.0)
    assert slow_engines(["0:2"], 8) == (0.125, 2.0)
    assert slow_engines(["0:3,1:3"], 8) == (0.25, 3.0)
    with pytest.raises(CalibrationError):
        slow_engines(["0:2", "1:3"], 8)


def _trace(path: Path, lines: list[dict[str, object]]) -> str:
    path.write_bytes(b"".join(orjson.dumps(d) + b"\n" for d in lines))
    return str(path)


def test_replay_sends_in_turn_to_the_gateways_as_loadgen_does(tmp_path: Path) -> None:
    f = _trace(
        tmp_path / "t.jsonl",
        [{"t": t, "prompt_tokens": 20, "output_tokens": 3} for t in (0.3, 0.1, 0.2, 0.4, 0.5)],
    )
    reqs = replay(f, 2)
    assert [r.t for r in reqs] == [0.1, 0.2, 0.3, 0.4, 0.5]
    assert [r.client for r in reqs] == [0, 1, 0, 1, 0]


def test_keys_that_name_one_system_prompt_share_its_blocks_and_no_more() -> None:
    lines = [
        '{"t": 0, "prompt_tokens": 100, "output_tokens": 5, "key": "a", "system": 1, '
        '"system_tokens": 48}',
        '{"t": 1, "prompt_tokens": 100, "output_tokens": 5, "key": "b", "system": 1, '
        '"system_tokens": 48}',
        '{"t": 2, "prompt_tokens": 100, "output_tokens": 5, "key": "c", "system": 2, '
        '"system_tokens": 48}',
        '{"t": 3, "prompt_tokens": 100, "output_tokens": 5, "key": "d"}',
    ]
    a, b, c, d = parse_trace(lines, clients=1)
    assert a.blocks[:3] == b.blocks[:3] and a.blocks[3] != b.blocks[3]  # 48 tokens: 3 blocks
    assert not set(c.blocks) & set(a.blocks) and not set(d.blocks) & set(a.blocks)
    with pytest.raises(TraceError) as e:
        parse_trace(['{"t": 0, "prompt_tokens": 1, "output_tokens": 1, "key": "a", '
                     '"system": 1}'], clients=1)  # fmt: skip
    assert "'system_tokens'" in str(e.value)


def test_the_scenario_is_the_real_runs_setup(tmp_path: Path) -> None:
    f = _trace(tmp_path / "t.jsonl", [{"t": 2.5, "prompt_tokens": 20, "output_tokens": 3}])
    run = RUN | {"engines": 8, "slow": ["0:2"], "engine_args": "--base-step-ms 36"}
    sc = scenario_for(run, replay(f, 2), Calibration(tick_ms=10, step_overhead_ms=2))
    assert (sc.clients, sc.engines, sc.duration_s, sc.slo_ttft_s) == (2, 8, 2.5, 1.5)
    assert (sc.slow_share, sc.slow_factor, sc.tick_s) == (0.125, 2.0, 0.01)
    assert sc.engine.running_cap == 8 and sc.engine.base_step_s == pytest.approx(0.038)
    assert not sc.warm and sc.warmup_s == 0


def test_the_simulator_honours_the_real_runs_running_cap(tmp_path: Path) -> None:
    # one burst of 16 requests of 20 tokens on 2 engines: 8 slots each run it in one
    # wave, 1 slot each in 8 (so the last first token comes many steps later)
    f = _trace(
        tmp_path / "b.jsonl",
        [{"t": 0.001 * k, "prompt_tokens": 20, "output_tokens": 20} for k in range(16)],
    )
    wide = simulate_run(RUN, "least-inflight", 1, f, Calibration())
    narrow = simulate_run(RUN | {"running_cap": 1}, "least-inflight", 1, f, Calibration())
    assert wide["requests"] == narrow["requests"] == 16
    assert narrow["ttft_p99_s"] > 4 * wide["ttft_p99_s"]


def test_pairs_are_settled_only_when_every_seed_agrees() -> None:
    real = {"a": {1: 10.0, 2: 10.0}, "b": {1: 35.0, 2: 5.0}, "c": {1: 30.0, 2: 30.0}}
    sim = {"a": {1: 1.0, 2: 1.0}, "b": {1: 3.0, 2: 3.0}, "c": {1: 2.0, 2: 2.0}}
    assert ranking(real) == ["a", "b", "c"] and ranking(sim) == ["a", "c", "b"]
    got = {(a, b): (settled, same) for a, b, settled, same in pair_verdicts(real, sim)}
    assert got == {
        ("a", "b"): (False, True),  # b beat a on seed 2
        ("a", "c"): (True, True),
        ("b", "c"): (False, False),  # b lost to c on seed 1
    }


def test_burst_trace_has_its_bursts(tmp_path: Path) -> None:
    out = tmp_path / "burst.jsonl"
    subprocess.run(
        [sys.executable, str(SCRIPTS / "session_trace.py"), "burst", "--burst-size", "10",
         "--burst-every-s", "2", "--burst-window-s", "0.1", "--duration", "6", "-o", str(out)],
        check=True, capture_output=True,
    )  # fmt: skip
    ts = [orjson.loads(line)["t"] for line in out.read_bytes().splitlines()]
    assert len(ts) == 30
    assert [sum(1 for t in ts if b * 2 <= t < b * 2 + 0.1) for b in range(3)] == [10, 10, 10]
    got = subprocess.run(
        [sys.executable, str(SCRIPTS / "session_trace.py"), "poisson"], capture_output=True
    )
    assert got.returncode != 0 and b"needs --rate" in got.stderr


async def test_engines_count_their_steps_planned_and_taken(redis_url: str, deployment: str) -> None:
    """The real-time side of the step-time calibration: each HTTP engine sums its
    model's step times and the time the host took for them (gateway_policies.py
    reports the difference per step)."""
    import aiohttp
    from support.gateway_stack import MODEL, stack

    async with stack(redis_url, deployment, n=1) as st:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 5, "ignore_eos": True}
        async with aiohttp.ClientSession() as s:
            async with s.post(st.url + "/v1/completions", json=body) as r:
                assert r.status == 200
            async with s.get(st.engines[0].url + "/sim/state") as r:
                state = await r.json()
    assert state["steps"] >= 5
    assert state["step_planned_s"] > 0 and state["step_taken_s"] > 0


def test_sim_vs_real_sets_simulated_only_references_beside_the_runs(tmp_path: Path) -> None:
    lines = [{"t": 0.01 * k, "prompt_tokens": 20, "output_tokens": 5} for k in range(40)]
    for seed in (1, 2):
        _trace(tmp_path / f"t-{seed}.jsonl", lines)
    runs = [
        {"policy": p, "seed": s, "ttft_p99_ms": v}
        for p, v in (("least-inflight", 100.0), ("round-robin", 200.0))
        for s in (1, 2)
    ]
    doc = {"args": RUN | {"trace": "t-{seed}.jsonl"}, "runs": runs}
    (tmp_path / "run.json").write_bytes(orjson.dumps(doc))
    out = subprocess.run(
        [sys.executable, str(SCRIPTS / "sim_vs_real.py"), f"x={tmp_path / 'run.json'}",
         "--reference", "oracle"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "| oracle (simulated only) | - |" in out
    assert "| least-inflight | 100, 100 (100) |" in out  # the real runs, as they were


def test_a_run_is_simulated_with_what_its_engines_fed_the_routers() -> None:
    """The run's last --report-as (engine-sim's rule), full without one; --no-admitted,
    recorded before --report-as and the admitted total, fed load alone. The form is the
    reports', not the engine's: the engine's parameters are the same."""
    for engine_args, feed in (
        ("--base-step-ms 36", "full"),
        ("--base-step-ms 36 --no-admitted", LOAD_ONLY),
        ("--report-as=sglang --base-step-ms 36", "sglang"),
        ("--report-as full --report-as vllm-plugin", "vllm-plugin"),
        *((f"--base-step-ms 36 --report-as {f}", f) for f in REPORT_AS),
    ):
        assert feed_from_args({"engine_args": engine_args}) == feed
        p = engine_from_args(engine_args.split(), 8)
        assert p.base_step_s == pytest.approx(0.036 if "36" in engine_args else 0.012)
    for bad in ("--report-as load-only", "--report-as vllm", "--base-step-ms 36 --report-as"):
        with pytest.raises(CalibrationError, match="report-as"):
            feed_from_args({"engine_args": bad})


def test_a_run_with_a_declared_cap_is_simulated_with_its_running_cap_declared(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--report-as vllm-plugin with --running-cap 5: every router is told each engine's
    cap of 5 (RouterCore.set_declared_caps, as the gateways read it); vllm-metrics
    declares none."""
    told: list[dict[str, int]] = []
    real = RouterCore.set_declared_caps

    def record(self: RouterCore, caps: dict[str, int]) -> None:
        told.append(dict(caps))
        real(self, caps)

    monkeypatch.setattr(RouterCore, "set_declared_caps", record)
    f = _trace(tmp_path / "t.jsonl", [{"t": 0.01 * k, "prompt_tokens": 20, "output_tokens": 5}
                                      for k in range(20)])  # fmt: skip
    for form, caps in (("vllm-plugin", [{"e0000": 5, "e0001": 5}] * 2), ("vllm-metrics", [])):
        told.clear()
        run = RUN | {"running_cap": 5, "engine_args": f"--base-step-ms 36 --report-as {form}"}
        assert simulate_run(run, "redisbal", 1, f, Calibration())["requests"] == 20
        assert told == caps  # (one router per gateway)


def test_sim_vs_real_simulates_each_run_with_its_feed_or_the_one_given(tmp_path: Path) -> None:
    """Each run's feed is named with its table (and in --json); --report-as replaces it."""
    _trace(tmp_path / "t-1.jsonl", [{"t": 0.01 * k, "prompt_tokens": 20, "output_tokens": 5}
                                    for k in range(40)])  # fmt: skip
    runs = [{"policy": p, "seed": 1, "ttft_p99_ms": 100.0} for p in ("redisbal", "least-inflight")]
    for name, engine_args in (("old", "--no-admitted"), ("plugin", "--report-as vllm-plugin")):
        doc = {"args": RUN | {"trace": "t-{seed}.jsonl", "engine_args": engine_args}, "runs": runs}
        (tmp_path / f"{name}.json").write_bytes(orjson.dumps(doc))
    script = [sys.executable, str(SCRIPTS / "sim_vs_real.py")]
    runs_given = [f"old={tmp_path / 'old.json'}", f"plugin={tmp_path / 'plugin.json'}"]
    out = subprocess.run(
        [*script, *runs_given, "--json", str(tmp_path / "c.json")],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "old (fed as load-only): TTFT p99" in out and "plugin (fed as vllm-plugin)" in out
    cmp = orjson.loads((tmp_path / "c.json").read_bytes())
    assert (cmp["old"]["report_as"], cmp["plugin"]["report_as"]) == (LOAD_ONLY, "vllm-plugin")
    out = subprocess.run(
        [*script, *runs_given, "--report-as", "sglang"], capture_output=True, text=True, check=True
    ).stdout
    assert "old (fed as sglang)" in out and "plugin (fed as sglang)" in out


def test_trace_keys_are_guessed_as_the_gateway_takes_them(tmp_path: Path) -> None:
    """loadgen sends a trace's keys as the body's user, which the gateway routes as a
    guessed key: the default follows it only while users come back (these never do),
    where redisbal-repeats follows every key. Given keys are followed by both."""
    f = _trace(
        tmp_path / "u.jsonl",
        [
            {"t": 0.01 * k, "prompt_tokens": 300, "output_tokens": 30, "key": f"u{k}"}
            for k in range(200)
        ],
    )
    run = RUN | {"engines": 4}
    guessed = {
        p: simulate_run(run, p, 1, f, Calibration()) for p in ("redisbal", "redisbal-repeats")
    }
    assert guessed["redisbal"]["ttft_p99_s"] != guessed["redisbal-repeats"]["ttft_p99_s"]
    work = replay(f, 2)
    sc = scenario_for(run, work, Calibration())
    given = {p: simulate(p, 1, sc, workload=work) for p in ("redisbal", "redisbal-repeats")}
    assert given["redisbal"]["ttft_p99_s"] == given["redisbal-repeats"]["ttft_p99_s"]
    assert given["redisbal-repeats"]["ttft_p99_s"] == guessed["redisbal-repeats"]["ttft_p99_s"]
