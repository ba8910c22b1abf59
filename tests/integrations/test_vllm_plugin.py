"""The vLLM stat-logger plugin against a real Redis, driven by a stand-in for vLLM.

``SchedulerStats`` below is a stand-in, not vLLM: a dataclass with exactly the fields of
``vllm.v1.metrics.stats.SchedulerStats`` in vLLM 0.33.0 (read from the wheel), so that
the plugin reads nothing vLLM does not send. The test on the real vLLM package is
``test_vllm_real.py`` (opt-in, marker ``vllm``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib.metadata import entry_points
from typing import Any

import pytest
import redis
from support.helpers import Barrier, coordinator, io_of_this_thread, wait_until

from redisbal import Counts
from redisbal.barrier.snapshot import Snapshot
from redisbal.integrations import vllm_plugin
from redisbal.integrations.relay import CountsRelay
from redisbal.integrations.vllm_plugin import PluginConfig, PluginConfigError, RedisbalStatLogger
from redisbal.keys import DeploymentKeys
from redisbal.sim.embedded import RedisServer


@dataclass
class SchedulerStats:
    """Stand-in with the fields of vLLM 0.33.0's SchedulerStats (not vLLM itself)."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_skipped_waiting_reqs: int = 0
    num_kv_fetch_reqs_by_stage: dict[str, int] = field(default_factory=dict)
    step_counter: int = 0
    current_wave: int = 0
    kv_cache_usage: float = 0.0
    iteration_details: Any = None
    prefix_cache_stats: Any = None
    connector_prefix_cache_stats: Any = None
    kv_cache_eviction_events: list[Any] = field(default_factory=list)
    spec_decoding_stats: Any = None
    kv_connector_stats: dict[str, Any] | None = None
    ec_connector_stats: dict[str, Any] | None = None
    waiting_lora_adapters: dict[str, int] = field(default_factory=dict)
    running_lora_adapters: dict[str, int] = field(default_factory=dict)
    cudagraph_stats: Any = None
    perf_stats: Any = None


class IterationStats:
    """Stand-in with the fields of vLLM 0.32's IterationStats (not vLLM itself); the
    plugin reads ``finished_requests``, one FinishedRequestStats per request finished."""

    def __init__(self, finished: int = 0) -> None:
        self.iteration_timestamp = time.time()
        self.num_generation_tokens = 0
        self.prompt_token_stats: Any = None
        self.num_preempted_reqs = 0
        self.finished_requests: list[Any] = [object() for _ in range(finished)]
        self.max_num_generation_tokens_iter: list[int] = []
        self.n_params_iter: list[int] = []
        self.time_to_first_tokens_iter: list[float] = []
        self.inter_token_latencies_iter: list[float] = []
        self.num_corrupted_reqs = 0


@pytest.fixture(autouse=True)
def _fresh_senders() -> Iterator[None]:
    yield
    vllm_plugin.close_all()
    vllm_plugin._warned_unconfigured = False


def env(redis_url: str, deployment: str, **extra: str) -> dict[str, str]:
    return {"REDISBAL_REDIS_URL": redis_url, "REDISBAL_DEPLOYMENT": deployment, **extra}


def latest(r: redis.Redis, keys: DeploymentKeys) -> Snapshot | None:
    raw = r.get(keys.snapshot)
    return Snapshot.from_json(raw) if raw else None


def counts(r: redis.Redis, keys: DeploymentKeys) -> dict[str, tuple[int, int]]:
    snap = latest(r, keys)
    return {} if snap is None else {e: (c.waiting, c.running) for e, c in snap.engines.items()}


def test_registered_under_vllms_entry_point_group() -> None:
    eps = {ep.name: ep for ep in entry_points(group="vllm.stat_logger_plugins")}
    assert eps["redisbal"].load() is RedisbalStatLogger


