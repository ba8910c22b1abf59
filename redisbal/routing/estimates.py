"""What a router estimates beyond its snapshot (``RouterCore`` keeps one of each).

- Pending: its routes the snapshot does not hold yet. With admitted counts they
  are exact (the core subtracts); without, routes made before the engine's previous
  report (less a transit allowance) are taken to be in its latest (``by_report``).
- Its share of the deployment's traffic (``ShareEstimate``): its pending routes
  stand for all routers' as pending / share (``weight``).
- Each engine's completion rate per running request (``SpeedEstimate``), for the
  speed and age terms of the default policy.
- What a route weighs against recent routes (``RouteCost``), when it gives its size.
- The engines' running cap (``RunningCap``): how many requests an engine runs at once,
  learned from queues; an engine that declared its own cap has that one (``engine_cap``).
- An engine's room (``room``): how many more requests it would run now without
  queueing them, from its running cap and from its own word on its KV cache; and
  whether its KV cache, not its cap, bounds that room (``kv_binds``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from redisbal.barrier.snapshot import Snapshot
from redisbal.routing.state import EngineView, RequestInfo


class ShareEstimate:
    """This router's share of all admitted requests: an EWMA of its part of each
    snapshot's new admissions, weighted by their number (``halflife`` admissions)."""

    def __init__(self, client_count: int, halflife: int) -> None:
        self.halflife = halflife
        self.restart(client_count)

    def restart(self, client_count: int) -> None:
        """Start over at 1 / client_count: the index or the router count changed."""
        self.client_count = client_count
        self.share = 1.0 / client_count
        self.weight = float(client_count)  # 1 / share: what one own pending route stands for
        self.totals: tuple[int, int] | None = None  # (mine, all) admitted at the last update

    def update(self, mine: int, total: int) -> None:
        """Admitted totals, this router's and all routers', of a new snapshot."""
        prev, self.totals = self.totals, (mine, total)
        if prev is None or total < prev[1] or mine < prev[0]:
            return  # first totals, or counts that went back (a restart): measure from here
        d_mine, d_total = mine - prev[0], total - prev[1]
        if d_total <= 0:
            return
        alpha = min(1.0, d_total / self.halflife)
        share = self.share + alpha * (d_mine / d_total - self.share)
        # never trust a share below a tenth of an equal one: bounds the estimate's error
        self.share = min(1.0, max(share, 0.1 / self.client_count))
        self.weight = 1.0 / self.share


def kv_room(running: int, kv_usage: float | None) -> float:
    """How many more requests of the size of those running fit in the free part of
    an engine's KV cache: running x (1 - kv) / kv (inf when it says nothing of its KV
    cache, or holds nothing). What vLLM and SGLang tell of themselves (running, KV
    usage) is the whole input: a KV-bound engine admits by the size of what waits, not
    by a slot count, and the mean size of what it runs is the estimate at hand."""
    if kv_usage is None or kv_usage <= 0.0 or running <= 0:
        return math.inf
    return running * (1.0 - kv_usage) / kv_usage


def engine_cap(e: EngineView, learned: int) -> int:
    """``e``'s running cap: the one it declared (vLLM's ``max_num_seqs``, known from its
    first report on: redisbal.running_caps), else the one ``learned`` from queues
    (``RunningCap``; 0 when unknown). Queues never lower a declared cap: a queue below
    it is KV room's or the prefill budget's doing, which ``kv_room`` and the next step
    account for, and taking it for the cap would make a KV-bound engine's request
    sizes a slot count (docs/DESIGN.md)."""
    return e.declared_cap or learned


# an engine whose KV cache holds fewer requests (of the size of those it runs) than
# this share of its running cap is KV-bound (``kv_binds``)
KV_BOUND_SHARE = 0.5


