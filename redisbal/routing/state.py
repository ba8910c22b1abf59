"""What a router knows, as its policies read it: one ``EngineView`` per engine, the
router's ``RoutingState``, what it was told of the request (``RequestInfo``), and the
``Decision`` it hands back. Data only; ``redisbal.routing.router_core.RouterCore`` keeps them
and ``redisbal.routing.policies`` turns them into a choice."""

from __future__ import annotations

import random
import zlib
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from redisbal.barrier.snapshot import Snapshot
from redisbal.errors import InvalidArgument
from redisbal.routing.cache_view import CacheView


@dataclass(slots=True)
class Decision:
    """One routing decision; pass it back to ``finished()`` when the request ends."""

    engine_id: str
    client_index: int
    seq: int
    version: int  # snapshot version the decision was made on (0: none yet)
    degraded: bool  # made without a fresh snapshot (Redis gone or feed stale)
    pinned: bool = False
    done: bool = False
    probe: bool = False  # sent to a probing engine to see whether it answers (outcomes)
    routed_at: float = 0.0  # the router's clock when it was made
    # the route followed a cache match: the leading blocks of the prompt its engine
    # holds (``RoutingState.cache_view``); 0 when it did not
    cached: int = 0
    # with ``RouterCore.shadow_probes``: the probe owed to a probing engine, a route of
    # its own for a copy of this request (its answer dropped), to be sent, or taken back
    # with ``unroute()``; None when no probe is due
    shadow: Decision | None = None


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """What a router is told about the request it routes (every field optional).

    ``key``: a session or prefix key; requests with one key prefer one engine (its
    prefix cache), within a bound on that engine's load. ``prompt_tokens`` and
    ``output_tokens`` (expected or the request's cap): the request's size, so a
    route counts by its cost instead of as 1. ``blocks``: chained hashes of the
    prompt's token blocks (``redisbal.routing.cache_view.chain_hashes``), for
    prefix-aware policies: the default one matches them with the engines' caches.
    ``key_guessed``: the key was not given as one but taken from the request (the
    gateway's body ``user``); the default policy follows such keys only while they
    come back.
    """

    key: str | None = None
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    blocks: tuple[int, ...] = ()
    key_guessed: bool = False


MAX_KEY_LEN = 1024


