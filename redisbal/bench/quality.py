"""The quality benchmark's simulator: what users of an LLM service feel (TTFT,
latency, goodput, prefix-cache hits) under each routing policy, on a SIMULATED
clock (discrete-event; deterministic per seed; no Redis).

What is real: the routing code (one ``RouterCore`` per API server with the
policy under test, told what a gateway knows: the request's key, prompt tokens
and prompt block hashes; its output length only with ``pass_output``), the
engine model (``redisbal.sim.model``: prefix cache, KV budget, prefill cost),
the vLLM coordinator's publish loop for the vllm-* baselines (as in
``redisbal.bench.scale``). What is modelled: time and the transport.
- Independent engines step at their own pace and report after every step (and,
  but for the pre-41626 vLLM baselines and without admitted counts, right before
  it); the barrier publishes
  every engine's latest counts (waiting, running, kv_usage, and what the feed
  carries: ``report_as``) every ``tick_s``. Lockstep engines publish after every
  step (which lasts as long as the slowest engine's).
- The feed is one of engine-sim's ``--report-as`` forms (``redisbal.sim.report_as``):
  admitted counts per router (``full``), or an admitted total the routers reconcile
  their routes by (``RouterCore``'s ``TotalReconciler``), the running cap declared to
  every router from the start or learned from queues; or ``load-only``, neither.
- A snapshot reaches each router ``delivery_ms`` plus a per-router jitter after
  it is made; a request reaches its engine ``transit_ms`` after it is routed.
- Up to ``MAX_ROUTERS`` routers tell each other their routes as the gateways do
  (``redisbal.routing.told_routes``): ``COALESCE_S`` after a change and every
  ``TELL_EVERY_S``, each message reaching the others ``delivery_ms`` plus jitter later.
- The peers (``redisbal.bench.peer_policies``) get the same snapshots as ``redisbal``: an
  assumption in their favour (their own systems gather less, or later); their
  prefix indexes are sized for the simulated engine's cache.
- A policy that holds requests (``Policy.holds``) holds them at the router while it
  sees no free slot (``routing.admission``), at most ``hold_s``; a router holding
  requests applies each snapshot as it comes, and routes them as slots free.
- A router applies the newest snapshot it has received when it next routes,
  with its clock set to when that snapshot arrived (the simulator's saving: a
  router that routes nothing in between skips the snapshots in between). The
  result is the same for every policy whose view after a snapshot depends on
  that snapshot and its own routes; ``RouterCore``'s share and speed estimates,
  which work on deltas between the snapshots applied, smooth over fewer of them.
"""

from __future__ import annotations

import heapq
import math
import random
import time
from typing import Any

from redisbal.barrier.snapshot import EngineCounts, Snapshot
from redisbal.bench.balance import burst_max_over_mean, load_imbalance, makespan, percentile
from redisbal.bench.latency import (
    goodput,
    hit_rate,
    lockstep_efficiency_sum,
    ttft_percentiles,
    waits,
)
from redisbal.bench.oracle import OraclePolicy, World
from redisbal.bench.peer_policies import PEER_POLICIES, make_peer
from redisbal.bench.scale import _snapshot
from redisbal.bench.traffic import (
    QUALITY_ENGINE,
    QualityScenario,
    build_workload,
    client_rng,
    engine_params,
    warm_batch,
)
from redisbal.bench.vllm import (
    VLLM_POLICIES,
    EngineStat,
    VllmCoordinatorModel,
    reports_before_step,
    vllm_model_for,
)
from redisbal.errors import InvalidArgument
from redisbal.routing.admission import (
    DEFAULT_MAX_S,
    ahead_of,
    free_slots,
    releasable,
    release_delay,
)
from redisbal.routing.cache_view import LEARNED_TOKENS, learned_anchors
from redisbal.routing.policies import DEFAULT_POLICY, POLICIES, Policy, RedisbalPolicy
from redisbal.routing.router_core import RouterCore
from redisbal.routing.told_routes import COALESCE_S, TELL_EVERY_S, telling
from redisbal.sim.model import SimEngine, SimRequest
from redisbal.sim.report_as import Feed
from redisbal.sim.workload import Request

# the library's policies, the default last among them, then the oracle
BASE_POLICIES = (
    *(p for p in POLICIES if p != DEFAULT_POLICY),
    DEFAULT_POLICY,
    "oracle",
)