def kv_binds(e: EngineView, cap: int) -> bool:
    """Whether ``e``'s KV cache, not its running cap, bounds how many requests it runs:
    its cache would hold (its running requests and its ``kv_room``) fewer than
    ``KV_BOUND_SHARE`` of its cap (``engine_cap``; any, when no cap is known). Such an
    engine admits by the size of what waits, and its room in requests is a guess from
    the mean size of what it runs: the router holds no request while any engine is so
    bounded (docs/DESIGN.md, measured). An engine whose cache holds about as many as
    its cap is bounded by its slots within that guess's error: its cap stands."""
    kv = kv_room(e.running, e.kv_usage)
    if kv == math.inf:
        return False
    cap = engine_cap(e, cap)
    return cap <= 0 or e.running + kv < KV_BOUND_SHARE * cap


def room(e: EngineView, cap: int, w: float) -> float:
    """Requests ``e`` would run now without queueing one (negative: that many would
    wait), from its latest counts less what is on its way to it (what it reported
    waiting, the other routers' routes, this router's pending ones weighted ``w``):
    the fewer of its free slots (under ``engine_cap``: its declared cap, else the
    learned ``cap``, 0 when unknown) and of its KV room (``kv_room``). inf when
    neither is known: nothing says the engine is full.

    Plus this router's own requests that its counts hold and that ended since
    (``done``, counted by time where there are no admitted counts: vLLM's plugin, the
    /metrics sidecar): each freed its slot and its KV blocks, and this router saw it
    end before any report could say so. (Unweighted: another router's end is unseen.)"""
    cap = engine_cap(e, cap)
    queued = e.waiting + e.others + e.pending_cost * w
    slots = cap - e.running - queued if cap > 0 else math.inf
    freed = 0 if e.exact else min(e.done, e.running + e.waiting)
    return min(slots, kv_room(e.running, e.kv_usage) - queued) + freed


class RunningCap:
    """The engines' running cap as far as seen (0 until known): the running count of
    an engine whose queue outlived a report (the requests waited through a step that
    had no room for them), at no fewer than any engine ran.

    With admitted counts a queue outlived a report when more wait than the engine
    admitted since its previous one: a report made before a step's admission shows the
    requests just come as waiting, whatever the room. Without them (vLLM's plugin, the
    /metrics sidecar: counts made after the step's admission), when two reports in a
    row show a queue. A queue held back by the prefill budget or KV room is below the
    cap, and so below what another engine ran; one that its KV cache had no room for
    (``kv_room`` below one request) says nothing of the cap: on a KV-bound engine it
    would be a count that the request sizes set."""

    def __init__(self) -> None:
        self.cap = 0
        self.most_running = 0  # the largest running count seen on any engine

    def observe(
        self,
        e: EngineView,
        waiting: int,
        running: int,
        t_ms: int,
        adm: int | None,
        kv_usage: float | None = None,
    ) -> None:
        """A report of ``e`` not seen before (made at ``t_ms``; ``adm`` admitted in all,
        None without admitted counts; ``kv_usage`` its KV cache's)."""
        if running > self.most_running:
            self.most_running = running
        if adm is None:
            outlived = waiting > 0 and e.cap_wait > 0
        else:
            outlived = e.cap_ms >= 0 and adm >= e.cap_adm and waiting > adm - e.cap_adm
        if (
            outlived
            and running > self.cap
            and running >= self.most_running
            and kv_room(running, kv_usage) >= 1.0
        ):
            self.cap = running
        e.cap_ms, e.cap_adm, e.cap_wait = t_ms, adm or 0, waiting


class RouteCost:
    """A route's cost relative to the typical route (1.0 when it gave no size): its
    work (prompt tokens x ``prompt_weight`` + output tokens, 0 of them when not given,
    so that routes without output sizes compare by prompt) over an EWMA of the work
    of recent routes, clamped to 0.1-10."""

    # how much one prompt token weighs against one output token in a route's work:
    # prefill runs many tokens per step, decode one per request per step
    prompt_weight = 0.05

    def __init__(self) -> None:
        self.mean_work = 0.0

    def __call__(self, info: RequestInfo) -> float:
        if info.prompt_tokens is None and info.output_tokens is None:
            return 1.0
        out = info.output_tokens
        work = (info.prompt_tokens or 0) * self.prompt_weight + (out if out is not None else 0)
        mean = self.mean_work
        if mean <= 0.0:
            self.mean_work = max(work, 1e-9)
            return 1.0
        self.mean_work = mean + (work - mean) / 256.0
        return min(10.0, max(0.1, work / mean))