def test_unconfigured_does_nothing_with_one_warning(
    caplog: pytest.LogCaptureFixture, r: redis.Redis, keys: DeploymentKeys
) -> None:
    with caplog.at_level(logging.WARNING, "redisbal.vllm"):
        a = RedisbalStatLogger(None, [0, 1], env={})
        b = RedisbalStatLogger(None, [0], env={"REDISBAL_REDIS_URL": "redis://x"})
    for p in (a, b):
        p.record(SchedulerStats(num_running_reqs=3), None, engine_idx=0)
        assert p.sender is None
    warnings = [rec for rec in caplog.records if rec.levelno == logging.WARNING]
    assert len(warnings) == 1 and "REDISBAL_DEPLOYMENT" in warnings[0].getMessage()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"REDISBAL_ENGINE_ID": "{host}:{port}/{engine}"}, "needs REDISBAL_ENGINE_URL"),
        ({"REDISBAL_ENGINE_ID": "{gpu}"}, "field {gpu} unknown"),
        ({"REDISBAL_MODE": "fast"}, "REDISBAL_MODE must be one of"),
        ({"REDISBAL_ENGINE_URL": "10.0.0.1:8000"}, "expected http(s)://"),
    ],
)
def test_bad_settings_are_one_line_errors(extra: dict[str, str], message: str) -> None:
    with pytest.raises(PluginConfigError) as exc:
        PluginConfig.from_env(env("redis://h", "d", **extra))
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_engine_id_templates_give_valid_names() -> None:
    cfg = PluginConfig.from_env(env("redis://h", "d", REDISBAL_ENGINE_URL="http://[::1]:8001"))
    assert cfg is not None and cfg.engine_id(3) == "1-8001-3"
    cfg = PluginConfig.from_env(
        env(
            "redis://h",
            "d",
            REDISBAL_ENGINE_URL="http://10.0.0.7:8000",
            REDISBAL_ENGINE_ID="{host}:{port}/{engine}",
        )
    )
    assert cfg is not None
    with pytest.raises(ValueError, match="REDISBAL_ENGINE_ID result"):
        cfg.engine_id(0)
    cfg = PluginConfig.from_env(env("redis://h", "d", REDISBAL_ENGINE_ID="dp{engine}"))
    assert cfg is not None and cfg.engine_id(5) == "dp5"


def test_each_step_reaches_the_snapshot_for_every_engine(
    redis_url: str, r: redis.Redis, keys: DeploymentKeys
) -> None:
    Barrier(r, keys).configure()
    p = RedisbalStatLogger(
        None, [0, 1], env=env(redis_url, keys.deployment, REDISBAL_ENGINE_ID="dp{engine}")
    )
    assert p.ids == {0: "dp0", 1: "dp1"}
    p.record(
        SchedulerStats(
            num_running_reqs=5, num_waiting_reqs=2, num_skipped_waiting_reqs=1, kv_cache_usage=0.25
        ),
        None,
        None,
        engine_idx=0,
    )
    p.record(SchedulerStats(num_running_reqs=1), None, None, engine_idx=1)
    wait_until(lambda: counts(r, keys) == {"dp0": (3, 5), "dp1": (0, 1)})
    snap = latest(r, keys)
    assert snap is not None and snap.engines["dp0"].kv_usage == 0.25
    for step in range(1, 30):  # the latest step wins, none is lost at the end
        p.record(
            SchedulerStats(num_running_reqs=step, num_waiting_reqs=step % 3), None, engine_idx=0
        )
    wait_until(lambda: counts(r, keys).get("dp0") == (29 % 3, 29))
    p.record(None, None, engine_idx=0)  # iteration-only records carry no counts
    p.record(SchedulerStats(num_running_reqs=9), None, engine_idx=7)  # not ours: ignored


