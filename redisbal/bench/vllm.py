"""The vLLM baselines' transport: vLLM's DP-coordinator publish loop, replayed from
the engines' reports, onto compat keys that only the benchmark uses."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import Any

import orjson

from redisbal.errors import InvalidArgument
from redisbal.keys import DeploymentKeys, is_engine_field
from redisbal.routing.policies import Policy
from redisbal.routing.router import AsyncRouter

VLLM_POLICIES = ("vllm-pre", "vllm-21617", "vllm-latest")
# Engines report their counts after every step and, as vLLM's engines do since PR
# 41626, again right after the input queue was taken into the scheduler, before the
# step ("publish request counts before and after GPU step to ensure freshness":
# vllm/v1/engine/core.py, EngineCoreProc.run_busy_loop and
# DPEngineCoreProc.run_busy_loop); redisbal's reporter has the same option. The
# baselines of vLLM before 41626 get only the after-step reports, as their engines
# sent (DPEngineCoreProc.run_busy_loop published once, after _process_engine_step).
AFTER_STEP_ONLY_POLICIES = ("vllm-pre", "vllm-21617")


class CompatKeys(DeploymentKeys):
    """A deployment's keys with the snapshot and its channel replaced by the compat view
    that ``VllmCoordinatorEmulation`` writes: a baseline's router reads these instead
    of the barrier's, and nothing else changes."""

    @property
    def snapshot(self) -> str:
        """STRING: latest vLLM-timed view, in the Snapshot format."""
        return self.key("compat")

    @property
    def channel(self) -> str:
        """Pub/sub channel of the vLLM-timed view."""
        return self.key("compat-snapshots")


def baseline_router(
    url: str,
    deployment: str,
    index: int,
    clients: int,
    policy: str | Policy,
    rng: random.Random,
    *,
    compat: bool,
) -> AsyncRouter:
    """An API server's router; with ``compat`` it is fed the vLLM-timed view."""
    router = AsyncRouter(url, deployment, index, clients, policy=policy, rng=rng)
    if compat:
        router.keys = CompatKeys(deployment)
    return router


@dataclass
class EngineStat:
    waiting: int
    running: int
    score: int  # (wave, step) as wave * 2**32 + step
    t_ms: float


class VllmCoordinatorModel:
    """vLLM's ``DPCoordinatorProc`` publish loop, driven by timed stats messages.

    The loop polls its sockets with timeout ``max(min_timeout, wait_for - elapsed)``
    where wait_for is 100 ms while stats changed and 5 s otherwise; it publishes
    only when a poll times out (no message arrived for that long). With
    ``buffered`` (PR 21617): when the first stats of a newer (wave, step) arrive
    and stats changed, it keeps a copy of all counts as of the previous step and
    publishes that copy next; while no copy is pending, ``min_wait_ms`` (50)
    is the least a poll waits. Without ``buffered`` (before 21617): the latest
    counts. Engines send stats only when their counts change; ``on_stats``
    expects only such messages (``VllmCoordinatorEmulation`` filters).

    Pure: time is whatever the caller passes (ms), so tests replay it exactly.
    """

    def __init__(
        self,
        *,
        buffered: bool,
        min_wait_ms: float = 50.0,
        interval_ms: float = 100.0,
        idle_ms: float = 5000.0,
    ) -> None:
        self.buffered = buffered
        self.min_wait_ms = min_wait_ms if buffered else 0.0
        self.interval_ms = interval_ms
        self.idle_ms = idle_ms
        self.counts: dict[str, EngineStat] = {}
        self.last_step_counts: dict[str, EngineStat] | None = None
        self.current = -1
        self.stats_changed = False
        self.last_publish = -1e18  # vLLM starts from 0 ms since the epoch: publish at once
        self.poll_start: float | None = None
        self.published = 0

    def _timeout(self, at: float) -> float:
        wait_for = self.interval_ms if self.stats_changed else self.idle_ms
        min_t = self.min_wait_ms if self.last_step_counts is None else 0.0
        return max(min_t, wait_for - (at - self.last_publish))

    def advance(self, now_ms: float) -> list[tuple[float, dict[str, EngineStat]]]:
        """Publishes whose poll timed out before ``now_ms``: [(time, counts)]."""
        out: list[tuple[float, dict[str, EngineStat]]] = []
        if self.poll_start is None:
            self.poll_start = now_ms
            return out
        for _ in range(10_000):  # bounded: each iteration moves time forward
            fire = self.poll_start + self._timeout(self.poll_start)
            if fire >= now_ms:
                break
            out.append((fire, self._publish(fire)))
            self.poll_start = fire
        return out

    def _publish(self, at: float) -> dict[str, EngineStat]:
        if self.last_step_counts is not None:
            counts, self.last_step_counts = self.last_step_counts, None
        else:
            counts = dict(self.counts)
            self.stats_changed = False
        self.last_publish = at
        self.published += 1
        return counts

    def on_stats(
        self, t_ms: float, engine: str, score: int, waiting: int, running: int
    ) -> list[tuple[float, dict[str, EngineStat]]]:
        """One engine's changed counts arrive at t_ms; returns publishes that fired
        before it."""
        pubs = self.advance(t_ms)
        if self.buffered and score > self.current:
            if self.stats_changed:
                self.last_step_counts = dict(self.counts)
            self.current = score
        elif score > self.current:
            self.current = score
        self.counts[engine] = EngineStat(waiting, running, score, t_ms)
        self.stats_changed = True
        self.poll_start = t_ms
        return pubs

    def remove(self, engine: str) -> None:
        """An engine left the deployment (expired / left)."""
        self.counts.pop(engine, None)


