"""The routing-quality benchmark: prefix cache, engine model, workloads, traces,
metrics, and small simulated runs whose ordering must hold."""

from __future__ import annotations

import itertools
import json
import math
import zlib
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from redisbal.bench.cli import bench_command
from redisbal.bench.latency import (
    goodput,
    hit_rate,
    lockstep_efficiency_sum,
    ttft_percentiles,
    waits,
)
from redisbal.bench.quality import ROUTES_VIEW, simulate
from redisbal.bench.traffic import (
    QUALITY_ENGINE,
    QualityScenario,
    build_workload,
    default_quality_scenarios,
)
from redisbal.routing.admit_total import TotalReconciler
from redisbal.routing.policies import Policy
from redisbal.routing.state import EngineView, RoutingState
from redisbal.sim.model import EngineParams, SimEngine, SimRequest
from redisbal.sim.prefix_cache import PrefixCache
from redisbal.sim.report_as import FEEDS, Feed
from redisbal.sim.workload import (
    OUTPUT_CAP,
    TraceError,
    bursts,
    parse_trace,
    poisson,
    sessions,
    stream_blocks,
)

# -- prefix cache ---------------------------------------------------------------------------


def test_prefix_cache_hits_the_longest_cached_prefix_only() -> None:
    c = PrefixCache(10)
    c.insert([1, 2, 3])
    assert c.match([1, 2, 3, 4]) == 3
    assert c.match([1, 9, 3]) == 1  # a miss ends the prefix, later hits do not count
    assert c.match([7, 1, 2]) == 0


def test_prefix_cache_evicts_least_recently_used_and_hits_refresh() -> None:
    c = PrefixCache(3)
    c.insert([1, 2, 3])
    assert c.match([1]) == 1  # 1 is now the most recent
    c.insert([4])  # evicts 2, the least recently used
    assert 2 not in c and 1 in c and 3 in c and 4 in c
    assert len(c) == 3
    with pytest.raises(ValueError):
        PrefixCache(0)


# -- engine model ---------------------------------------------------------------------------


def _req(rid: int, prompt: int, out: int, blocks: tuple[int, ...] = ()) -> SimRequest:
    return SimRequest(rid, 0, out, 0.0, prompt_tokens=prompt, blocks=blocks)


def test_cached_prompt_tokens_are_not_prefilled_again() -> None:
    p = EngineParams(prefill_per_token_s=12e-6, cache_blocks=1000)
    blocks = stream_blocks(1, 1000)
    e = SimEngine("a", p)
    e.arrive(_req(1, 1000, 1, blocks), 0.0)
    cold = e.begin_step(0.0)
    e.end_step(cold)
    e.arrive(_req(2, 1000, 1, blocks), cold)
    warm = e.begin_step(cold)
    # 992 of the 1,000 tokens (62 full blocks) are cached: about 12 ms less prefill
    assert cold - warm == pytest.approx(992 * 12e-6, rel=1e-6)
    assert e.cached_tokens_seen == 992 and e.prompt_tokens_seen == 2000


def test_first_token_at_the_end_of_the_prefill_step_and_kv_usage() -> None:
    p = EngineParams(kv_capacity_tokens=1000, prefill_per_token_s=1e-5)
    e = SimEngine("a", p)
    for i in range(3):
        e.arrive(_req(i, 400, 2), 0.0)
    d = e.begin_step(0.0)
    assert len(e.running) == 2 and len(e.waiting) == 1  # the third does not fit the KV
    e.end_step(d)
    assert all(r.first_token_at == d for r in e.running)
    assert e.kv_usage == pytest.approx(0.802)  # 2 x (400 prompt + 1 produced) / 1000
    d2 = e.begin_step(d)
    e.end_step(d + d2)
    assert e.kv_tokens == 0 and not e.running  # both finished after 2 tokens
    assert e.waiting  # still waiting: it is admitted at the next step