def test_each_report_carries_the_engines_admitted_total(
    redis_url: str, r: redis.Redis, keys: DeploymentKeys
) -> None:
    """finished (IterationStats.finished_requests summed, records without scheduler
    stats included) + waiting + running, per engine; none with several API servers,
    each of which sees only its own requests finish."""
    Barrier(r, keys).configure()
    p = RedisbalStatLogger(
        None, [0, 1], env=env(redis_url, keys.deployment, REDISBAL_ENGINE_ID="dp{engine}")
    )
    p.record(SchedulerStats(num_running_reqs=3, num_waiting_reqs=1), IterationStats(), None, 0)
    p.record(SchedulerStats(num_running_reqs=1), IterationStats(2), None, engine_idx=1)
    p.record(None, IterationStats(4), None, engine_idx=0)  # finished, no scheduler stats

    def totals() -> dict[str, int | None]:
        snap = latest(r, keys)
        return {} if snap is None else {e: c.admitted_total for e, c in snap.engines.items()}

    wait_until(lambda: totals() == {"dp0": 4, "dp1": 3}, what="the first totals")
    p.record(
        SchedulerStats(num_running_reqs=1, num_skipped_waiting_reqs=2), IterationStats(1), None, 0
    )
    wait_until(lambda: totals() == {"dp0": 5 + 2 + 1, "dp1": 3}, what="the finished summed")
    vllm_plugin.close_all()

    class Parallel:
        _api_process_count = 2

    class Config:
        parallel_config = Parallel()

    q = RedisbalStatLogger(Config(), [0], env=env(redis_url, keys.deployment + ".two"))
    assert q.finished is None  # several API servers: no total
    q.record(SchedulerStats(num_running_reqs=1), IterationStats(5), None, engine_idx=0)
    k2 = DeploymentKeys(keys.deployment + ".two")
    wait_until(lambda: counts(r, k2) == {q.ids[0]: (0, 1)}, what="the step's counts")
    snap = latest(r, k2)
    assert snap is not None and [c.admitted_total for c in snap.engines.values()] == [None]


def test_record_never_waits_on_redis(caplog: pytest.LogCaptureFixture) -> None:
    """Redis is a closed port: record() never touches the network on vLLM's thread (its
    sender does, on its own), and a warning says why nothing arrives."""
    with caplog.at_level(logging.WARNING):
        p = RedisbalStatLogger(None, [0], env=env("redis://127.0.0.1:9/0", "d"))
        with io_of_this_thread() as io:
            for i in range(2000):
                p.record(SchedulerStats(num_running_reqs=i % 50), None, engine_idx=0)
        assert not io, f"record() touched the network: {io}"
        wait_until(lambda: any("unavailable" in rec.getMessage() for rec in caplog.records))


def test_idle_engine_stays_hung_engine_stalls_and_comes_back(
    redis_url: str, r: redis.Redis, keys: DeploymentKeys
) -> None:
    """vLLM sends no stats while an engine is idle: its last idle counts keep it routable.
    An engine whose last counts showed work and whose steps stopped (a hung loop) is
    stalled: not routed to, not waited for, but not expired while its process lives;
    its next step brings it back."""
    with coordinator(redis_url, keys.deployment, dead_after_ms=700, stall_after_ms=300):
        p = RedisbalStatLogger(
            None, [0, 1], env=env(redis_url, keys.deployment, REDISBAL_ENGINE_ID="e{engine}")
        )
        p.record(SchedulerStats(), None, engine_idx=0)  # idle
        p.record(SchedulerStats(num_running_reqs=4), None, engine_idx=1)  # busy, then hangs
        wait_until(lambda: counts(r, keys) == {"e0": (0, 0), "e1": (0, 4)})
        wait_until(lambda: stalled(r, keys) == {"e1"}, timeout=3.0)
        time.sleep(1.0)  # more than dead_after_ms: both still members, e1 still stalled
        assert counts(r, keys) == {"e0": (0, 0), "e1": (0, 4)}
        assert stalled(r, keys) == {"e1"}
        p.record(SchedulerStats(num_running_reqs=2), None, engine_idx=1)  # it steps again
        wait_until(lambda: counts(r, keys) == {"e0": (0, 0), "e1": (0, 2)} and not stalled(r, keys))


def stalled(r: redis.Redis, keys: DeploymentKeys) -> set[str]:
    snap = latest(r, keys)
    return set() if snap is None else set(snap.stalled)