def request_info(
    key: str | None,
    prompt_tokens: int | None,
    output_tokens: int | None,
    blocks: Iterable[int] | None,
    key_guessed: bool = False,
) -> RequestInfo:
    """Check what route() was told about a request (ValueError naming the argument)
    and hold it as a RequestInfo."""
    if key is not None and (not isinstance(key, str) or len(key) > MAX_KEY_LEN):
        raise InvalidArgument(
            f"key must be a str of at most {MAX_KEY_LEN} characters, got {key!r:.60}"
        )
    for name, v in (("prompt_tokens", prompt_tokens), ("output_tokens", output_tokens)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise InvalidArgument(f"{name} must be a whole number >= 0, got {v!r}")
    hashes: tuple[int, ...] = ()
    if blocks:
        hashes = tuple(blocks)
        # the ends only: a check of each of a long prompt's hundreds of hashes would cost
        # more than the route (a non-integer between them matches nothing)
        if type(hashes[0]) is not int or type(hashes[-1]) is not int:
            raise InvalidArgument("blocks must be integers (hashes of the prompt's token blocks)")
    if not isinstance(key_guessed, bool):
        raise InvalidArgument(f"key_guessed must be True or False, got {key_guessed!r:.60}")
    return RequestInfo(key, prompt_tokens, output_tokens, hashes, key_guessed)


@dataclass(slots=True, eq=False)
class EngineView:
    """One engine as this router sees it.

    Public (what any policy may read): ``engine_id``; ``waiting``, ``running`` and
    ``kv_usage`` from the latest snapshot; ``age_s``, how old the engine's report
    was when the snapshot was made; this router's own ``routed`` (cumulative),
    ``inflight`` (routed, not finished) and ``pending`` (routed, not yet in the
    snapshot's counts); ``pending_cost``, the pending routes weighed by their
    cost (a route of a typical size counts 1). The other fields are the default
    policy's bookkeeping.
    """

    engine_id: str
    first_seq: int = 1  # this router's first decision on this view (earlier: a former one's)
    waiting: int = 0
    running: int = 0
    kv_usage: float | None = None
    routed: int = 0  # cumulative routes by this router
    routed_before: int = 0  # of those, the ones to earlier incarnations (restarts)
    incarnation: str | None = None  # the engine's reporting process, when it names it
    inflight: int = 0  # routed and not finished
    pending: int = 0  # routed and not yet in the snapshot
    age_s: float = 0.0  # age of the engine's report at the snapshot
    exact: bool = False  # pending reconciled from admitted counts
    times: deque[float] = field(default_factory=deque)  # route times (time-based pending)
    rep_ms: int = -1  # reported_ms of its latest report (time-based pending: by_report)
    rep_at: float = -1e18  # when it was made, on the router's clock
    rep_prev: float = -1e18  # when the one before it was made
    cut: float = -1e18  # routes made by then are in its counts (time-based pending)
    # own routes made by then are in its counts as its admitted total shows (the newest
    # one retired: routing.told_routes.retire), where that is later than ``cut``
    total_cut: float = -1e18
    ends: deque[tuple[float, float]] = field(default_factory=deque)  # (routed, ended) since
    done: int = 0  # of those, the ones its counts hold (estimates.ended)
    costs: deque[float] = field(default_factory=deque)  # cost of each pending route, oldest first
    pending_cost: float = 0.0  # sum of costs
    others: float = 0.0  # the other routers' routes on their way (routing.told_routes), or 0
    admitted: Sequence[int] | None = None  # the snapshot's admitted counts by client index
    gen: int = 0  # heap entry generation
    hid: int = field(default=0, init=False)  # crc32 of engine_id (the shared dither)
    dither: float = 0.0  # this router's offset for the engine, redrawn per snapshot
    # completions since the engine's counts were made (use_age only): expected from its
    # rate with admitted counts, else this router's own ended routes x its share weight
    aged: float = 0.0
    # service-speed estimate from the engine's completions (exact reconciliation only)
    speed: float = 1.0  # relative to the median engine; 1.0 until known
    done_prev: int = -1  # completed requests (sum(admitted) - waiting - running) last time
    t_prev: int = -1  # reported_ms of that report
    run_prev: int = 0  # running count then
    done_acc: float = 0.0  # decayed completions
    exposure_acc: float = 0.0  # decayed running-request-seconds
    cap_ms: int = -1  # reported_ms of its last report seen (estimates.RunningCap)
    cap_adm: int = 0  # its admitted total then
    cap_wait: int = 0  # its waiting count then
    # the running cap the engine declared (redisbal.running_caps), 0 when none: it wins
    # over the one learned from queues (estimates.engine_cap)
    declared_cap: int = 0

    def __post_init__(self) -> None:
        self.hid = zlib.crc32(self.engine_id.encode())


class RoutingState(Protocol):
    """What a policy may read of its router (``RouterCore`` is one).

    ``engines``, the engines to choose from (never empty when ``pick`` is called;
    stalled and suspect ones are left out), and ``client_index`` of
    ``client_count`` API servers; ``share_weight``, 1 / this router's estimated share
    of the traffic; ``pending_weight``, how many routes of all routers one route of
    this one stands for (``share_weight``, or 1 while the other routers tell theirs,
    ``EngineView.others``);
    ``running_cap``, the engines' running cap as far as seen (0 until known:
    ``estimates.RunningCap``; an engine's own declared one wins: ``estimates.engine_cap``);
    the latest ``snapshot``; ``rng``, to be used instead of
    ``random`` so that a seeded router is reproducible; ``request``, what the
    caller said about the request being routed (None when it said nothing);
    ``cache_view``, what the engines hold in their prefix caches as far as this router
    knows (``redisbal.routing.cache_view``; empty until a reader fills it).
    """

    engines: list[EngineView]
    client_index: int
    client_count: int
    share_weight: float
    pending_weight: float
    snapshot: Snapshot | None
    rng: random.Random
    request: RequestInfo | None
    cache_view: CacheView

    @property
    def running_cap(self) -> int: ...