def test_kv_running_out_preempts_the_newest_request_which_resumes_where_it_was() -> None:
    # 2 requests of 490 prompt tokens fill a 1,000-token cache after 10 decode steps
    e = SimEngine("a", EngineParams(kv_capacity_tokens=1000))
    first, second = _req(1, 490, 50), _req(2, 490, 50)
    e.arrive(first, 0.0)
    e.arrive(second, 0.0)
    t = 0.0
    while not e.preemptions:
        d = e.begin_step(t)
        e.end_step(t + d)
        t += d
    assert e.running == [first] and list(e.waiting) == [second]  # the newest went back
    assert second.preempted == 1 and second.produced == 10
    assert e.kv_tokens == first.prompt_tokens + first.produced  # its KV freed
    started, first_token = second.started_at, second.first_token_at
    while second.finished_at < 0:
        d = e.begin_step(t)
        e.end_step(t + d)
        t += d
    # admitted again after the first finished, it produced the rest, not all of it again
    assert second.produced == 50 and e.tokens == 100
    assert (second.started_at, second.first_token_at) == (started, first_token)
    assert e.kv_tokens == 0


def test_running_requests_share_the_kv_of_their_common_prompt_blocks() -> None:
    # 4 prompts of 1,000 tokens on one 960-token prefix (60 blocks): with the prefix
    # cache on, the prefix is held once, as vLLM's block manager does
    def blocks(i: int) -> tuple[int, ...]:
        return stream_blocks(100 + i, 1000, system=(7, 960))

    reqs = [_req(i, 1000, 3, blocks(i)) for i in range(4)]
    e = SimEngine("a", EngineParams(kv_capacity_tokens=1500, cache_blocks=1000))
    for r in reqs:
        e.arrive(r, 0.0)
    d = e.begin_step(0.0)
    assert len(e.running) == 4  # 960 + 4 x 40: each adds its own 40 tokens only
    assert e.kv_tokens == 960 + 4 * 40
    e.end_step(d)
    assert e.kv_tokens == 960 + 4 * 41
    e.free_kv(reqs[0])  # one leaves (aborted): the prefix stays for the others
    e.running.remove(reqs[0])
    assert e.kv_tokens == 960 + 3 * 41
    t = d
    while e.running:
        d = e.begin_step(t)
        e.end_step(t + d)
        t += d
    assert e.kv_tokens == 0 and not e.kv_blocks  # freed with its last holder
    # without the prefix cache each holds its whole prompt: one at a time fits
    e = SimEngine("b", EngineParams(kv_capacity_tokens=1500))
    for r in [_req(i, 1000, 3, blocks(i)) for i in range(2)]:
        e.arrive(r, 0.0)
    e.begin_step(0.0)
    assert len(e.running) == 1 and e.kv_tokens == 1000


def test_engine_defaults_keep_the_old_step_time() -> None:
    e = SimEngine("a")
    for i in range(3):
        e.arrive(SimRequest(i, 0, 5, 0.0), 0.0)
    assert e.begin_step(0.0) == pytest.approx(0.012 + 3 * 0.00015 + 3 * 0.0004)
    assert e.kv_usage is None and e.cache is None


# -- workloads ------------------------------------------------------------------------------


def test_workloads_are_a_function_of_the_seed() -> None:
    assert poisson(50, 5, 4, 1) == poisson(50, 5, 4, 1)
    assert poisson(50, 5, 4, 1) != poisson(50, 5, 4, 2)
    assert sessions(5, 5, 4, 3) == sessions(5, 5, 4, 3)
    assert bursts(20, 2, 1.0, 0.1, 4, 1) == bursts(20, 2, 1.0, 0.1, 4, 1)