class SpeedEstimate:
    """Each engine's completions and running-request-seconds, decayed (half-life
    ``halflife_s``), from the admitted, waiting and running counts of its reports.

    A rate is trusted from ``min_exposure`` running-request-seconds and ``min_done``
    completions. The decayed completions settle at rate x half-life / ln 2, so the
    least must stay below that at the rates seen: 20 at 3 s left every engine
    finishing under 4.6 requests a second (8 slots of 1-2 s requests) without an
    estimate, and the speed and age terms silently off.
    """

    halflife_s = 5.0
    min_exposure = 10.0
    min_done = 10.0
    band = (0.8, 1.25)  # speeds inside it count as 1.0

    def observe(self, e: EngineView, done: int, t_ms: int, running: int) -> None:
        """Accumulate e's completions since its previous report (at ``t_ms``)."""
        if e.t_prev >= 0 and t_ms > e.t_prev and done >= e.done_prev:
            dt = (t_ms - e.t_prev) / 1000.0
            decay = 0.5 ** (dt / self.halflife_s)
            e.done_acc = e.done_acc * decay + (done - e.done_prev)
            e.exposure_acc = e.exposure_acc * decay + e.run_prev * dt
        elif e.t_prev >= 0 and done < e.done_prev:  # engine restarted: start over
            e.done_acc = e.exposure_acc = 0.0
        if t_ms >= e.t_prev:
            e.t_prev, e.done_prev, e.run_prev = t_ms, done, running

    def rates(self, engines: Sequence[EngineView]) -> dict[str, float]:
        """Completion rate per running request of the engines observed long enough."""
        lo_exp, lo_done = self.min_exposure, self.min_done
        return {
            e.engine_id: e.done_acc / e.exposure_acc
            for e in engines
            if e.exposure_acc >= lo_exp and e.done_acc >= lo_done
        }

    def update_speeds(self, engines: Sequence[EngineView]) -> None:
        """speed = rate / the median engine's, clamped to [0.25, 4]; 1.0 inside the
        band or without enough observations (or fewer than 3 engines known)."""
        rates = self.rates(engines)
        if len(rates) < 3:
            for e in engines:
                e.speed = 1.0
            return
        mid = sorted(rates.values())[len(rates) // 2]
        lo, hi = self.band
        for e in engines:
            r = rates.get(e.engine_id)
            sp = 1.0 if r is None or mid <= 0 else min(4.0, max(0.25, r / mid))
            e.speed = 1.0 if lo < sp < hi else sp

    def update_aged(self, engines: Sequence[EngineView], snap: Snapshot) -> None:
        """Expected completions on each engine since its report (``aged``): of its
        ``running`` requests, each ending at its rate r (the median engine's until
        known), running x (1 - exp(-r x age)) ended within the report's age. About
        running x r x age for a fresh report; never more than running for an old one
        (linear, a report seconds old made a busy engine look emptier than idle)."""
        rates = self.rates(engines)
        mid = sorted(rates.values())[len(rates) // 2] if rates else 0.0
        for e in engines:  # (0 for an engine the snapshot holds no report of)
            if not e.exact:  # counted from its ends instead (ended)
                continue
            if e.running and e.engine_id in snap.engines:
                e.aged = -e.running * math.expm1(-rates.get(e.engine_id, mid) * e.age_s)
            else:
                e.aged = 0.0


# How long a route stays counted on its way, past the time rule, to an engine whose
# admitted total retires routes (RouterCore._by_totals): the total says when the engine
# took it. vLLM's API server hands a request to its engine core a step or more after it
# arrives on a busy host; retired by time alone, such a route left the count before the
# engine's, and a held request went ahead early. Past this, time retires it anyway (an
# aborted request never reaches vLLM's finished count, so the total may drift).
HANDOVER_S = 1.0


def by_report(
    e: EngineView,
    reported_ms: int,
    at: float,
    transit_s: float,
    weight: float,
    handover_s: float = 0.0,
) -> None:
    """Reconcile e's pending routes by the time of its report (its counts made at
    ``reported_ms``, ``at`` on the router's clock). An engine takes the requests that
    reach it during a step only when the next one begins (vLLM's input queue;
    engine-sim's ``inbox``), so a report made after a step holds the requests that
    came before the step began, the time of the engine's previous report, and not
    those that came during it: those stay pending until the next report. (Taking the
    report's own time lost them: on a slow engine, a step's worth of routes.) Routes
    made within ``handover_s`` before that stay too (``HANDOVER_S``: the admitted total
    retires them). Then count the routes it holds that ended since (``ended``), each
    ``weight`` in ``aged``."""
    if reported_ms != e.rep_ms:
        e.rep_prev, e.rep_ms, e.rep_at = e.rep_at, reported_ms, at
    e.cut = cut = min(at, e.rep_prev) - transit_s - handover_s
    by_time(e, cut)
    if e.ends:
        made = at + transit_s  # (an end seen within the transit may precede the counts)
        ends = e.ends
        while ends and ends[0][1] <= made:
            ends.popleft()
        e.done = ended_held(e)
    e.aged = held_ended(e, weight)


def ended_held(e: EngineView) -> int:
    """Of e's routes that ended since its counts were made (``e.ends``), the ones its
    counts hold: made by its cut, or retired by its admitted total (``total_cut``)."""
    cut = max(e.cut, e.total_cut)
    return sum(1 for routed, _ in e.ends if routed <= cut)


def ended(e: EngineView, routed_at: float, now: float, transit_s: float, weight: float) -> None:
    """A request routed to e at ``routed_at`` ended ``now`` (reconciled by time): its
    route, if pending, will never be counted, and if e's counts hold it, they
    overstate e's load by it from now on (``done``). What requests got, not a model:
    the default policy subtracts ``done`` x ``weight``, the share weight (1 / share:
    the other routers' requests end unseen, told routes or not), as the completions
    since the counts were made (``EngineView.aged``)."""
    if routed_at > e.cut:
        try:
            e.times.remove(routed_at)
        except ValueError:  # retired by the admitted total: the counts hold it
            if routed_at <= e.total_cut and now > e.rep_at + transit_s:
                e.done += 1
        else:
            e.pending = len(e.times)
            trim_costs(e)
    elif now > e.rep_at + transit_s:
        e.done += 1
    e.aged = held_ended(e, weight)
    e.ends.append((routed_at, now))
    if len(e.ends) > MAX_ENDS:  # no report for long: the oldest cannot count any more
        e.ends.popleft()


def held_ended(e: EngineView, weight: float) -> float:
    """``aged`` counted: the requests e's counts hold that ended since, ``done`` x
    ``weight`` (everyone's, by this router's), at most what the counts hold (running +
    waiting): through an outage, with no new counts, every request they held ends and
    the weight would take off more than there is."""
    return min(e.done * weight, float(e.running + e.waiting))


# ends kept per engine between its reports (far more than it finishes in one)
MAX_ENDS = 4096


def by_time(e: EngineView, cutoff: float) -> None:
    """Reconcile e's pending routes by time: the ones made at or before ``cutoff`` (the
    report's time less the transit allowance) are taken to be in its counts."""
    times = e.times
    while times and times[0] <= cutoff:
        times.popleft()
    e.pending = len(times)
    e.exact = False
    trim_costs(e)


def no_report(e: EngineView) -> None:
    """An engine the snapshot holds no report of (kept or carried): nothing says which
    of its routes it has taken, but the finished ones are no load any more."""
    e.ends.clear()
    e.done, e.aged = 0, 0.0
    if e.pending > e.inflight:
        e.pending = e.inflight
        while len(e.times) > e.inflight:
            e.times.popleft()
        trim_costs(e)


def trim_costs(e: EngineView) -> None:
    """Keep the costs of the ``pending`` newest routes (the engine takes requests in
    the order they reach it, so the oldest are the ones the snapshot counted)."""
    costs = e.costs
    if len(costs) > e.pending:
        while len(costs) > e.pending:
            costs.popleft()
        e.pending_cost = sum(costs)
    elif not costs:
        e.pending_cost = 0.0