# The default policy with one option flipped: what each option is worth on the same
# traffic. Run only when named (--policies), not part of "every policy".
VARIANTS: dict[str, dict[str, Any]] = {
    "redisbal-age": {"use_age": False},
    "redisbal+speed": {"use_speed": True},
    "redisbal+p2c": {"p2c_from": 16},
    "redisbal+sed": {"use_sed": True},
    "redisbal-dither": {"use_dither": False},
    "redisbal+slots": {"use_slots": True},
    "redisbal-share": {"use_share": False},
    "redisbal+sed-dither": {"use_sed": True, "use_dither": False},
    "redisbal+cost": {"use_cost": True},
    "redisbal-kvload": {"use_kv_load": False},  # running requests counted 1 each, always
    "redisbal-kvqueue": {"use_kv_queue": False},  # a queueing engine by its running KV
    "redisbal-room": {"affinity_room": False},
    "redisbal-dither1": {"dither_gain": 0.0},  # the dither's amplitude stays 1, never a lump
    "redisbal-repeats": {"follow_guessed": True},  # guessed keys followed as given ones
    "redisbal-hold": {"holds": False},  # every request routed at once, as before holding
    "redisbal-stand": {"stand_s": None},  # never a request past the cap while holding
    "redisbal+ahead": {"stand_s": 0.0},  # one past the cap whenever anything is held
    "redisbal-keyslack": {"keyed_cache_slack": None},  # an unfollowed key's holder: cache_slack
    # the cache views read but weighing nothing: a holder takes a request only as the
    # least-loaded engine would (the views' pipeline runs, placement is by load)
    "redisbal-views": {"cache_slack": 0.0, "keyed_cache_slack": 0.0, "affinity_room": False},
}


# the default learning each engine's cache from its own routes, as the gateway with
# --prefix-tokens text and no KV events (requests carry their prompts' blocks)
ROUTES_VIEW = "redisbal+routes"


def available_policies() -> list[str]:
    """Every policy the benchmark compares: the baselines, redisbal, the oracle, the peer
    routers."""
    return [*BASE_POLICIES, *(p for p in PEER_POLICIES if p not in BASE_POLICIES)]


def _policy(name: str, world: World, kv_blocks: int = QUALITY_ENGINE.cache_blocks) -> str | Policy:
    if name == "oracle":
        return OraclePolicy(world)
    if name in POLICIES:
        return name
    if name == ROUTES_VIEW:
        return "redisbal"
    if name in VARIANTS:
        policy = RedisbalPolicy()
        for option, value in VARIANTS[name].items():
            setattr(policy, option, value)
        return policy
    if name in PEER_POLICIES:  # prefix indexes sized for the simulated engine's KV cache
        return make_peer(name, kv_blocks=kv_blocks)
    raise InvalidArgument(f"unknown policy {name!r}; choose from {', '.join(available_policies())}")


ARRIVE, DELIVER, ESTEP, TICK, STEP, STATS, SNAP, SAMPLE, TELL, HEAR, RELEASE, EXPIRE = range(12)


