"""The plugin inside the real vLLM package (opt-in: ``pytest -m vllm``).

vLLM's own loader (``load_stat_logger_plugin_factories``, entry-point group
``vllm.stat_logger_plugins``) finds the plugin, vLLM's ``StatLoggerManager`` rules decide
how it is built (an ``AggregateStatLoggerBase`` gets ``engine_indexes``), and vLLM's real
``SchedulerStats`` objects drive it against a real Redis. Skipped, with the import error
as the reason, where vLLM cannot be imported.
"""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import redis
from support.helpers import Barrier, wait_until

from redisbal import running_caps
from redisbal.barrier.snapshot import Snapshot
from redisbal.integrations import vllm_plugin
from redisbal.keys import DeploymentKeys

pytestmark = pytest.mark.vllm


def _vllm() -> tuple[Any, Any]:
    try:
        loggers = importlib.import_module("vllm.v1.metrics.loggers")
        stats = importlib.import_module("vllm.v1.metrics.stats")
    except Exception as exc:  # ImportError, or a broken install failing on import
        pytest.skip(f"vLLM not importable here: {type(exc).__name__}: {exc}")
    return loggers, stats


def counts(r: redis.Redis, keys: DeploymentKeys) -> dict[str, tuple[int, int]]:
    raw = r.get(keys.snapshot)
    if not raw:
        return {}
    return {e: (c.waiting, c.running) for e, c in Snapshot.from_json(raw).engines.items()}


def test_vllm_loads_the_plugin_and_its_stats_reach_the_snapshot(
    redis_url: str, r: redis.Redis, keys: DeploymentKeys, monkeypatch: pytest.MonkeyPatch
) -> None:
    loggers, stats = _vllm()
    Barrier(r, keys).configure()
    monkeypatch.setenv("REDISBAL_REDIS_URL", redis_url)
    monkeypatch.setenv("REDISBAL_DEPLOYMENT", keys.deployment)
    monkeypatch.setenv("REDISBAL_ENGINE_ID", "vllm{engine}")
    factories = loggers.load_stat_logger_plugin_factories()
    ours = [f for f in factories if f is vllm_plugin.RedisbalStatLogger]
    assert ours, f"vLLM's loader did not find the plugin: {factories}"
    factory = ours[0]
    # StatLoggerManager's rule: an AggregateStatLoggerBase subclass is built once for all
    # engines, with keyword arguments vllm_config / engine_indexes
    assert issubclass(factory, loggers.AggregateStatLoggerBase)
    plugin = factory(vllm_config=None, engine_indexes=[0, 1])
    try:
        plugin.log_engine_initialized()
        s0 = stats.SchedulerStats(
            num_running_reqs=6, num_waiting_reqs=2, num_skipped_waiting_reqs=1, kv_cache_usage=0.5
        )
        s1 = stats.SchedulerStats(num_running_reqs=1)
        plugin.record(scheduler_stats=s0, iteration_stats=None, mm_cache_stats=None, engine_idx=0)
        plugin.record(scheduler_stats=s1, iteration_stats=None, mm_cache_stats=None, engine_idx=1)
        wait_until(lambda: counts(r, keys) == {"vllm0": (3, 6), "vllm1": (0, 1)}, 5, "the counts")
        plugin.log()
        plugin.record_sleep_state(1, 1)
    finally:
        vllm_plugin.close_all()


TINY_LLAMA = (
    '{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,'
    ' "intermediate_size": 128, "num_attention_heads": 4, "num_hidden_layers": 2,'
    ' "num_key_value_heads": 4, "vocab_size": 1000, "max_position_embeddings": 512,'
    ' "rms_norm_eps": 1e-6, "torch_dtype": "float32", "tie_word_embeddings": false}'
)


def test_vllm_stat_logger_manager_drives_the_plugin_next_to_its_prometheus_logger(
    redis_url: str,
    r: redis.Redis,
    keys: DeploymentKeys,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Any,
) -> None:
    """The path AsyncLLM takes: StatLoggerManager(custom_stat_loggers=the plugins vLLM's
    loader found) builds the plugin next to vLLM's PrometheusStatLogger, and its record()
    feeds both. The /metrics text vLLM's own logger then renders parses, with the
    sidecar's parser, to the same counts the plugin reported."""
    loggers, stats = _vllm()
    config = importlib.import_module("vllm.config")
    prometheus_client = importlib.import_module("prometheus_client")
    from redisbal.integrations.metrics_page import EngineSample, parse_page

    (tmp_path / "config.json").write_text(TINY_LLAMA)  # a model config only: no weights
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    try:
        vllm_config = config.VllmConfig(
            model_config=config.ModelConfig(model=str(tmp_path), skip_tokenizer_init=True),
            device_config=config.DeviceConfig(device="cpu"),
        )
    except Exception as exc:
        pytest.skip(f"vLLM cannot build a VllmConfig here: {type(exc).__name__}: {exc}")
    Barrier(r, keys).configure()
    monkeypatch.setenv("REDISBAL_REDIS_URL", redis_url)
    monkeypatch.setenv("REDISBAL_DEPLOYMENT", keys.deployment)
    monkeypatch.setenv("REDISBAL_ENGINE_ID", "dp{engine}")
    manager = loggers.StatLoggerManager(
        vllm_config,
        engine_idxs=[0, 1],
        custom_stat_loggers=loggers.load_stat_logger_plugin_factories(),
        enable_default_loggers=False,
    )
    try:
        kinds = [type(s).__name__ for s in manager.stat_loggers]
        assert kinds == ["RedisbalStatLogger", "PrometheusStatLogger"], kinds
        # the running cap read from the real VllmConfig vLLM handed the plugin, declared
        # once per engine (redisbal.running_caps)
        cap = vllm_config.scheduler_config.max_num_seqs
        assert isinstance(cap, int) and cap >= 1
        assert manager.stat_loggers[0].running_cap == cap
        manager.log_engine_initialized()
        sent = {
            0: stats.SchedulerStats(num_running_reqs=7, num_waiting_reqs=3,
                                    num_skipped_waiting_reqs=1, kv_cache_usage=0.375),
            1: stats.SchedulerStats(num_running_reqs=12, kv_cache_usage=0.75),
        }  # fmt: skip
        for idx, st in sent.items():
            manager.record(scheduler_stats=st, iteration_stats=None, engine_idx=idx)
        wait_until(lambda: counts(r, keys) == {"dp0": (4, 7), "dp1": (0, 12)}, 5, "the counts")
        assert running_caps.fetch_sync(r, keys) == {"dp0": cap, "dp1": cap}
        page = prometheus_client.generate_latest().decode()
        # with vLLM's progress counters (its token counters: no iteration yet, so 0)
        assert parse_page(page) == [
            EngineSample("0", waiting=4, running=7, kv_usage=0.375, progress=0.0),
            EngineSample("1", waiting=0, running=12, kv_usage=0.75, progress=0.0),
        ]
        # an engine step that made tokens moves engine 0's progress counters only: the
        # sidecar tells a hung engine from a working one by them
        it = stats.IterationStats()
        it.num_generation_tokens = 5
        manager.record(scheduler_stats=sent[0], iteration_stats=it, engine_idx=0)
        moved = {
            e.engine: e.progress for e in parse_page(prometheus_client.generate_latest().decode())
        }
        assert moved["0"] is not None and moved["0"] > 0 and moved["1"] == 0.0, moved
    finally:
        vllm_plugin.close_all()