def test_sizes_are_heavy_tailed() -> None:
    reqs = poisson(400, 30, 1, 7)
    outs = sorted(r.output_tokens for r in reqs)
    prompts = sorted(r.prompt_tokens for r in reqs)
    mean_out = sum(outs) / len(outs)
    assert 250 < mean_out < 430  # ShareGPT-like mean output (338)
    assert outs[int(0.99 * len(outs))] > 4 * outs[len(outs) // 2]  # p99 >> median
    assert prompts[int(0.99 * len(prompts))] > 5 * prompts[len(prompts) // 2]
    assert max(outs) <= OUTPUT_CAP


def test_session_turns_share_their_history_and_system_prompts_are_shared() -> None:
    reqs = sessions(20, 10, 4, 1)
    by_key: dict[str, list[int]] = {}
    for i, r in enumerate(reqs):
        assert r.key is not None
        by_key.setdefault(r.key, []).append(i)
    multi = [ks for ks in by_key.values() if len(ks) > 1]
    assert multi
    for ks in multi:
        for a, b in itertools.pairwise(ks):
            prev, nxt = reqs[a], reqs[b]
            assert nxt.after == a  # the next turn follows the previous one
            assert nxt.prompt_tokens > prev.prompt_tokens + prev.output_tokens
            assert nxt.blocks[: len(prev.done_blocks)] == prev.done_blocks
    firsts = [reqs[ks[0]].blocks[:20] for ks in by_key.values()]
    # 4 system prompts of >= 400 tokens: sessions share their first 25 blocks in groups
    assert len(set(firsts)) <= 4 < len(firsts)


# -- traces ---------------------------------------------------------------------------------


def test_trace_parses_and_keys_share_a_prefix() -> None:
    lines = [
        '{"t": 0.5, "prompt_tokens": 100, "output_tokens": 10, "key": "a", "extra": 1}',
        "",
        '{"t": 0.1, "prompt_tokens": 64, "output_tokens": 5}',
        '{"t": 1.0, "prompt_tokens": 200, "output_tokens": 3, "key": "a"}',
        '{"t": 1.2, "prompt_tokens": 200, "output_tokens": 3}',
    ]
    reqs = parse_trace(lines, clients=4)
    assert [r.t for r in reqs] == [0.1, 0.5, 1.0, 1.2]  # sorted
    a1, a2 = reqs[1], reqs[2]
    assert a1.key == a2.key == "a"
    assert a2.blocks[: len(a1.blocks)] == a1.blocks and len(a1.blocks) == 6
    assert not set(reqs[3].blocks) & set(a2.blocks)  # no key: no shared prefix
    assert all(0 <= r.client < 4 for r in reqs)


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "not a JSON object"),
        ('{"prompt_tokens": 1, "output_tokens": 1}', "'t'"),
        ('{"t": -1, "prompt_tokens": 1, "output_tokens": 1}', "'t'"),
        ('{"t": "0", "prompt_tokens": 1, "output_tokens": 1}', "'t'"),
        ('{"t": 0, "output_tokens": 1}', "'prompt_tokens'"),
        ('{"t": 0, "prompt_tokens": 1.5, "output_tokens": 1}', "'prompt_tokens'"),
        ('{"t": 0, "prompt_tokens": 1, "output_tokens": 0}', "'output_tokens'"),
        ('{"t": 0, "prompt_tokens": 1, "output_tokens": true}', "'output_tokens'"),
        ('{"t": 0, "prompt_tokens": 1, "output_tokens": 1, "key": 5}', "'key'"),
    ],
)
def test_a_bad_trace_line_names_its_number_and_field(line: str, field: str) -> None:
    good = '{"t": 0, "prompt_tokens": 1, "output_tokens": 1}'
    with pytest.raises(TraceError) as e:
        parse_trace([good, line], clients=1)
    assert str(e.value).startswith("trace line 2: ") and field in str(e.value)
    assert "\n" not in str(e.value)


def test_bench_trace_error_is_one_line(tmp_path: Path) -> None:
    f = tmp_path / "t.jsonl"
    f.write_text('{"t": 0, "prompt_tokens": 1, "output_tokens": 1}\n{"t": 1}\n')
    res = CliRunner().invoke(bench_command, ["--trace", str(f)])
    assert res.exit_code != 0
    assert "trace line 2: missing field 'prompt_tokens'" in res.output
    assert "Traceback" not in res.output


