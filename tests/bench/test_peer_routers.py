"""The real peer routers against the simulated HTTP engines (opt-in: ``pytest -m peers``).

vllm-router 0.1.17 and sglang-router 0.3.2, as the benchmark installs them
(redisbal.bench.peer_routers; ``REDISBAL_PEER_VENV`` names the venv, default
``~/.cache/redisbal/peer-routers``), in front of two engines: each router's own
/metrics and /workers, and the calls the engines answered, must show that the
router's prefix-aware and load-aware paths run on what engine-sim serves; vllm-router's
kv_aware on the KV events engine-sim publishes, through scripts/gateway_policies.py.
Skipped, with the reason, where the pinned routers are not installed.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from support.helpers import await_until

from redisbal.bench import peer_routers
from redisbal.sim.http_engine import HttpEngine
from redisbal.sim.model import EngineParams

pytestmark = pytest.mark.peers
MODEL = "redisbal-sim"
SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
FAST = EngineParams(running_cap=8, base_step_s=0.004, per_seq_s=0.0, prefill_s=0.0)


def _exe(router: str) -> Path:
    exe = peer_routers.binary(router)
    if exe is None:
        pytest.skip(
            f"{router} {peer_routers.PINNED[router]} is not installed in "
            f"{peer_routers.default_venv()} "
            "(scripts/gateway_policies.py installs it on first use; or set REDISBAL_PEER_VENV)"
        )
    return exe


@contextlib.asynccontextmanager
async def engines(n: int) -> AsyncIterator[list[HttpEngine]]:
    es = [HttpEngine(str(i), redis_url=None, deployment="x", port=0, params=FAST) for i in range(n)]
    for e in es:
        await e.start()
    try:
        yield es
    finally:
        await asyncio.gather(*(e.stop(drain_s=2.0) for e in es))


@contextlib.asynccontextmanager
async def router(
    name: str, es: list[HttpEngine], tmp: Path, args: list[str] | None = None
) -> AsyncIterator[Any]:
    port, mport = peer_routers.free_ports(2)
    rp = peer_routers.RouterProcess(
        name, _exe(name.split(":")[0]), port, mport, [e.url for e in es], tmp / "router.log",
        args=args or [],
    )  # fmt: skip
    rp.start()
    try:

        def ready() -> bool:
            assert rp.proc is not None and rp.proc.poll() is None, rp.tail()
            return bool(rp.ready())

        await await_until(ready, 30, f"{name} to be ready", 0.2, threaded=True)
        yield rp
    finally:
        await asyncio.to_thread(rp.stop)


async def _send(url: str, prompts: list[str]) -> None:
    async with aiohttp.ClientSession() as s:
        for p in prompts:
            body = {"model": MODEL, "prompt": p, "max_tokens": 2}
            async with s.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()


async def _peer_calls(es: list[HttpEngine]) -> dict[str, int]:
    out: dict[str, int] = {}
    async with aiohttp.ClientSession() as s:
        for e in es:
            async with s.get(e.url + "/sim/peer_calls") as r:
                for k, v in (await r.json()).items():
                    out[k] = out.get(k, 0) + v
    return out


async def test_vllm_router_cache_aware_routes_by_prefix_on_rendered_tokens(
    tmp_path: Path,
) -> None:
    system = "You are a careful assistant who answers briefly. " * 8
    prompts = [system + f"question number {i} about something" for i in range(6)]
    async with engines(2) as es, router("vllm-router:cache_aware", es, tmp_path) as rp:
        await _send(rp.url, prompts)
        await asyncio.to_thread(rp.scrape)
        calls = await _peer_calls(es)
    check = peer_routers.check_paths("vllm-router:cache_aware", [rp], calls, len(prompts))
    assert check["ok"], check
    # a shared prefix: after the first, requests are decided as prefix hits
    assert check["prefix_outcomes"].get("prefix_hit", 0) >= len(prompts) - 1, check
    assert "missing_tokens" not in check["prefix_outcomes"]


async def test_sglang_router_registers_the_model_and_reads_loads(tmp_path: Path) -> None:
    async with engines(2) as es, router("sglang-router:power_of_two", es, tmp_path) as rp:
        await _send(rp.url, ["hello there"] * 4)
        # the router's own view of the workers' loads: read from the engines' /get_load
        async with aiohttp.ClientSession() as s, s.get(rp.url + "/get_loads") as r:
            loads = (await r.json())["workers"]
        await asyncio.to_thread(rp.scrape)
        calls = await _peer_calls(es)
    assert sorted(w["worker"] for w in loads) == sorted(e.url for e in es)
    assert all(w["load"] >= 0 for w in loads), loads  # -1: a load it could not read
    check = peer_routers.check_paths("sglang-router:power_of_two", [rp], calls, 4)
    assert check["ok"], check
    assert check["models"] == [MODEL]


# (the two above check the paths that read more: rendered prefixes, polled loads; the
# KV-event path below)
OWN_STATE = [
    n
    for n in peer_routers.NAMES
    if n not in ("vllm-router:cache_aware", "sglang-router:power_of_two")
    and not peer_routers.needs_kv_events(n)
]


@pytest.mark.parametrize("name", OWN_STATE)
async def test_every_shipped_policy_decides_every_request_itself(name: str, tmp_path: Path) -> None:
    """Each policy the benchmark names is one the router ships and runs as named: its
    own /metrics count a decision of that policy for every request sent."""
    async with engines(2) as es, router(name, es, tmp_path) as rp:
        await _send(rp.url, [f"hello {i}" for i in range(4)])
        await asyncio.to_thread(rp.scrape)
        calls = await _peer_calls(es)
    check = peer_routers.check_paths(name, [rp], calls, 4)
    assert check["ok"], check


async def test_vllm_router_kv_aware_follows_kv_events_in_the_format_it_decodes(
    tmp_path: Path,
) -> None:
    """A hand-made publisher per engine says engine 1 stores a prompt's blocks: kv_aware
    sends that prompt to engine 1, and the benchmark's check calls it full strength (the
    engines' own publishers are checked end to end below). vllm-router 0.1.17 decodes a
    batch ``[ts, events, rank]`` whose events are msgpack maps tagged by ``type``
    (BlockStored must carry ``lora_name``, nil allowed), and indexes the stored blocks by
    their ``token_ids``, not by their hashes."""
    zmq = pytest.importorskip("zmq")
    msgpack = pytest.importorskip("msgpack")
    from redisbal.sim.peer_router_endpoints import token_ids

    ctx = zmq.Context()
    ports = peer_routers.free_ports(2)
    pubs = [ctx.socket(zmq.PUB) for _ in ports]
    for sock, p in zip(pubs, ports, strict=True):
        sock.bind(f"tcp://127.0.0.1:{p}")
    text = "Q" * 64 * 20 + "and a tail of its own"
    ids = token_ids(text)[:320]  # 20 whole blocks
    stored = {"type": "BlockStored", "block_hashes": list(range(1, 21)),
              "parent_block_hash": None, "token_ids": ids, "block_size": 16,
              "lora_id": None, "medium": "GPU", "lora_name": None}  # fmt: skip
    try:
        async with engines(2) as es:
            sources = {e.url: f"tcp://127.0.0.1:{p}" for e, p in zip(es, ports, strict=True)}
            args = peer_routers.kv_event_args(sources, MODEL)
            async with router("vllm-router:kv_aware", es, tmp_path, args) as rp:
                sent, deadline = 0, time.monotonic() + 20
                while not _hits(rp):  # resent until the subscriber has joined
                    assert time.monotonic() < deadline, rp.tail()
                    batch = msgpack.packb([time.time(), [stored], None])
                    pubs[1].send_multipart([b"", sent.to_bytes(8, "big"), batch])
                    await asyncio.sleep(0.2)
                    await _send(rp.url, [text])
                    sent += 1
                    await asyncio.to_thread(rp.scrape)
                before = es[1].served
                await _send(rp.url, [text] * 3)
                sent += 3
                await asyncio.to_thread(rp.scrape)
                calls = await _peer_calls(es)
                served = es[1].served - before
    finally:
        for sock in pubs:
            sock.close(0)
        ctx.term()
    check = peer_routers.check_paths("vllm-router:kv_aware", [rp], calls, sent)
    assert check["ok"], check
    assert served == 3  # where the events said the blocks are


def _hits(rp: peer_routers.RouterProcess) -> bool:
    rows = peer_routers.parse_metrics(rp.metrics)
    return peer_routers.total(rows, "vllm_router_kv_placement_lookups_total", result="hit") > 0


def _run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout, check=False
    )


@pytest.mark.slow
def test_vllm_router_kv_aware_runs_on_the_engines_kv_events(tmp_path: Path) -> None:
    """A few seconds of the prefixes trace through one kv_aware replica before two
    engines publishing their KV events: every request rendered and decided by prefix
    cost, lookups hitting blocks the events put in its index, all answered."""
    _exe("vllm-router")
    helped = _run("-m", "redisbal", "engine-sim", "--help")
    if "--kv-events" not in helped.stdout:
        pytest.skip("engine-sim has no --kv-events option (it publishes no KV events)")
    made = _run(
        str(SCRIPTS / "session_trace.py"), "prefixes", "--rate", "6", "--duration", "4",
        "--prefixes", "4", "--prefix-min", "256", "--prefix-max", "512",
        "--output-scale", "0.05", "--seed", "1", "-o", str(tmp_path / "p-1.jsonl"),
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    out = tmp_path / "runs.json"
    got = _run(
        str(SCRIPTS / "gateway_policies.py"), "--trace", str(tmp_path / "p-{seed}.jsonl"),
        "--engines", "2", "--gateways", "1", "--policies", "vllm-router:kv_aware",
        "--seeds", "1", "--running-cap", "8", "--drain-timeout", "30",
        "--engine-args", "--cache-blocks 256 --prefill-token-us 10", "--json", str(out),
        timeout=300,
    )  # fmt: skip
    assert got.returncode == 0, got.stdout[-2000:] + got.stderr[-2000:]
    (row,) = orjson.loads(out.read_bytes())["runs"]
    assert row["paths"]["ok"], row["paths"]
    assert row["ok"] == row["requests"] > 0
    assert row["hit_rate"] > 0
