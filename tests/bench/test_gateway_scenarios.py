"""The real-time benchmark's scenario options (redisbal.bench.gateway_scenarios,
loadgen --split, session_trace.py longprompt, scripts/gateway_policies.py): pure logic,
the option errors, and one small run through the script."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from click.testing import CliRunner
from support.scripts import load_script

from redisbal.bench import peer_routers
from redisbal.bench.gateway_scenarios import (
    Bypass,
    bypass_trace,
    cache_blocks,
    check_slow,
    check_split,
    kv_event_endpoints,
    kv_events_engine_args,
    kv_sources,
    kv_subscriber_args,
    parse_bypass,
    scenario,
)
from redisbal.bench.loadgen import loadgen, split_targets
from redisbal.sim.load_plan import Planned, read_trace

pytestmark = pytest.mark.gateway  # .ci/run runs these on the lowest aiohttp too

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def _script(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout, check=False
    )


# -- --split --------------------------------------------------------------------------------------


def test_split_default_is_in_turn() -> None:
    assert split_targets(7, 3, None, 1) == [0, 1, 2, 0, 1, 2, 0]
    assert split_targets(4, 1, 0.7, 1) == [0, 0, 0, 0]


def test_split_gives_replica_0_its_share_and_the_others_the_rest_evenly() -> None:
    got = split_targets(10_000, 4, 0.7, seed=1)
    assert got == split_targets(10_000, 4, 0.7, seed=1)  # every policy: the same assignment
    assert got != split_targets(10_000, 4, 0.7, seed=2)
    counts = [got.count(i) for i in range(4)]
    assert abs(counts[0] - 7000) < 400  # binomial sd 46: a bound no seed reaches
    assert max(counts[1:]) - min(counts[1:]) <= 1  # the rest in turn
    assert sum(counts) == 10_000
    assert split_targets(50, 2, 1.0, 3) == [0] * 50
    assert split_targets(50, 3, 0.0, 3) == [1, 2] * 25


def test_loadgen_split_needs_two_urls() -> None:
    out = CliRunner().invoke(loadgen, ["--url", "http://127.0.0.1:1", "--split", "0.7"])
    assert out.exit_code == 2 and "needs two --url or more" in out.output
    assert "Traceback" not in out.output


# -- --bypass, --slow, --split at the boundary ----------------------------------------------------


def test_bypass_parses_rate_and_engines() -> None:
    assert parse_bypass("12:0,1", 8) == Bypass(12.0, ("0", "1"))
    assert parse_bypass("0.5:3,3", 4) == Bypass(0.5, ("3",))


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("12:99", "among 0..7"),
        ("12:0,8", "got 8"),
        ("12:", "among 0..7"),
        ("12", "use RATE:ID"),
        ("x:0", "use RATE:ID"),
        ("0:0", "use RATE:ID"),
        ("nan:0", "use RATE:ID"),
        ("-3:0", "use RATE:ID"),
    ],
)
def test_bad_bypass_is_a_one_line_error(value: str, words: str) -> None:
    with pytest.raises(ValueError, match="--bypass") as err:
        parse_bypass(value, 8)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_slow_takes_several_engines_in_demos_format() -> None:
    assert check_slow(["0,1,2,3:2"], 8) == {"0": 2.0, "1": 2.0, "2": 2.0, "3": 2.0}
    assert check_slow(["0:2", "5:1.5"], 8) == {"0": 2.0, "5": 1.5}
    assert check_slow([], 8) == {}
    for bad, words in (
        (["9:2"], "does not have: 9"),
        (["0:abc"], "ID[,ID...]:FACTOR"),
        (["0:0"], "ID[,ID...]:FACTOR"),
    ):
        with pytest.raises(ValueError, match="--slow") as err:
            check_slow(bad, 8)
        assert words in str(err.value) and "\n" not in str(err.value)


def test_split_needs_a_share_and_replicas() -> None:
    check_split(None, 1)
    check_split(0.7, 2)
    for share, gateways in ((0.7, 1), (1.5, 2), (-0.1, 2), (float("nan"), 2)):
        with pytest.raises(ValueError, match="--split"):
            check_split(share, gateways)


def test_script_says_bad_scenario_options_in_one_line() -> None:
    script = str(SCRIPTS / "gateway_policies.py")
    for args, words in (
        (["--bypass", "12:99"], "engine ids must be among 0..7"),
        (["--slow", "8:2"], "does not have: 8"),
        (["--split", "0.7", "--gateways", "1"], "--split needs --gateways 2"),
    ):
        got = _script(script, "--engines", "8", *args)
        assert got.returncode == 2 and words in got.stderr, got.stderr
        assert "Traceback" not in got.stderr


# -- the bypass traffic and the scenario record ----------------------------------------------------


def test_bypass_traffic_is_shaped_on_the_load_and_the_same_per_seed() -> None:
    shapes = [Planned(0.0, 100, 10), Planned(1.0, 3000, 5, "s", system=2, system_tokens=2900)]
    by = Bypass(10.0, ("0",))
    lines = bypass_trace(by, 100.0, 1, shapes)
    assert lines == bypass_trace(by, 100.0, 1, shapes)
    assert lines != bypass_trace(by, 100.0, 2, shapes)
    assert 800 < len(lines) < 1200  # Poisson 10/s over 100 s: sd 32
    assert all(0 <= d["t"] < 100 for d in lines)
    assert len({d["key"] for d in lines}) == len(lines)  # text of their own
    sizes = {(d["prompt_tokens"], d["output_tokens"], d.get("system")) for d in lines}
    assert sizes == {(100, 10, None), (3000, 5, 2)}
    with pytest.raises(ValueError, match="no requests"):
        bypass_trace(by, 1.0, 1, [])


def test_scenario_record_says_what_ran() -> None:
    s = scenario(4, 8, 0.7, Bypass(12.0, ("0", "1")), ["0,1:2"])
    assert s["label"] == "4 replicas x 8 engines, split 0.7, bypass 12/s to 0,1, slow 0,1:2"
    assert s["bypass"] == {"rate": 12.0, "engines": ["0", "1"]} and s["split"] == 0.7
    assert scenario(2, 8, None, None, [])["label"] == "2 replicas x 8 engines"
    small = scenario(2, 8, None, None, [], cache=1280)
    assert small["label"] == "2 replicas x 8 engines, cache 1280 blocks"
    assert small["cache_blocks"] == 1280


def test_cache_blocks_are_read_from_the_engine_args() -> None:
    assert cache_blocks(["--kv-tokens", "65536", "--cache-blocks", "1280"]) == 1280
    assert cache_blocks(["--kv-tokens", "65536"]) is None
    for bad in (["--cache-blocks"], ["--cache-blocks", "many"]):
        with pytest.raises(ValueError, match="--cache-blocks needs a number"):
            cache_blocks(bad)


# -- kv_aware on the engines' KV events ------------------------------------------------------------


def test_each_engine_gets_a_publisher_of_its_own_in_id_order() -> None:
    eps = kv_event_endpoints(5601, 3)
    assert eps == ["tcp://127.0.0.1:5601", "tcp://127.0.0.1:5602", "tcp://127.0.0.1:5603"]
    # engine-sim binds engine k's publisher at the given port + k
    assert kv_events_engine_args(eps) == ["--kv-events", "tcp://127.0.0.1:5601"]
    assert kv_events_engine_args([]) == []  # a policy without events adds nothing
    assert kv_subscriber_args(eps[:2]) == [
        "--source", "0=tcp://127.0.0.1:5601", "--source", "1=tcp://127.0.0.1:5602",
    ]  # fmt: skip
    for base, n in ((0, 2), (65535, 2), (5601, -1)):
        with pytest.raises(ValueError, match=r"must be in 1\.\.65535"):
            kv_event_endpoints(base, n)


def test_the_router_is_told_each_workers_publisher_by_engine_id() -> None:
    urls = {"1": "http://127.0.0.1:9002", "0": "http://127.0.0.1:9001"}
    eps = ["tcp://127.0.0.1:5601", "tcp://127.0.0.1:5602"]
    sources = kv_sources(urls, eps)
    assert sources == {"http://127.0.0.1:9001": eps[0], "http://127.0.0.1:9002": eps[1]}
    assert peer_routers.kv_event_args(sources, "redisbal-sim") == [
        "--kv-event-source", "http://127.0.0.1:9001=tcp://127.0.0.1:5601",
        "--kv-event-source", "http://127.0.0.1:9002=tcp://127.0.0.1:5602",
        "--kv-event-block-size", "16",
        "--kv-event-model", "redisbal-sim",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="registered ids"):
        kv_sources({"0": "http://127.0.0.1:9001"}, eps)
    with pytest.raises(peer_routers.RouterError, match="got none"):
        peer_routers.kv_event_args({}, "redisbal-sim")
    with pytest.raises(peer_routers.RouterError, match="use tcp://HOST:PORT"):
        peer_routers.kv_event_args({"http://h:1": "ipc:///tmp/x"}, "redisbal-sim")


def test_only_kv_aware_needs_the_events_and_it_is_a_benchmark_policy() -> None:
    assert "vllm-router:kv_aware" in peer_routers.NAMES
    assert [n for n in peer_routers.NAMES if peer_routers.needs_kv_events(n)] == [
        "vllm-router:kv_aware"
    ]
    assert peer_routers.split_name("vllm-router:kv_aware") == ("vllm-router", "kv_aware")
    # where no engine publishes events, kv_aware is refused rather than run below strength
    with pytest.raises(peer_routers.RouterError, match="KV events") as err:
        peer_routers.split_name_without_events("vllm-router:kv_aware")
    assert "\n" not in str(err.value)
    assert peer_routers.split_name_without_events("vllm-router:cache_aware")[1] == "cache_aware"
    for script in ("engine_faults.py", "gateway_overhead.py"):
        got = _script(str(SCRIPTS / script), "--" + ("routers" if "faults" in script else "peers"),
                      "vllm-router:kv_aware")  # fmt: skip
        assert got.returncode != 0 and "routes on the engines' KV events" in got.stderr, got.stderr
        assert "Traceback" not in got.stderr


def _kv_metrics(by_prefix: int, rendered: int, lookups: dict[str, int]) -> str:
    lines = [
        'vllm_router_prefix_routing_decisions_total{policy="kv_aware",stage="regular",'
        f'outcome="prefix_cost"}} {by_prefix}',
        f'vllm_router_kv_routing_inputs_total{{transport="http",result="render"}} {rendered}',
    ]
    lines += [
        f'vllm_router_kv_placement_lookups_total{{result="{k}"}} {v}' for k, v in lookups.items()
    ]
    return "\n".join(lines) + "\n"


def _replica(metrics: str) -> peer_routers.RouterProcess:
    rp = peer_routers.RouterProcess("vllm-router:kv_aware", Path("x"), 1, 2, [], Path("log"))
    rp.metrics = metrics
    return rp


def test_kv_aware_is_at_full_strength_only_with_hits_from_the_events() -> None:
    renders = {"/v1/completions/render": 6, "/v1/chat/completions/render": 4}
    full = [_replica(_kv_metrics(6, 12, {"hit": 4, "miss": 2})), _replica(_kv_metrics(4, 8, {}))]
    got = peer_routers.check_paths("vllm-router:kv_aware", full, renders, 10)
    assert got["ok"], got
    assert got["kv_lookups"] == {"hit": 4.0, "miss": 2.0}
    assert "10 decisions by prefix cost for 10 requests" in got["note"]
    # the index never fed (no engine events): every lookup a miss
    blind = [_replica(_kv_metrics(10, 20, {"miss": 10}))]
    got = peer_routers.check_paths("vllm-router:kv_aware", blind, renders, 10)
    assert not got["ok"] and "never reached its index" in got["note"]
    # a request not rendered on a worker, or not decided by prefix
    for metrics, calls in (
        (_kv_metrics(10, 9, {"hit": 5}), renders),
        (_kv_metrics(9, 20, {"hit": 5}), renders),
        (_kv_metrics(10, 20, {"hit": 5}), {"/v1/completions/render": 3}),
    ):
        assert not peer_routers.check_paths("vllm-router:kv_aware", [_replica(metrics)], calls, 10)[
            "ok"
        ]


# -- longprompt traces ----------------------------------------------------------------------------


def test_longprompt_trace_shares_long_prefixes(tmp_path: Path) -> None:
    out = tmp_path / "lp.jsonl"
    got = _script(
        str(SCRIPTS / "session_trace.py"), "longprompt", "--rate", "20", "--duration", "10",
        "--prefixes", "3", "--prefix-min", "2000", "--prefix-max", "6000", "-o", str(out),
    )  # fmt: skip
    assert got.returncode == 0, got.stderr
    lines = [orjson.loads(x) for x in out.read_bytes().splitlines()]
    assert 120 < len(lines) < 280
    prefixes = {(d["system"], d["system_tokens"]) for d in lines}
    assert len(prefixes) == 3 and len(dict(prefixes)) == 3  # one length per prefix
    assert all(2000 <= n <= 6000 for _, n in prefixes)
    assert all(d["prompt_tokens"] > d["system_tokens"] for d in lines)
    assert len({d["key"] for d in lines}) == len(lines)
    assert len(read_trace(str(out))) == len(lines)  # loadgen reads it
    bad = _script(str(SCRIPTS / "session_trace.py"), "longprompt", "--rate", "2",
                  "--prefix-min", "9", "--prefix-max", "3")  # fmt: skip
    assert bad.returncode == 2 and "--prefix-min <= --prefix-max" in bad.stderr


# -- one small run --------------------------------------------------------------------------------


@pytest.mark.slow
def test_gateway_policies_runs_split_and_bypass_apart(tmp_path: Path) -> None:
    """2 engines, 2 replicas, two policies, a few seconds: each row records its scenario,
    the requests each replica was sent (the split's own assignment) and the bypass
    client's figures apart from the routed requests'."""
    trace = tmp_path / "t-1.jsonl"
    made = _script(
        str(SCRIPTS / "session_trace.py"), "poisson", "--rate", "8", "--duration", "3",
        "--output-scale", "0.1", "--seed", "1", "-o", str(trace),
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    planned = read_trace(str(trace))
    out = tmp_path / "runs.json"
    got = _script(
        str(SCRIPTS / "gateway_policies.py"), "--trace", str(tmp_path / "t-{seed}.jsonl"),
        "--engines", "2", "--gateways", "2", "--policies", "redisbal,least-inflight",
        "--seeds", "1", "--split", "0.7", "--bypass", "5:0", "--running-cap", "8",
        "--json", str(out), "--plot", str(tmp_path / "p.png"),
        timeout=300,
    )  # fmt: skip
    assert got.returncode == 0, got.stdout[-2000:] + got.stderr[-2000:]
    runs = orjson.loads(out.read_bytes())["runs"]
    assert [r["policy"] for r in runs] == ["redisbal", "least-inflight"]
    to = split_targets(len(planned), 2, 0.7, 1)
    window = max(p.t for p in planned)
    bypassed = len(bypass_trace(Bypass(5.0, ("0",)), window, 1, planned))
    for r in runs:
        assert r["scenario"]["split"] == 0.7
        assert r["scenario"]["bypass"] == {"rate": 5.0, "engines": ["0"]}
        assert r["sent_per_replica"] == [to.count(0), to.count(1)]
        assert r["requests"] == len(planned)  # the routed requests only
        assert r["bypass"]["requests"] == bypassed and r["bypass"]["ok"] == bypassed
        assert r["bypass"]["ttft_p99_ms"] is not None
        assert sum(r["served"]) == len(planned) + bypassed  # the engines saw both
    assert "bypass TTFT p99 (ms)" in got.stdout and "split 0.7, bypass 5/s to 0" in got.stdout
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_a_default_policy_variant_runs_on_the_cache_views_by_its_name() -> None:
    gp = load_script("gateway_policies")
    assert gp.cache_view_variant("redisbal-hold+kv") == "redisbal-hold"
    assert gp.cache_view_variant("redisbal+kv") is None  # the default itself, not a variant
    assert gp.cache_view_variant("no-such+kv") is None
    assert gp.cache_view_variant("redisbal-hold") is None