# -- metrics --------------------------------------------------------------------------------


def test_latency_metrics() -> None:
    assert waits([0.0, 1.0, 2.0], [0.5, -1.0, 2.25], end_of_run=5.0) == [0.5, 4.0, 0.25]
    assert ttft_percentiles([0.1] * 99 + [10.0]) == (0.1, pytest.approx(0.199))
    assert goodput([0.1, 0.2, 3.0, 0.9], slo_s=1.0, window_s=2.0) == 1.5
    assert hit_rate(25, 100) == 0.25 and hit_rate(0, 0) == 0.0
    # steps: (2, 2) uses every slot; (4, 0) half of them: (2 + 2) / (2 + 4)
    assert lockstep_efficiency_sum([[2, 2], [4, 0], [0, 0]]) == pytest.approx(4 / 6)
    assert lockstep_efficiency_sum([]) == 1.0
    with pytest.raises(ValueError):
        waits([0.0], [], 1.0)


# -- small simulated runs -------------------------------------------------------------------


class AffinityPolicy(Policy):
    """Pure affinity: a keyed request always goes to hash(key) mod N."""

    name = "affinity"

    def pick(self, core: RoutingState) -> EngineView:
        req = core.request
        n = len(core.engines)
        if req is None or req.key is None:
            return core.engines[int(core.rng.random() * n)]
        return core.engines[zlib.crc32(req.key.encode()) % n]


def _small(name: str) -> QualityScenario:
    sc = default_quality_scenarios(2, 8)[name]
    return replace(sc, duration_s=6.0, warmup_s=1.0, drain_s=1.0)


def test_affinity_hits_the_prefix_cache_more_than_random(monkeypatch) -> None:
    from redisbal.bench import quality

    sc = replace(_small("sessions"), duration_s=12.0, warmup_s=2.0)
    work = build_workload(sc, 1)
    rnd = simulate("random", 1, sc, workload=work)
    monkeypatch.setitem(quality.POLICIES, "affinity", AffinityPolicy)
    aff = simulate("affinity", 1, sc, workload=work)
    # the shared system prompts hit on any engine (random: ~0.8); histories only on theirs
    assert aff["prefix_hit_rate"] > rnd["prefix_hit_rate"] + 0.03
    red = simulate("redisbal", 1, sc, workload=work)  # keyed: its bounded-load ring
    assert red["prefix_hit_rate"] > rnd["prefix_hit_rate"]


def test_routers_learning_their_routes_tell_them_in_the_simulator() -> None:
    """The simulator's routers (2 here) tell each other what they learned, on its signed
    block hashes, and hit the prefix cache more than random routing."""
    sc = _small("sessions")
    work = build_workload(sc, 1)
    rnd = simulate("random", 1, sc, workload=work)
    routes = simulate(ROUTES_VIEW, 1, sc, workload=work)
    assert sc.clients == 2 and routes["prefix_hit_rate"] > rnd["prefix_hit_rate"]


def test_oracle_p99_ttft_is_no_worse_than_random() -> None:
    sc = _small("straggler")
    for seed in (1, 2):
        r = simulate("random", seed, sc)
        o = simulate("oracle", seed, sc)
        assert o["ttft_p99_s"] <= r["ttft_p99_s"]
        assert o["goodput_rps"] >= r["goodput_rps"]


def test_a_run_is_deterministic_per_seed() -> None:
    sc = _small("poisson")
    a = simulate("vllm-latest", 3, sc)
    b = simulate("vllm-latest", 3, sc)
    a.pop("sim_wall_s"), b.pop("sim_wall_s")
    assert a == b and a["requests"] > 0
    lock = simulate("redisbal", 1, replace(_small("burst"), drain_s=2.0))
    assert 0 < lock["lockstep_efficiency"] <= 1 and "burst_max_over_mean" in lock


