"""``redisbal engine-sim``: simulated engines in real time, reporting for real.

One process hosts N ``SimEngine`` models (redisbal.sim.model) and drives them on the
wall clock:

- ``lockstep`` mode: all engines step together and a step lasts as long as
  the slowest engine's (MoE / expert parallelism); each engine reports its
  (wave, step) after every step. When every engine is idle the wave ends;
  the next request starts a new wave at step 0, as vLLM's DP engines do.
- ``tick`` mode: every engine steps on its own clock; the reporters use the
  barrier's shared server tick, so the barrier completes without a common step.

Requests that arrive during a step wait in the engine's input queue and are
counted when the next step takes it (as vLLM's busy loop does). By default each
engine also reports right after taking it, before the step runs, as vLLM's
engines do since PR 41626 ("publish request counts before and after GPU step"):
in lockstep mode that report carries the tag of the step about to run, and the
report after the step refreshes it.

Requests come from ``redisbal api`` processes through the simulation
transport (redisbal.sim.transport); completions go back to the API server
that sent them, each with its decode time (from the end of the step that admitted it,
its first token as redisbal.sim.model has it, to its end), from which the API server
derives its TTFT. The runner also measures what the demo prints: requests per
engine, time-averaged load and imbalance, per-burst assignment spread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from redisbal.connection import make_client, redact
from redisbal.errors import InvalidArgument
from redisbal.keys import check_name
from redisbal.ops.table import render_table
from redisbal.reporting.reporter import AsyncReporter, Counts
from redisbal.sim.model import EngineParams, SimEngine, SimRequest
from redisbal.sim.report_as import Feed
from redisbal.sim.transport import NO_BURST, POP_BATCH, DoneMsg, RequestMsg, SimKeys, popped

log = logging.getLogger("redisbal.sim.engine_sim")

MODES = ("lockstep", "tick")


@dataclass
class EngineTally:
    """What one simulated engine did (for the summary)."""

    engine_id: str
    slow: float = 1.0
    assigned: int = 0
    served: int = 0
    load_area: float = 0.0  # integral of (waiting + running) dt
    running_area: float = 0.0
    max_load: int = 0

    def mean_load(self, elapsed: float) -> float:
        return self.load_area / elapsed if elapsed > 0 else 0.0

    def mean_running(self, elapsed: float) -> float:
        return self.running_area / elapsed if elapsed > 0 else 0.0


@dataclass
class SimStats:
    """Whole-run figures of one engine-sim process."""

    mode: str
    engines: dict[str, EngineTally] = field(default_factory=dict)
    elapsed: float = 0.0  # seconds from the first sample to the last
    imbalance_area: float = 0.0  # integral of (max - mean) / mean dt while mean >= 1
    imbalance_time: float = 0.0
    bursts: dict[int, dict[str, int]] = field(default_factory=lambda: defaultdict(dict))
    steps: int = 0
    efficiency_sum: float = 0.0  # sum over busy lockstep steps of mean / max running
    efficiency_steps: int = 0
    last_sample: float | None = None

    def sample(self, engines: Iterable[SimEngine], now: float) -> None:
        """Accumulate time-weighted loads since the previous sample (state held since then)."""
        engs = list(engines)
        prev, self.last_sample = self.last_sample, now
        loads = [e.load for e in engs]
        if prev is not None:
            dt = now - prev
            if dt > 0:
                self.elapsed += dt
                for eng in engs:
                    tally = self.engines[eng.engine_id]
                    tally.load_area += eng.load * dt
                    tally.running_area += len(eng.running) * dt
                mean = sum(loads) / len(loads)
                if mean >= 1:
                    self.imbalance_area += (max(loads) - mean) / mean * dt
                    self.imbalance_time += dt
        for eng, load in zip(engs, loads, strict=True):
            tally = self.engines[eng.engine_id]
            tally.max_load = max(tally.max_load, load)

    @property
    def load_imbalance(self) -> float | None:
        """Time-averaged (max - mean) / mean of engine load, while mean load >= 1."""
        return self.imbalance_area / self.imbalance_time if self.imbalance_time > 0 else None

    @property
    def burst_max_over_mean(self) -> float | None:
        """Per burst, max / mean of requests assigned per engine; averaged over bursts."""
        n = len(self.engines)
        ratios = []
        for counts in self.bursts.values():
            total = sum(counts.values())
            if total and n:
                ratios.append(max(counts.values()) / (total / n))
        return sum(ratios) / len(ratios) if ratios else None

    @property
    def lockstep_efficiency(self) -> float | None:
        """Mean over busy steps of mean running / max running (1.0: even batches)."""
        return self.efficiency_sum / self.efficiency_steps if self.efficiency_steps else None

    def to_dict(self) -> dict[str, Any]:
        el = self.elapsed
        return {
            "mode": self.mode,
            "elapsed_s": round(el, 3),
            "steps": self.steps,
            "load_imbalance": self.load_imbalance,
            "burst_max_over_mean": self.burst_max_over_mean,
            "bursts": len(self.bursts),
            "lockstep_efficiency": self.lockstep_efficiency,
            "engines": [
                {
                    "engine": t.engine_id,
                    "slow": t.slow,
                    "assigned": t.assigned,
                    "served": t.served,
                    "mean_load": round(t.mean_load(el), 3),
                    "max_load": t.max_load,
                    "mean_running": round(t.mean_running(el), 3),
                }
                for t in self.engines.values()
            ],
        }


def engine_ids(count: int, prefix: str = "", first: int = 0) -> list[str]:
    """``prefix + str(first) ... prefix + str(first + count - 1)``, each a checked name."""
    return [check_name(f"{prefix}{first + i}", "engine id") for i in range(count)]


class EngineSimRunner:
    """N simulated engines of one deployment, driven on the wall clock."""

    def __init__(
        self,
        redis_url: str,
        deployment: str,
        ids: list[str],
        *,
        mode: str = "lockstep",
        params: EngineParams | None = None,
        slow: dict[str, float] | None = None,
        num_clients: int = 1,
        poll_s: float = 0.005,
        heartbeat_s: float | None = None,
        report_before_step: bool = True,
        report_as: str = "full",
    ) -> None:
        feed = Feed.of(report_as)
        if mode not in MODES:
            raise InvalidArgument(f"mode must be one of {MODES}, got {mode!r}")
        if not ids:
            raise InvalidArgument("at least one engine id is needed")
        self.url = redis_url
        self.deployment = deployment
        self.mode = mode
        self.poll_s = poll_s
        self.heartbeat_s = heartbeat_s
        # without admitted counts, as vLLM's plugin reports: after the step's admission
        self.report_before_step = report_before_step and feed.admitted
        self.feed = feed  # what the reports carry (redisbal.sim.report_as)
        self.send_admitted = feed.admitted
        self.keys = SimKeys(deployment)
        base = params or EngineParams()
        slow = slow or {}
        unknown = sorted(set(slow) - set(ids))
        if unknown:
            raise InvalidArgument(f"--slow names engines this process does not run: {unknown}")
        self.engines: dict[str, SimEngine] = {}
        self.outbox: dict[str, list[SimRequest]] = {}
        self.stats = SimStats(mode=mode)
        for eid in ids:
            p = EngineParams(
                running_cap=base.running_cap,
                base_step_s=base.base_step_s,
                per_seq_s=base.per_seq_s,
                prefill_s=base.prefill_s,
                slow=base.slow * slow.get(eid, 1.0),
            )
            eng = SimEngine(eid, p, num_clients=num_clients)
            box: list[SimRequest] = []
            eng.on_finish = box.append
            self.engines[eid] = eng
            self.outbox[eid] = box
            self.stats.engines[eid] = EngineTally(eid, slow=p.slow)
        self._req_keys = {eid: self.keys.requests(eid) for eid in ids}
        # when each running request produced its first token (the end of its first step)
        self.first_token: dict[SimRequest, float] = {}
        self._stop = asyncio.Event()
        self._last_pull = float("-inf")
        self.client: Any = None
        self.reporter: AsyncReporter | None = None  # every engine: one call per round

    def stop(self) -> None:
        self._stop.set()

    @property
    def declared_cap(self) -> int | None:
        """The running cap the engines declare (``--report-as`` vllm-plugin, sglang)."""
        if not self.feed.declares_cap:
            return None
        return next(iter(self.engines.values())).params.running_cap

    # -- transport ----------------------------------------------------------------------------

    async def _pull(self, now: float) -> None:
        self._last_pull = now
        pipe = self.client.pipeline(transaction=False)
        for key in self._req_keys.values():
            pipe.lpop(key, POP_BATCH)
        replies = await pipe.execute()
        for eid, reply in zip(self._req_keys, replies, strict=True):
            items = popped(reply)
            if not items:
                continue
            eng, tally = self.engines[eid], self.stats.engines[eid]
            for raw in items:
                try:
                    msg = RequestMsg.decode(raw)
                except ValueError:
                    log.warning("engine %s: dropping malformed request %r", eid, raw[:80])
                    continue
                req = SimRequest(msg.rid, msg.client_index, max(1, msg.output_len), now)
                eng.arrive(req, now)
                tally.assigned += 1
                if msg.burst != NO_BURST:
                    per = self.stats.bursts[msg.burst]
                    per[eid] = per.get(eid, 0) + 1

    async def _flush(self, eids: list[str]) -> None:
        """Send completions of the given engines back to their API servers."""
        pipe = None
        for eid in eids:
            box = self.outbox[eid]
            if not box:
                continue
            if pipe is None:
                pipe = self.client.pipeline(transaction=False)
            by_client: dict[int, list[str]] = defaultdict(list)
            for req in box:
                by_client[req.client_index].append(self.done_msg(req).encode())
            for ci, rids in by_client.items():
                pipe.rpush(self.keys.done(ci), *rids)
            self.stats.engines[eid].served += len(box)
            box.clear()
        if pipe is not None:
            await pipe.execute()

    def _report(self, eid: str, before_step: bool = False) -> None:
        """Queue engine eid's report; ``before_step``: its input queue was just taken
        and the step is about to run (lockstep: tagged with that step's number)."""
        eng = self.engines[eid]
        rep = self.reporter
        assert rep is not None
        w, r = len(eng.waiting), len(eng.running)
        adm = eng.admitted if self.send_admitted else None
        tot = eng.admitted_total if self.feed.total else None
        if self.mode == "lockstep":
            step = eng.step_no + 1 if before_step else eng.step_no
            counts = Counts(step, w, r, eng.wave, admitted=adm, admitted_total=tot)
        else:
            counts = Counts(None, w, r, admitted=adm, admitted_total=tot)
        rep.report_nowait(counts, engine=eid)

    def done_msg(self, req: SimRequest) -> DoneMsg:
        """The completion of a finished request, with its decode time: from its first
        token (the end of the step that admitted it) to its end."""
        first = self.first_token.pop(req, req.finished_at)
        return DoneMsg(req.rid, max(0.0, req.finished_at - first) * 1000.0)

    def end_step(self, eng: SimEngine, end: float) -> None:
        """End eng's step at ``end``: the requests it admitted get their first token then."""
        first = self.first_token
        for req in eng.running:
            if req.produced == 0:
                first[req] = end
        eng.end_step(end)

    # -- loops --------------------------------------------------------------------------------

    async def _sleep_until(self, t: float) -> None:
        delay = t - asyncio.get_running_loop().time()
        if delay > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stop.wait(), delay)

    async def _lockstep(self, end: float | None) -> None:
        loop = asyncio.get_running_loop()
        in_wave = False
        wave = 0
        engines = list(self.engines.values())
        while not self._stop.is_set() and (end is None or loop.time() < end):
            now = loop.time()
            await self._pull(now)
            self.stats.sample(self.engines.values(), now)
            if not any(e.busy() for e in engines):
                in_wave = False  # the wave ended: every engine is idle
                await self._sleep_until(now + self.poll_s)
                continue
            if not in_wave:
                in_wave = True
                wave += 1
                for e in engines:
                    e.wave, e.step_no = wave, 0
            if self.report_before_step:
                for eid, e in self.engines.items():
                    e.take_inbox()
                    self._report(eid, before_step=True)
            # admit at the step's start; requests arriving meanwhile wait for the next step
            duration = max(e.begin_step(now) for e in engines)
            batch = [len(e.running) for e in engines]
            top = max(batch)
            if top > 0:
                self.stats.efficiency_sum += (sum(batch) / len(batch)) / top
                self.stats.efficiency_steps += 1
            self.stats.steps += 1
            self.stats.sample(self.engines.values(), loop.time())
            await self._sleep_until(now + duration)
            if self._stop.is_set():
                break
            t_end = loop.time()
            self.stats.sample(self.engines.values(), t_end)
            for e in engines:
                self.end_step(e, t_end)
            await self._flush(list(self.engines))
            for eid in self.engines:
                self._report(eid)

    async def _independent(self, end: float | None) -> None:
        loop = asyncio.get_running_loop()
        ends: dict[str, float | None] = dict.fromkeys(self.engines)
        while not self._stop.is_set() and (end is None or loop.time() < end):
            now = loop.time()
            if now - self._last_pull >= self.poll_s:
                await self._pull(now)
            self.stats.sample(self.engines.values(), now)
            done = [eid for eid, t in ends.items() if t is not None and t <= now]
            if done:
                for eid in done:
                    self.end_step(self.engines[eid], now)
                    ends[eid] = None
                await self._flush(done)
                for eid in done:
                    self._report(eid)
            for eid, eng in self.engines.items():
                if ends[eid] is None and eng.busy():
                    if self.report_before_step:
                        eng.take_inbox()
                        self._report(eid, before_step=True)
                    ends[eid] = now + eng.begin_step(now)
                    self.stats.steps += 1
            pending = [t for t in ends.values() if t is not None]
            await self._sleep_until(min([*pending, now + self.poll_s]))

    async def run(self, duration_s: float | None = None) -> SimStats:
        """Register, report, serve until stop() or duration_s; leave gracefully at the end."""
        self.client = make_client(self.url, asyncio=True, socket_timeout=5.0)
        try:
            await self.client.delete(*self._req_keys.values())
            rep = self.reporter = AsyncReporter(
                deployment=self.deployment,
                engines=list(self.engines),
                mode=self.mode,
                client=self.client,
                heartbeat_s=self.heartbeat_s,
                running_cap=self.declared_cap,
            )
            await rep.register()
            step = 0 if self.mode == "lockstep" else None
            send, tot = self.send_admitted, self.feed.total
            await rep.report_many(
                {
                    eid: {
                        "step": step,
                        "admitted": e.admitted if send else None,
                        "admitted_total": e.admitted_total if tot else None,
                    }
                    for eid, e in self.engines.items()
                }
            )
            log.info(
                "engine-sim: %d %s engines (%s) of deployment %s on %s",
                len(self.engines),
                self.mode,
                ", ".join(self.engines),
                self.deployment,
                redact(self.url),
            )
            loop = asyncio.get_running_loop()
            end = None if duration_s is None else loop.time() + duration_s
            if self.mode == "lockstep":
                await self._lockstep(end)
            else:
                await self._independent(end)
            self.stats.sample(self.engines.values(), loop.time())
        finally:
            if self.reporter is not None:
                with contextlib.suppress(Exception):
                    await self.reporter.aclose()
            with contextlib.suppress(Exception):
                await self.client.aclose()
        return self.stats


def format_engine_table(stats: dict[str, Any]) -> str:
    """Per-engine summary table from ``SimStats.to_dict()``."""
    rows = [("engine", "assigned", "served", "mean load", "max load", "mean running", "slow")]
    for e in stats["engines"]:
        rows.append(
            (
                e["engine"],
                str(e["assigned"]),
                str(e["served"]),
                f"{e['mean_load']:.1f}",
                str(e["max_load"]),
                f"{e['mean_running']:.1f}",
                f"{e['slow']:g}x",
            )
        )
    return render_table(rows)