def test_lockstep_mode_tags_reports_with_wave_and_step(
    redis_url: str, r: redis.Redis, keys: DeploymentKeys
) -> None:
    Barrier(r, keys).configure()
    p = RedisbalStatLogger(
        None,
        [0, 1],
        env=env(
            redis_url, keys.deployment, REDISBAL_MODE="lockstep", REDISBAL_ENGINE_ID="r{engine}"
        ),
    )
    for step in (1, 2, 3):
        for e in (0, 1):
            st = SchedulerStats(num_running_reqs=step + e, step_counter=step, current_wave=2)
            p.record(st, None, engine_idx=e)
    wait_until(lambda: (s := latest(r, keys)) is not None and s.cut == (2, 3))
    assert counts(r, keys) == {"r0": (0, 3), "r1": (0, 4)}


def test_per_engine_base_signature(redis_url: str, r: redis.Redis, keys: DeploymentKeys) -> None:
    """Older vLLM builds one logger per engine as factory(vllm_config, engine_index)."""
    Barrier(r, keys).configure()
    e = env(redis_url, keys.deployment, REDISBAL_ENGINE_ID="x{engine}")
    loggers = [RedisbalStatLogger(None, i, env=e) for i in (0, 1)]  # type: ignore[arg-type]
    assert loggers[0].sender is loggers[1].sender  # one sender for the process
    for i, lg in enumerate(loggers):
        lg.record(SchedulerStats(num_waiting_reqs=i + 1), None, engine_idx=i)
    wait_until(lambda: counts(r, keys) == {"x0": (1, 0), "x1": (2, 0)})