def test_bench_trace_runs_end_to_end(tmp_path: Path) -> None:
    f = tmp_path / "t.jsonl"
    rows = [
        {"t": i * 0.01, "prompt_tokens": 300 + i, "output_tokens": 20, "key": f"k{i % 5}"}
        for i in range(200)
    ]
    f.write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "q.json"
    res = CliRunner().invoke(
        bench_command,
        ["--trace", str(f), "--policies", "random,chbl,oracle", "--seeds", "2", "--json", str(out)],
    )
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    pols = doc["summary"]["8x32"]["trace"]
    assert set(pols) == {"random", "chbl", "oracle"}
    assert pols["oracle"]["ttft_p99_gap_s"]["mean"] == 0.0
    assert pols["chbl"]["prefix_hit_rate"]["mean"] > pols["random"]["prefix_hit_rate"]["mean"]
    assert all(not math.isnan(r["ttft_p99_s"]) for r in doc["runs"]) and len(doc["runs"]) == 6
    assert "p99-oracle" in res.output


class _ExactRecorder(Policy):
    """Least loaded; records whether any engine's pending was reconciled exactly."""

    name = "exact-recorder"
    seen: set[bool] = set()

    def pick(self, core: RoutingState) -> EngineView:
        type(self).seen.update(e.exact for e in core.engines)
        return min(core.engines, key=lambda e: e.waiting + e.running + e.pending)


class _CapRecorder(_ExactRecorder):
    """Least-loaded, recording the running caps the engines declared."""

    caps: set[int] = set()

    def pick(self, core: RoutingState) -> EngineView:
        type(self).caps.update(e.declared_cap for e in core.engines)
        return super().pick(core)


@pytest.mark.parametrize("form", FEEDS)
def test_routers_are_fed_as_engine_sim_reports_as_each_form(form: str, monkeypatch) -> None:
    """--report-as FORM: admitted counts reconcile every router exactly (full); else
    the admitted total goes through RouterCore's TotalReconciler and retires routes
    (vllm-plugin, vllm-metrics, sglang) or nothing does (load-only); a declared cap is
    known to every router at its first route, else learned from queues."""
    from redisbal.bench import quality

    feed = Feed.of(form)
    monkeypatch.setitem(quality.POLICIES, "cap-recorder", _CapRecorder)
    calls: list[tuple[int, int]] = []  # (routes sent there, of them still on their way)
    real = TotalReconciler.in_transit

    def in_transit(self: TotalReconciler, inc: str | None, total: int, sent: int, o: int) -> int:
        calls.append((sent, kept := real(self, inc, total, sent, o)))
        return kept

    monkeypatch.setattr(TotalReconciler, "in_transit", in_transit)
    _CapRecorder.seen, _CapRecorder.caps = set(), set()
    assert simulate("cap-recorder", 1, _small("poisson"), report_as=form)["requests"] > 0
    assert (True in _CapRecorder.seen) == feed.admitted  # (none exact before a snapshot)
    assert _CapRecorder.caps == ({QUALITY_ENGINE.running_cap} if feed.declares_cap else {0})
    assert bool(calls) == feed.total
    assert not feed.total or any(kept < sent for sent, kept in calls)  # routes retired