def simulate(
    policy: str,
    seed: int,
    sc: QualityScenario,
    *,
    workload: list[Request] | None = None,
    pass_output: bool = False,
    keys_guessed: bool = False,
    report_as: str = "full",
    delivery_ms: float = 1.0,
    jitter_ms: float = 2.0,
    transit_ms: float = 1.0,
    sample_s: float = 0.05,
    vllm_transport: bool = True,
    hold_s: float = DEFAULT_MAX_S,
) -> dict[str, float]:
    """One run; returns the metrics (``redisbal.bench.latency``) and the run's own
    cost (``sim_wall_s``). ``keys_guessed``: the requests' keys are guessed (as the
    gateway takes the body's ``user``: ``RouterCore.route``), not given.
    ``report_as``: what the engines feed the routers, as engine-sim's ``--report-as``
    (``redisbal.sim.report_as``): without admitted counts routers reconcile their routes
    by the admitted total where it is sent, else by time; a declared running cap every
    router knows from the start.
    ``vllm_transport=False``: the vLLM baselines read redisbal's snapshots, as they do
    behind the real-time gateways, instead of vLLM's own publish loop."""
    wall = time.perf_counter()
    feed = Feed.of(report_as)
    work = build_workload(sc, seed) if workload is None else workload
    rng = random.Random(f"quality-{sc.name}-{seed}")
    ids = [f"e{i:04d}" for i in range(sc.engines)]
    world = World()
    clock = [0.0]
    routers: list[RouterCore] = []
    followers: dict[int, list[int]] = {}
    for k, r in enumerate(work):
        if r.after >= 0:
            followers.setdefault(r.after, []).append(k)
    events: list[tuple[float, int, int, Any]] = []
    seq = 0

    def push(t: float, kind: int, data: Any) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, data))

    def finish(req: SimRequest) -> None:
        if req.decision is None:  # a request of the warm start
            return
        routers[req.client_index].finished(req.decision)  # type: ignore[arg-type]
        for k in followers.get(req.rid, ()):
            push(req.finished_at + work[k].t, ARRIVE, k)

    for k, eid in enumerate(ids):
        e = SimEngine(eid, engine_params(sc, k), num_clients=sc.clients, on_finish=finish)
        world.engines[eid] = e
        world.transit[eid] = 0
        for prompt, output, produced in warm_batch(sc, seed, k) if sc.warm else ():
            wq = SimRequest(-1, 0, output, 0.0, prompt_tokens=prompt, produced=produced)
            wq.started_at = wq.first_token_at = 0.0
            e.running.append(wq)
            e.hold_kv(wq)
    for i in range(sc.clients):
        core = RouterCore(
            i,
            sc.clients,
            _policy(policy, world, sc.engine.cache_blocks),
            rng=client_rng(seed, i),
            clock=lambda: clock[0],
            learn_routes=learned_anchors(LEARNED_TOKENS) if policy == ROUTES_VIEW else 0,
        )
        core.connected = True
        core.set_engines(ids)
        if feed.declares_cap:  # (redisbal.running_caps)
            core.set_declared_caps({eid: world.engines[eid].params.running_cap for eid in ids})
        if telling(sc.clients):
            core.told_routes.on_change = lambda i=i: push(clock[0] + COALESCE_S, TELL, (i, False))
            push(rng.random() * TELL_EVERY_S, TELL, (i, True))  # heartbeats, spread
        routers.append(core)
    inbox: list[tuple[float, Snapshot] | None] = [None] * sc.clients
    vmodel: VllmCoordinatorModel | None = (
        vllm_model_for(policy, sc.mode) if vllm_transport and policy in VLLM_POLICIES else None
    )
    if vmodel is not None:
        for eid in ids:
            vmodel.counts[eid] = EngineStat(0, 0, 0, 0.0)
    # engines without admitted counts report as vLLM's plugin and the sidecar do: the
    # counts after a step's admission, never the input queue just taken as waiting
    before_step = reports_before_step(policy) and feed.admitted
    independent = sc.mode != "lockstep"
    for k, r in enumerate(work):
        if r.after < 0:
            push(r.t, ARRIVE, k)
    push(0.0, TICK if independent else STEP, None)
    stepping = not independent
    push(0.0, SAMPLE, None)
    last_open = max((r.t for r in work if r.after < 0), default=0.0)
    end_by = max(last_open, sc.duration_s) + sc.drain_s
    reqs: list[SimRequest | None] = [None] * len(work)
    estepping = dict.fromkeys(ids, False)
    for eid in ids:
        if independent and world.engines[eid].busy():
            estepping[eid] = True
            push(0.0, ESTEP, (eid, None))
    latest: dict[str, EngineCounts] = {}
    last_counts: dict[str, tuple[int, int]] = {}
    version = 0
    pushes = [0]
    step_rows: list[list[float]] = []
    times: list[float] = []
    loads: list[list[float]] = []

    def counts(e: SimEngine, step: int, t: float) -> EngineCounts:
        adm = tuple(e.admitted) if feed.admitted else None
        tot = e.admitted_total if feed.total else None
        w, r, kv, ms = len(e.waiting), len(e.running), e.kv_usage, int(t * 1000)
        return EngineCounts(w, r, kv, 0, step, ms, adm, admitted_total=tot)

    def deliver_all(t: float, snap: Snapshot) -> None:
        for i in range(sc.clients):
            push(t + (delivery_ms + rng.random() * jitter_ms) / 1000, SNAP, (i, snap))

    def stats_on_change(t: float, e: SimEngine, score: int) -> None:
        wr = (len(e.waiting), len(e.running))
        if last_counts.get(e.engine_id) != wr:
            last_counts[e.engine_id] = wr
            push(t + rng.random() * jitter_ms / 1000, STATS, (e.engine_id, score, wr))

    def vllm_push(at_ms: float, cs: dict[str, EngineStat]) -> None:
        engines = {
            e: EngineCounts(c.waiting, c.running, None, 0, c.score, int(c.t_ms), None)
            for e, c in cs.items()
        }
        pushes[0] += 1
        deliver_all(at_ms / 1000, _snapshot(pushes[0], engines, at_ms))

    def report(e: SimEngine, t: float) -> None:
        tick = int(t / sc.tick_s)
        latest[e.engine_id] = counts(e, tick, t)
        if vmodel is not None:
            stats_on_change(t, e, tick)

    def barrier(engines: list[SimEngine], t: float) -> None:
        nonlocal version
        version += 1
        snap = _snapshot(version, {e.engine_id: counts(e, version, t) for e in engines}, t * 1000)
        deliver_all(t, snap)

    # requests each router holds (request -> when it came), first in first out
    held: list[dict[int, float]] = [{} for _ in range(sc.clients)]

    def dispatch(i: int, k: int, came: float) -> None:
        r = work[k]
        d = routers[i].route(
            key=r.key,
            prompt_tokens=r.prompt_tokens,
            output_tokens=r.output_tokens if pass_output else None,
            blocks=r.blocks,
            key_guessed=keys_guessed,
        )
        req = SimRequest(
            k,
            i,
            r.output_tokens,
            came,  # (TTFT counts from the request's coming, held or not)
            decision=d,
            engine_id=d.engine_id,
            group=r.group,
            prompt_tokens=r.prompt_tokens,
            blocks=r.blocks,
            done_blocks=r.done_blocks,
        )
        reqs[k] = req
        world.transit[d.engine_id] += 1
        push(clock[0] + transit_ms / 1000, DELIVER, req)

    def release(i: int) -> None:
        """Route what router i holds into the free slots it may take (Admission.release)."""
        q = held[i]
        wait = clock[0] - next(iter(q.values())) if q else None
        free = free_slots(routers[i], ahead=ahead_of(routers[i], wait))
        n = len(q) if free is None else releasable(routers[i], free)
        for k in list(q)[:n]:
            dispatch(i, k, q.pop(k))

    for i, core in enumerate(routers):
        if core.policy.holds:
            core.on_update = lambda i=i: (
                push(clock[0] + release_delay(routers[i]), RELEASE, i) if held[i] else None
            )

    now = 0.0
    while events:
        t, _, kind, data = heapq.heappop(events)
        if t > end_by:
            break
        now = clock[0] = t
        if kind == ARRIVE:
            i = work[data].client
            got = inbox[i]
            if got is not None:
                inbox[i] = None
                clock[0] = got[0]
                routers[i].apply_snapshot(got[1])
                clock[0] = t
            if routers[i].policy.holds and (held[i] or free_slots(routers[i]) == 0):
                held[i][data] = t  # (routing.admission): until a slot frees, or max_s
                push(t + hold_s, EXPIRE, (i, data))
            else:
                dispatch(i, data, t)
        elif kind == DELIVER:
            eid = data.engine_id
            world.transit[eid] -= 1
            world.engines[eid].arrive(data, t)
            if independent:
                if not estepping[eid]:
                    estepping[eid] = True
                    push(t, ESTEP, (eid, None))
            elif not stepping:
                stepping = True
                push(t, STEP, None)
        elif kind == ESTEP:
            eid, began = data
            e = world.engines[eid]
            if began is not None:
                e.end_step(t)
                report(e, t)
            if not e.busy():
                estepping[eid] = False
                continue
            if before_step:
                e.take_inbox()
                report(e, t)
            push(t + e.begin_step(t), ESTEP, (eid, t))
        elif kind == TICK:
            push(t + sc.tick_s, TICK, None)
            if vmodel is None and latest:
                version += 1
                engines_now = {
                    eid: latest.get(eid) or counts(world.engines[eid], 0, 0.0) for eid in ids
                }
                deliver_all(t, _snapshot(version, engines_now, t * 1000))
        elif kind == STEP:
            engines = [world.engines[e] for e in ids]
            if data is not None:
                for e in engines:
                    e.end_step(t)
                busy = any(e.busy() for e in engines)
                if vmodel is None:
                    if not (before_step and busy):
                        barrier(engines, t)
                else:
                    version += 1
                    for e in engines:
                        stats_on_change(t, e, version)
            else:
                busy = any(e.busy() for e in engines)
            if not busy:
                stepping = False
                continue
            if before_step:
                for e in engines:
                    e.take_inbox()
                if vmodel is None:
                    barrier(engines, t)
                else:
                    for e in engines:
                        stats_on_change(t, e, version + 1)
            dur = max(e.begin_step(t) for e in engines)
            step_rows.append([float(len(e.running)) for e in engines])
            push(t + dur, STEP, t)
        elif kind == STATS:
            eid, ver, (w, rn) = data
            assert vmodel is not None
            for at, cs in vmodel.on_stats(t * 1000, eid, ver, w, rn):
                vllm_push(at, cs)
        elif kind == SNAP:
            i, snap = data
            last = inbox[i]
            if last is None or snap.version > last[1].version:
                inbox[i] = (t, snap)
            if held[i] and (got := inbox[i]) is not None:  # holding: adopt it now
                inbox[i] = None
                routers[i].apply_snapshot(got[1])
        elif kind == TELL:  # (only pushed while telling)
            i, beat = data
            told = routers[i].told()
            for j in range(sc.clients):
                if j != i:
                    push(t + (delivery_ms + rng.random() * jitter_ms) / 1000, HEAR, (j, told))
            if beat:
                push(t + TELL_EVERY_S, TELL, (i, True))
        elif kind == HEAR:
            routers[data[0]].hear(data[1])
        elif kind == RELEASE:
            release(data)
        elif kind == EXPIRE:
            i, k = data
            if k in held[i]:
                dispatch(i, k, held[i].pop(k))
        elif kind == SAMPLE:
            times.append(t)
            loads.append([float(world.engines[e].load) for e in ids])
            push(t + sample_s, SAMPLE, None)
            if vmodel is not None:
                for at, cs in vmodel.advance(t * 1000):
                    vllm_push(at, cs)
    end = end_by if events else now
    return _metrics(sc, work, reqs, end, step_rows, times, loads) | {
        "sim_wall_s": time.perf_counter() - wall
    }