def test_redis_restart_costs_a_warning_and_reporting_resumes(
    fresh_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis killed and restarted empty (no persistence): record() never waits, one
    warning says Redis is unavailable, and the engines re-register in a new epoch."""
    keys = DeploymentKeys("plug")
    p = RedisbalStatLogger(
        None, [0, 1], env=env(fresh_server.url, "plug", REDISBAL_ENGINE_ID="e{engine}")
    )
    r = fresh_server.client()
    p.record(SchedulerStats(num_running_reqs=1), None, engine_idx=0)
    p.record(SchedulerStats(num_running_reqs=2), None, engine_idx=1)
    wait_until(lambda: counts(r, keys) == {"e0": (0, 1), "e1": (0, 2)})
    epoch = r.get(keys.epoch)
    with caplog.at_level(logging.WARNING, "redisbal"):
        fresh_server.kill()
        with io_of_this_thread() as io:
            for i in range(500):  # vLLM keeps stepping through the outage
                p.record(SchedulerStats(num_running_reqs=i % 7), None, engine_idx=i % 2)
        assert not io, f"record() touched the network: {io}"
        time.sleep(0.5)
        fresh_server.restart()
        r = fresh_server.client()

        def stepping() -> bool:  # the engines keep stepping
            p.record(SchedulerStats(num_running_reqs=5), None, engine_idx=0)
            p.record(SchedulerStats(num_running_reqs=6), None, engine_idx=1)
            return counts(r, keys) == {"e0": (0, 5), "e1": (0, 6)}

        wait_until(stepping, 10, "the counts after the restart")
    assert r.get(keys.epoch) != epoch
    # the reporters' shared sender says it, rate-limited: one warning when Redis goes,
    # one when it is back
    ours = [r.getMessage() for r in caplog.records if r.name.startswith("redisbal")]
    assert len(ours) == 2, ours
    assert "unavailable" in ours[0] and "reachable again" in ours[1], ours


def test_several_api_servers_get_one_warning_about_idle_news(
    caplog: pytest.LogCaptureFixture, redis_url: str, keys: DeploymentKeys
) -> None:
    """vLLM 0.33.0 keeps --api-server-count in parallel_config._api_process_count."""

    class Parallel:
        _api_process_count = 4

    class Config:
        parallel_config = Parallel()

    assert vllm_plugin.api_server_count(Config()) == 4
    assert vllm_plugin.api_server_count(None) == 1
    with caplog.at_level(logging.WARNING, "redisbal.vllm"):
        RedisbalStatLogger(Config(), [0], env=env(redis_url, keys.deployment))
        RedisbalStatLogger(None, [1], env=env(redis_url, keys.deployment))
    msgs = [rec.getMessage() for rec in caplog.records if rec.levelno == logging.WARNING]
    assert len(msgs) == 1 and "4 API servers" in msgs[0] and "redisbal scrape" in msgs[0]


def test_the_api_servers_of_one_vllm_server_share_one_incarnation() -> None:
    """vLLM's API-server processes are children of one server process: each computes
    the same incarnation (from their parent), another server's differ."""
    code = "from redisbal.integrations.vllm_plugin import server_incarnation as s; print(s())"
    runs = [
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        for _ in range(2)
    ]
    mine = vllm_plugin.server_incarnation(os.getpid())
    assert mine is not None
    assert [r.stdout.strip() for r in runs] == [mine, mine]
    assert vllm_plugin.server_incarnation() != mine  # this process's parent: another server


def test_several_api_servers_report_one_engine_without_a_conflict(
    redis_url: str, r: redis.Redis, keys: DeploymentKeys
) -> None:
    """Two API servers of one vLLM server (two relays, one shared incarnation) report the
    same engine in turn: every report accepted; a relay of another server is a conflict."""
    Barrier(r, keys).configure()
    shared = vllm_plugin.server_incarnation(os.getpid())
    assert shared is not None
    relays = [CountsRelay(redis_url, keys.deployment, incarnation=shared) for _ in range(2)]
    try:
        for relay in relays:
            relay.add("e0")
        for i in range(10):
            relays[i % 2].submit("e0", Counts(waiting=i, running=1))
        # both relays' reports are accepted (the snapshot may flip between their counts:
        # the plugin warns of that), none refused
        wait_until(lambda: all(relay.stats("e0")["accepted"] >= 5 for relay in relays))
        assert all(relay.stats("e0")["conflict"] == 0 for relay in relays)
        assert int(r.hget(keys.meta, "conflicts") or 0) == 0
        assert counts(r, keys)["e0"][1] == 1
    finally:
        for relay in relays:
            relay.close()


class Health:
    """A real HTTP server whose ``GET /health`` answers 503 until ``up`` is set, as a vLLM
    server's does not answer until its engine and HTTP server are ready."""

    def __init__(self) -> None:
        self.up = threading.Event()
        health = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200 if health.up.is_set() and self.path == "/health" else 503)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def health() -> Iterator[Health]:
    h = Health()
    yield h
    h.close()


def test_health_probe_answers_only_a_2xx(health: Health) -> None:
    """The probe the plugin polls on its sender's loop: 503 and a refused port are not
    ready, 200 is; it never raises."""
    probe = vllm_plugin._answers
    assert asyncio.run(probe(health.url + "/health")) is False
    health.up.set()
    assert asyncio.run(probe(health.url + "/health")) is True
    assert asyncio.run(probe(health.url + "/other")) is False
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert asyncio.run(probe(f"http://127.0.0.1:{port}/health")) is False


def test_a_server_is_routable_once_healthy_without_any_request(
    redis_url: str, r: redis.Redis, keys: DeploymentKeys, health: Health
) -> None:
    """vLLM calls the plugin only when an engine steps: a fresh server that nobody sent a
    request to has no counts. The plugin reports it idle once its /health answers (not
    before: gateways must not get it while it cannot serve), and keeps it alive."""
    with coordinator(redis_url, keys.deployment, dead_after_ms=700):
        e = env(redis_url, keys.deployment, REDISBAL_ENGINE_ID="e{engine}")
        RedisbalStatLogger(None, [0, 1], env={**e, "REDISBAL_ENGINE_URL": health.url})
        wait_until(lambda: set(Barrier(r, keys).members()) == {"e0", "e1"})
        time.sleep(0.5)
        assert counts(r, keys) == {}, "announced before /health answered"
        health.up.set()
        wait_until(lambda: counts(r, keys) == {"e0": (0, 0), "e1": (0, 0)}, timeout=3.0)
        time.sleep(1.5)  # twice dead_after_ms, no record() at all: still there, idle
        assert counts(r, keys) == {"e0": (0, 0), "e1": (0, 0)}
        assert set(Barrier(r, keys).members()) == {"e0", "e1"}
        assert {v.decode() for v in r.hgetall(keys.urls).values()} == {health.url}