def test_bench_report_as_and_no_admitted_its_deprecated_alias(tmp_path: Path) -> None:
    """``--no-admitted`` is ``--report-as load-only`` (what it meant: no admitted counts,
    no total, no cap), with a deprecation note; the feed is recorded with the runs."""
    f = tmp_path / "t.jsonl"
    rows = [{"t": 0.02 * k, "prompt_tokens": 200, "output_tokens": 20} for k in range(150)]
    f.write_text("\n".join(json.dumps(r) for r in rows))
    docs = {}
    for name, flags in (
        ("alias", ["--no-admitted"]),
        ("load-only", ["--report-as", "load-only"]),
        ("plugin", ["--report-as", "vllm-plugin"]),
    ):
        out = tmp_path / f"{name}.json"
        argv = ["--trace", str(f), "--policies", "redisbal", "--seeds", "1", "--json", str(out)]
        res = CliRunner().invoke(bench_command, [*argv, *flags])
        assert res.exit_code == 0, res.output
        assert ("deprecated" in res.output) == (name == "alias")
        docs[name] = json.loads(out.read_text())
    assert docs["alias"]["meta"]["report_as"] == "load-only"
    assert docs["plugin"]["meta"]["report_as"] == "vllm-plugin"
    assert [r["ttft_p99_s"] for r in docs["alias"]["runs"]] == [
        r["ttft_p99_s"] for r in docs["load-only"]["runs"]
    ]
    both = CliRunner().invoke(bench_command, ["--no-admitted", "--report-as", "full"])
    assert both.exit_code != 0 and "give one of them" in both.output
    bad = CliRunner().invoke(bench_command, ["--report-as", "vllm"])
    assert bad.exit_code != 0 and "load-only" in bad.output
    for flags in (["--no-admitted"], ["--report-as", "sglang"]):
        res = CliRunner().invoke(bench_command, [*flags, "--real-time"])
        assert res.exit_code != 0 and "routing-quality" in res.output


@pytest.mark.slow
def test_variants_flip_one_option_of_the_default_and_run_only_when_named() -> None:
    from redisbal.bench.oracle import World
    from redisbal.bench.quality import VARIANTS, _policy, available_policies

    assert not set(VARIANTS) & set(available_policies())  # "every policy" stays as it was
    for name, options in VARIANTS.items():
        policy = _policy(name, World())
        assert isinstance(policy, Policy) and policy.name == "redisbal"
        for option, value in options.items():
            assert getattr(policy, option) == value != getattr(type(policy), option)
    res = CliRunner().invoke(
        bench_command, ["--sizes", "8x32", "--scenarios", "poisson", "--seeds", "1",
                        "--policies", ",".join(VARIANTS)],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    assert all(f"\n{v} " in res.output for v in VARIANTS), res.output


def test_bench_trace_on_engines_of_a_given_cap_and_kv_cache(tmp_path: Path) -> None:
    """``--running-cap`` and ``--kv-tokens`` set a trace's engines (the prefix cache in
    the KV's memory): a cache that holds a few of its prompts at once queues them, where
    the default engines run them at once; both apply to a trace only."""
    f = tmp_path / "t.jsonl"
    rows = [{"t": 0.004 * k, "prompt_tokens": 1500, "output_tokens": 60} for k in range(400)]
    f.write_text("\n".join(json.dumps(r) for r in rows))
    docs = {}
    for name, flags in (
        ("default", []),
        ("small", ["--running-cap", "256", "--kv-tokens", "4096"]),
    ):
        out = tmp_path / f"{name}.json"
        argv = ["--trace", str(f), "--policies", "least-inflight", "--seeds", "1", "--json"]
        res = CliRunner().invoke(bench_command, [*argv, str(out), *flags])
        assert res.exit_code == 0, res.output
        docs[name] = json.loads(out.read_text())
    engine = docs["small"]["meta"]["engine"]
    assert (engine["running_cap"], engine["kv_capacity_tokens"], engine["cache_blocks"]) == (
        256,
        4096,
        256,
    )
    assert docs["default"]["meta"]["engine"]["running_cap"] == QUALITY_ENGINE.running_cap
    p99 = {n: d["runs"][0]["ttft_p99_s"] for n, d in docs.items()}
    assert p99["small"] > 2 * p99["default"]
    res = CliRunner().invoke(bench_command, ["--kv-tokens", "4096"])
    assert res.exit_code != 0 and "applies to --trace" in res.output
    res = CliRunner().invoke(bench_command, ["--running-cap", "256", "--real-time"])
    assert res.exit_code != 0 and "routing-quality" in res.output