def compat_snapshot_json(
    deployment: str, epoch: str, version: int, at_ms: float, counts: dict[str, EngineStat]
) -> bytes:
    """A vLLM push as a redisbal Snapshot JSON (no admitted counts: vLLM has none)."""
    step = max((c.score for c in counts.values()), default=0)
    wave, st = divmod(step, 2**32)
    return orjson.dumps(
        {
            "deployment": deployment,
            "epoch": epoch,
            "version": version,
            "wave": wave,
            "step": st,
            "forced": False,
            "laggards": {},
            "gone": {},
            "joining": [],
            "time_ms": int(at_ms),
            "engines": {
                e: {
                    "wave": c.score // 2**32,
                    "step": c.score % 2**32,
                    "waiting": c.waiting,
                    "running": c.running,
                    "kv": None,
                    "t": int(c.t_ms),
                }
                for e, c in sorted(counts.items())
            },
        }
    )


class VllmCoordinatorEmulation:
    """Feeds ``VllmCoordinatorModel`` from the engines' reports in Redis (the reports
    hash, polled every ``poll_s``) and publishes its pushes on the compat key/channel.

    Messages are the report entries in server-time order, kept only when an engine's
    (waiting, running) changed, as vLLM engines send stats only on change.
    """

    def __init__(
        self,
        client: Any,
        keys: DeploymentKeys,
        model: VllmCoordinatorModel,
        *,
        poll_s: float = 0.005,
    ) -> None:
        self.client = client
        self.keys = keys
        self.compat = CompatKeys(keys.deployment)
        self.model = model
        self.poll_s = poll_s
        self.newest: dict[str, str] = {}  # engine -> newest line seen
        self.last_counts: dict[str, tuple[int, int]] = {}
        self.epoch = ""
        self.version = 0
        self._stop = False

    def extract(self, raw: dict[Any, Any]) -> list[tuple[float, str, int, int, int]]:
        """New (t_ms, engine, score, waiting, running) messages, oldest first."""
        msgs: list[tuple[float, str, int, int, int]] = []
        seen = set()
        for k, v in raw.items():
            eng = k.decode() if isinstance(k, bytes) else k
            if not is_engine_field(eng):  # .pub, .roster, ...: the barrier's own fields
                continue
            rec = v.decode() if isinstance(v, bytes) else v
            seen.add(eng)
            # report lines are "<score>\t[<ms>\t]<json>", newest first; other lines
            # (a record's head line with flags / heartbeat time) are skipped
            lines = [ln for ln in rec.split("\n") if "\t" in ln]
            if not lines:
                continue
            if self.newest.get(eng) == lines[0]:
                continue
            prev = self.newest.get(eng)
            fresh = []
            for line in lines:
                if line == prev:
                    break
                fresh.append(line)
            self.newest[eng] = lines[0]
            for line in reversed(fresh):
                score_s, _, rest = line.partition("\t")
                d = orjson.loads(rest[rest.index("{") :])
                wr = (d["waiting"], d["running"])
                if self.last_counts.get(eng) == wr:
                    continue
                self.last_counts[eng] = wr
                msgs.append((float(d["t"]), eng, int(float(score_s)), wr[0], wr[1]))
        for eng in list(self.newest):
            if eng not in seen:
                del self.newest[eng]
                self.last_counts.pop(eng, None)
                self.model.remove(eng)
        msgs.sort()
        return msgs

    async def publish(self, at: float, counts: dict[str, EngineStat]) -> None:
        self.version += 1
        data = compat_snapshot_json(self.keys.deployment, self.epoch, self.version, at, counts)
        pipe = self.client.pipeline(transaction=False)
        pipe.set(self.compat.snapshot, data)
        pipe.publish(self.compat.channel, data)
        await pipe.execute()

    async def run(self) -> None:
        ep = await self.client.get(self.keys.epoch)
        self.epoch = (ep.decode() if isinstance(ep, bytes) else ep) or "compat"
        while not self._stop:
            now = time.time() * 1000.0
            raw = await self.client.hgetall(self.keys.reports)
            pubs = []
            for t, eng, score, w, r in self.extract(raw):
                pubs += self.model.on_stats(t, eng, score, w, r)
            pubs += self.model.advance(now)
            for at, counts in pubs:
                await self.publish(at, counts)
            await asyncio.sleep(self.poll_s)

    def stop(self) -> None:
        self._stop = True


def reports_before_step(policy: str) -> bool:
    """Whether the engines of this policy's system also report right before each step
    (after taking their input queue into the scheduler): every policy but the
    baselines of vLLM before PR 41626."""
    return policy not in AFTER_STEP_ONLY_POLICIES


def vllm_model_for(policy: str, mode: str) -> VllmCoordinatorModel:
    """vllm-pre: latest counts. vllm-21617: step-buffered, 50 ms least wait. vllm-latest:
    21617's buffering; its 50 ms least wait applies only with wave coordination (lockstep)."""
    if policy == "vllm-pre":
        return VllmCoordinatorModel(buffered=False)
    if policy == "vllm-21617":
        return VllmCoordinatorModel(buffered=True, min_wait_ms=50.0)
    if policy == "vllm-latest":
        return VllmCoordinatorModel(buffered=True, min_wait_ms=50.0 if mode == "lockstep" else 0.0)
    raise InvalidArgument(f"not a vLLM policy: {policy}")