def test_a_restarted_server_is_routable_again_without_any_request(
    redis_url: str, r: redis.Redis, keys: DeploymentKeys, health: Health
) -> None:
    """The server dies (its sender stops without leaving) and a new process starts under
    the same engine id: once healthy it is in the snapshot again, as a new incarnation."""
    health.up.set()
    with coordinator(redis_url, keys.deployment, dead_after_ms=700):
        e = env(redis_url, keys.deployment, REDISBAL_ENGINE_ID="e{engine}")
        e["REDISBAL_ENGINE_URL"] = health.url
        RedisbalStatLogger(None, [0], env=e)
        wait_until(lambda: counts(r, keys) == {"e0": (0, 0)}, timeout=3.0)
        first = latest(r, keys)
        assert first is not None
        old = first.engines["e0"].incarnation
        assert old is not None
        vllm_plugin.close_all(leave=False)  # a SIGKILL: no leave, the reports stop
        RedisbalStatLogger(None, [0], env=e)  # the restarted server: a new sender

        def back() -> bool:
            snap = latest(r, keys)
            return (
                snap is not None
                and snap.engines.keys() == {"e0"}
                and snap.engines["e0"].incarnation not in (None, old)
            )

        wait_until(back, timeout=3.0)


class SchedulerConfig:
    """Stand-in with the two fields of vLLM 0.33.0's SchedulerConfig the plugin reads."""

    def __init__(self, max_num_seqs: Any = 256, max_num_active_seqs: Any = None) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_num_active_seqs = max_num_active_seqs


class VllmConfig:
    def __init__(self, scheduler_config: Any) -> None:
        self.scheduler_config = scheduler_config


def test_the_running_cap_is_max_num_active_seqs_where_set_else_max_num_seqs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cap = vllm_plugin.running_cap_of
    assert cap(VllmConfig(SchedulerConfig(256))) == 256
    assert cap(VllmConfig(SchedulerConfig(256, 32))) == 32
    assert cap(None) is None and cap(VllmConfig(None)) is None
    with caplog.at_level(logging.WARNING, "redisbal.vllm"):
        assert cap(VllmConfig(SchedulerConfig(0))) is None
    assert "declaring no running cap" in caplog.text and "max_num_seqs" in caplog.text


def test_the_engines_declare_the_cap_from_vllm_config(
    redis_url: str, r: redis.Redis, keys: DeploymentKeys
) -> None:
    """Every engine of the logger declares the scheduler's cap once, in the deployment's
    running_caps hash (its reports stay as they were); a logger without a config
    declares none."""
    from redisbal import running_caps

    Barrier(r, keys).configure()
    e = env(redis_url, keys.deployment, REDISBAL_ENGINE_ID="dp{engine}")
    p = RedisbalStatLogger(VllmConfig(SchedulerConfig(128, 48)), [0, 1], env=e)
    q = RedisbalStatLogger(None, [2], env=e)
    assert (p.running_cap, q.running_cap) == (48, None)
    for i, logger in ((0, p), (1, p), (2, q)):
        logger.record(SchedulerStats(num_running_reqs=1), None, engine_idx=i)
    wait_until(lambda: running_caps.fetch_sync(r, keys) == {"dp0": 48, "dp1": 48})
    wait_until(lambda: set(counts(r, keys)) == {"dp0", "dp1", "dp2"})
    vllm_plugin.close_all()  # the engines leave: their caps with them
    assert r.hlen(keys.running_caps) == 0