def _metrics(
    sc: QualityScenario,
    work: list[Request],
    reqs: list[SimRequest | None],
    end: float,
    step_rows: list[list[float]],
    times: list[float],
    loads: list[list[float]],
) -> dict[str, float]:
    window_end = max(sc.duration_s, max((r.t for r in work if r.after < 0), default=0.0))
    measured = [r for r in reqs if r is not None and sc.warmup_s <= r.routed_at <= window_end]
    routed = [r.routed_at for r in measured]
    ttft = waits(routed, [r.first_token_at for r in measured], end)
    e2e = waits(routed, [r.finished_at for r in measured], end)
    p50, p99 = ttft_percentiles(ttft)
    started = [r for r in measured if r.started_at >= 0]
    spans: dict[int, tuple[float, float]] = {}
    per_burst: dict[int, dict[str, int]] = {}
    for r in measured:
        lo, hi = spans.get(r.group, (math.inf, -math.inf))
        spans[r.group] = (
            min(lo, r.routed_at),
            max(hi, r.finished_at if r.finished_at >= 0 else end),
        )
        per_burst.setdefault(r.group, {})
        per_burst[r.group][r.engine_id] = per_burst[r.group].get(r.engine_id, 0) + 1
    out = {
        "ttft_p50_s": p50,
        "ttft_p99_s": p99,
        "e2e_p99_s": percentile(e2e, 99),
        "goodput_rps": goodput(ttft, sc.slo_ttft_s, max(1e-9, window_end - sc.warmup_s)),
        "prefix_hit_rate": hit_rate(
            sum(r.cached_tokens for r in started), sum(r.prompt_tokens for r in started)
        ),
        "load_imbalance": load_imbalance(times, loads),
        "requests": float(len(measured)),
        "unfinished": float(sum(1 for r in measured if r.finished_at < 0)),
    }
    if sc.mode == "lockstep":
        out["lockstep_efficiency"] = lockstep_efficiency_sum(step_rows)
    if sc.traffic == "burst":
        out["makespan_s"] = makespan(list(spans.values()))
        out["burst_max_over_mean"] = burst_max_over_mean(
            [
                [c.get(e, 0) for e in (f"e{i:04d}" for i in range(sc.engines))]
                for c in per_burst.values()
            ]
        )
    return out
