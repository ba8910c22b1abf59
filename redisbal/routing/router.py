"""API-server side: keep the latest snapshot and route every request locally.

The feed subscribes to the deployment's snapshot channel and GETs the stored
snapshot after every (re)subscribe and every ``poll_s`` (pub/sub drops
messages across disconnects). Older versions within an epoch are ignored; a
new epoch is adopted whatever its version. ``route()`` only touches local
state (``RouterCore``): it never waits on Redis, and with Redis gone it keeps
routing and flags its decisions ``degraded``. After an epoch change it also keeps
routing to the engines it knew until they re-register
(``redisbal.routing.adoption.Carrying``).

``AsyncRouter`` runs the feed as an asyncio task. ``Router`` is its blocking
twin: the same object, run on a private event loop in a daemon thread
(``redisbal.background``), as ``Reporter`` runs ``AsyncReporter``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
from collections.abc import Awaitable, Callable, Iterable
from functools import partial
from typing import TYPE_CHECKING, Any, cast

import redis.exceptions

from redisbal.errors import InvalidArgument, InvalidState, MalformedData

if TYPE_CHECKING:
    from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster

from redisbal.background import BackgroundLoop, cancel_and_wait
from redisbal.barrier.operations import Scripts, suspect_reason
from redisbal.barrier.snapshot import Rosters, RosterUnknown, Snapshot
from redisbal.connection import OUTAGE_ERRORS, AsyncRedisClient, is_cluster, make_client, redact
from redisbal.keys import DeploymentKeys, check_name
from redisbal.routing.admission import Admission
from redisbal.routing.cache_view import CacheView
from redisbal.routing.lease import ClientLease
from redisbal.routing.outcomes import FAILURES, OUTCOMES, OutcomeTracker
from redisbal.routing.policies import DEFAULT_POLICY, Policy
from redisbal.routing.router_core import RouterCore
from redisbal.routing.routes_channel import RoutesChannel
from redisbal.routing.state import Decision
from redisbal.running_caps import fetch as fetch_caps

log = logging.getLogger("redisbal.routing.router")
# a reader of the engines' cache views from Redis: (client, keys, view, cursor) ->
# the next cursor; it brings ``view`` up to date (all of it on a None cursor or after
# a gap, else only what changed since ``cursor``)
CacheSync = Callable[[AsyncRedisClient, DeploymentKeys, CacheView, Any], Awaitable[Any]]
FEED_ERRORS: tuple[type[Exception], ...] = (*OUTAGE_ERRORS, redis.exceptions.ResponseError)
CAPS_REFRESH_S = 5.0  # the declared running caps are read again this often (_read_caps)


class _LocalRouting:
    """The routing surface both routers share: pure calls on local state (``core``)."""

    core: RouterCore

    @property
    def snapshot(self) -> Snapshot | None:
        """The latest adopted snapshot, or None before the first."""
        return self.core.snapshot

    @property
    def degraded(self) -> bool:
        """True when routing without a fresh snapshot (none yet, stale, or feed down)."""
        return self.core.degraded

    @property
    def client_index(self) -> int:
        return self.core.client_index

    def route(
        self,
        engine_id: str | None = None,
        *,
        key: str | None = None,
        prompt_tokens: int | None = None,
        output_tokens: int | None = None,
        blocks: Iterable[int] | None = None,
        key_guessed: bool = False,
    ) -> Decision:
        """Choose an engine (or pin ``engine_id``) for one request. Never does I/O.

        ``key``: a session or prefix key; requests with one key go to one engine
        while its load stays within a bound (its prefix cache keeps their prompts).
        ``key_guessed``: the key was taken from the request (a user id, say), not
        given as one: the default policy follows such keys only while they come back.
        ``prompt_tokens`` / ``output_tokens`` (expected, or the request's cap): the
        route counts by the request's size. ``blocks``: the prompt's leading block
        hashes (``redisbal.routing.cache_view.chain_hashes`` of its token ids): the
        default policy matches them with what the engines cache (``cache_sync``)."""
        return self.core.route(
            engine_id,
            key=key,
            prompt_tokens=prompt_tokens,
            output_tokens=output_tokens,
            blocks=blocks,
            key_guessed=key_guessed,
        )

    def finished(self, decision: Decision) -> None:
        """Tell the router the request of ``decision`` ended."""
        self.core.finished(decision)

    def failed(self, decision: Decision, reason: str = "", kind: str = "error") -> bool:
        """The engine of ``decision`` did not serve it: the request ends (no
        ``finished()`` needed; route it again to retry). ``kind`` says what happened
        (``redisbal.routing.outcomes.FAILURES``: connect, reset, 5xx, 429,
        first_byte_timeout, idle_timeout, timeout, error). This router ejects the
        engine at once with a back-off that grows while it keeps failing, and tells
        the deployment (never waiting on Redis), so that every router stops choosing
        it within one snapshot. When the back-off ends the engine gets one request
        at a time (``Decision.probe``) until one is answered (``answered()``); its own
        reports never clear it. At most half of the engines are ejected. ``reason``
        (what the caller saw) shows in ``redisbal status``; control characters are
        replaced and it is cut to 200 characters. Returns whether this ejected it."""
        if not isinstance(reason, str):
            raise TypeError(f"reason must be a str, got {type(reason).__name__}")
        if kind not in FAILURES:
            raise InvalidArgument(
                f"kind must be one of {', '.join(sorted(FAILURES))}, got {kind!r}"
            )
        if not self.core.failed(decision, kind):
            return False
        why = self.core.evidence(decision.engine_id)  # e.g. "5xx x12 in 2.0s"
        text = f"{why} ({reason})" if why and reason else why or reason or kind
        self._tell("suspect", decision.engine_id, suspect_reason(text))
        return True

    def stalled(self, decision: Decision, reason: str = "") -> bool:
        """The stream of ``decision`` stopped mid-way while the engine's reports look
        fine: its streams under way went silent far beyond its usual gap between chunks
        while other engines' streams flowed (``redisbal.routing.stream_gaps.StreamGaps``
        says when). Evidence of kind ``stall`` against the engine, ejected and told to
        the deployment as by ``failed()``; but the request goes on: end it as usual
        (``finished()``, or ``failed(kind="idle_timeout")`` when its stream times out).
        The engine is probed when its back-off ends, one probe at a time: a probe whose
        stream is named stalled stays the one in flight until it ends; only a probe
        whose stream flows to its end clears it (``answered()`` then; ``unproven()``
        for one that ended within the chunks its streams got before they stalled).
        Returns whether this ejected it."""
        if not isinstance(reason, str):
            raise TypeError(f"reason must be a str, got {type(reason).__name__}")
        if not self.core.stalled(decision):
            return False
        why = self.core.evidence(decision.engine_id)
        text = f"{why} ({reason})" if why and reason else why or reason or "stall"
        self._tell("suspect", decision.engine_id, suspect_reason(text))
        return True

    def answered(self, decision: Decision, first_byte_s: float | None = None) -> None:
        """The engine of ``decision`` sent its first byte (after ``first_byte_s``; default:
        the time since the route): it feeds the engine's first-byte bound
        (``first_byte_bound()``) and, for a probing engine, ends its ejection here and
        in the deployment. The request goes on: call ``finished()`` at its end."""
        if self.core.answered(decision, first_byte_s):
            self._tell("recovered", decision.engine_id, "")

    def unproven(self, decision: Decision) -> None:
        """The request of ``decision``, a probe (``Decision.probe``) of an engine named
        stalled mid-stream, ended whole but with no more chunks than its engine's
        streams got before they stalled (``StreamGaps.flowed`` says so): a short
        answer passes a stall that holds longer ones, so it neither answers nor fails
        the probe. The request ends (no ``finished()`` needed) and the engine's next
        probe waits out its back-off."""
        self.core.unproven(decision)

    def sent(self, decision: Decision) -> None:
        """The request of ``decision`` was sent and its first byte should come soon (a
        stream: its first token). Until ``answered()`` (or its end) this router passes
        over the engine once the request waited a few times the engine's usual first
        byte time (at least 0.25 s) and it answered nothing since: a stopped or hung
        engine stops getting requests long before ``first_byte_bound()`` fails one.
        A preference, not evidence: nothing is ejected or told to the deployment."""
        self.core.sent(decision)

    def outcome(self, decision: Decision, kind: str, reason: str = "") -> None:
        """End the request of ``decision`` with what it got, for API servers that are
        not the gateway: ``"ok"`` (as ``finished()``), ``"rejected"`` (the engine
        refused it with a 4xx: no evidence against it, and no load left behind), or a
        failure kind (as ``failed()``: a request that got no first byte within
        ``first_byte_bound()``, a stream that stopped, a 5xx...)."""
        if kind in ("ok", "rejected"):
            self.core.finished(decision)
        elif kind in FAILURES:
            self.failed(decision, reason, kind)
        else:
            raise InvalidArgument(
                f"kind must be one of {', '.join(sorted(OUTCOMES))}, got {kind!r}"
            )

    def first_byte_bound(self, engine_id: str) -> float:
        """How long to wait for ``engine_id``'s first byte before failing the request
        with ``first_byte_timeout``: a multiple of what it usually takes, within the
        router's bounds."""
        return self.core.first_byte_bound(engine_id)

    def silent_s(self, engine_id: str) -> float:
        """Seconds ``engine_id`` had not reported when the latest snapshot was published
        (a forced snapshot named it a laggard at this cut); 0.0 otherwise. A reporter
        heartbeats from a thread of its own, so a live engine process is never silent
        for long: an engine that is silent *and* does not answer a request is stopped
        or gone (the gateway gives up on such a request early). Only the snapshot's
        own statement counts, never the time since it came: with Redis out of reach
        no engine turns silent."""
        core = self.core
        with core.lock:
            return core.silent_ms(engine_id) / 1000.0

    def stepped_s(self, engine_id: str) -> float | None:
        """Seconds since ``engine_id`` last stepped, as its reports say (the latest
        snapshot's counts of it, and their age); None when it holds no report of it.
        An engine in a long step has not stepped since its streams' latest chunk: it
        is slow, and its silent streams are no stall (``StreamGaps.check``)."""
        core = self.core
        with core.lock:
            return core.stepped_s(engine_id)

    def queues(self, engine_id: str) -> bool:
        """Whether requests wait for room at ``engine_id`` while it steps (its latest
        counts, fresh, say so) and nothing marks it. A stream of such an engine that
        went silent is most likely one it preempted when its KV cache ran out (vLLM
        sends nothing for it until it runs it again): the gateway waits for it past
        its idle-read bound while this holds."""
        return self.core.queues(engine_id)

    def silent_after_s(self, engine_id: str) -> float:
        """How long ``engine_id`` may go without a report before a request waiting on
        it is given up (``silent_s`` at least this): a few times its own recent gaps
        between reports, at least ``SILENT_AFTER_S``. An engine whose steps are long
        reports seldom and is alive; a stopped one does not report at all."""
        core = self.core
        with core.lock:
            return core.silent_after_s(engine_id)

    def _tell(self, op: str, engine_id: str, reason: str) -> None:
        raise NotImplementedError


class AsyncRouter(_LocalRouting):
    """Routes requests for one API server of a deployment (asyncio).

    ``client_index`` / ``client_count`` say which of how many API servers this
    is; ``client_index="auto"`` leases the lowest free index in Redis and lets
    ``client_count`` follow the live leases (redisbal.routing.lease). ``policy``
    is a name from ``redisbal.routing.policies.POLICIES`` or a Policy.
    ``tell_routes``: with 2 to 8 API servers, tell the others each route on the
    deployment's routes channel and count theirs as told (``redisbal.routing.told_routes``).
    ``hold_s``: with a policy that holds (the default), ``admit()`` holds a request
    while every engine is at its running cap, at most this long
    (``redisbal.routing.admission``); None or 0: it never holds.
    ``cache_sync``: a reader of what the engines cache (``CacheSync``), called every
    ``cache_refresh_s`` to keep ``core.cache_view`` fresh for the policy; None (the
    default): no engine's view is told. ``learn_routes``: for each engine without a
    told view, the router learns its cache from the requests it sent there (their
    ``blocks``), this many anchors at most (``redisbal.routing.cache_view``); 0 (the
    default): it learns none.
    """

    def __init__(
        self,
        redis_url: str | None = None,
        deployment: str = "default",
        client_index: int | str = 0,
        client_count: int = 1,
        *,
        policy: str | Policy = DEFAULT_POLICY,
        client: AsyncRedisClient | None = None,
        stale_after_s: float = 5.0,
        poll_s: float = 1.0,
        engines: list[str] | None = None,
        rng: random.Random | None = None,
        lease_ttl_s: float = 10.0,
        suspect_s: float = 1.0,
        outcomes: OutcomeTracker | None = None,
        tell_routes: bool = True,
        hold_s: float | None = None,
        cache_sync: CacheSync | None = None,
        cache_refresh_s: float = 0.25,
        learn_routes: int = 0,
    ) -> None:
        self.keys = DeploymentKeys(check_name(deployment, "deployment"))
        checked = ("poll_s", poll_s), ("stale_after_s", stale_after_s)
        for name, value in (*checked, ("cache_refresh_s", cache_refresh_s)):
            # poll_s <= 0 would GET in a busy loop; NaN never compares, so never polls
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise InvalidArgument(f"{name} must be a number of seconds, got {value!r}")
            if not (math.isfinite(value) and value > 0):
                raise InvalidArgument(f"{name} must be finite and > 0, got {value!r}")
        self.lease: ClientLease | None = None
        self.lease_ttl_s = lease_ttl_s
        self._auto_index = client_index == "auto"
        if self._auto_index:
            client_index, client_count = 0, 1
        self.core = RouterCore(
            cast(int, client_index),
            client_count,
            policy,
            stale_after_s=stale_after_s,
            rng=rng,
            suspect_s=suspect_s,
            outcomes=outcomes,
            learn_routes=learn_routes,
        )
        if engines:
            self.core.set_engines([check_name(e, "engine_id") for e in engines])
        if client is None and not redis_url:
            raise InvalidArgument("give a redis_url (or client=)")
        self._url = redis_url
        self._client: AsyncRedisClient | None = client  # made by start() when None
        self._owns_client = client is None
        self.url = redact(redis_url or "")
        self.poll_s = poll_s
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._first = asyncio.Event()
        self._rosters = Rosters()  # of compact snapshots (redisbal/barrier/snapshot.py)
        self._attempted = asyncio.Event()  # the feed's first connection attempt ended
        self._subscribed_before = False  # a cluster feed re-reads the slot map after that
        self.last_error: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the feed's (start())
        self._marks: set[asyncio.Task[None]] = set()  # suspect marks on their way
        self._caps_for: list[Any] | None = None  # core.known when the caps were read
        self._caps_due = 0.0  # loop time the declared caps are read again (_read_caps)
        self._caps_warned = False  # the caps could not be read (an ACL): said once
        self._malformed_said = ""  # the last malformed snapshot's error logged (_apply)
        self._scripts: Scripts | None = None  # made with the first mark
        self.routes = RoutesChannel(self.core, self.keys.routes, tell_routes)
        self.admission: Admission | None = None
        if hold_s and self.core.policy.holds:
            self.admission = Admission(self.core, hold_s)
            self.core.on_update = self.admission.wake
        self.cache_sync = cache_sync
        self.cache_refresh_s = cache_refresh_s
        self._cache_cursor: Any = None  # the reader's, between calls
        self._cache_task: asyncio.Task[None] | None = None
        self._cache_stop = asyncio.Event()

    async def admit(self) -> float:
        """Before routing a request: while every engine is at its running cap, wait
        for a slot to free, at most ``hold_s`` (``redisbal.routing.admission``).
        Returns the seconds held (0.0: not held). Route right after it returns (no
        await in between)."""
        return 0.0 if self.admission is None else await self.admission.enter()

    # -- lifecycle ---------------------------------------------------------------------------------

    async def start(self, wait: float = 0.0) -> None:
        """Start the feed; with ``wait`` > 0, wait up to that long for a first snapshot.

        With Redis unreachable this still returns (routing is degraded until the
        feed connects; it keeps retrying).
        """
        if self._task is not None:
            return
        if self._client is None:
            self._client = make_client(
                self._url or "",
                asyncio=True,
                socket_connect_timeout=1.0,
                socket_timeout=5.0,
                health_check_interval=10,
            )
        self._loop = asyncio.get_running_loop()
        self.routes.attach(self._loop, self._client)
        if self._auto_index and self.lease is None:
            self.lease = ClientLease(self._client, self.keys, ttl_s=self.lease_ttl_s)
            self.lease.attach(self.core)
            await self.lease.start()
        self._task = asyncio.get_running_loop().create_task(self._feed())
        if self.cache_sync is not None:
            self._cache_task = asyncio.get_running_loop().create_task(self._cache_feed())
        # learn the engines (members, stored snapshot) before the first route if Redis is up
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._attempted.wait(), 2.0)
        if wait > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._first.wait(), wait)

    async def aclose(self) -> None:
        self._closed = True
        if self.admission is not None:
            self.admission.close()
        await cancel_and_wait(self._task)  # (the feed sits in redis-py calls)
        if self._cache_task is not None:
            # stopped between reads, not cancelled: a read cancelled inside a redis-py
            # pipeline can leave its connection unreleased, and the pool's release waits
            self._cache_stop.set()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._cache_task), 6.0)
            await cancel_and_wait(self._cache_task)  # (a read stuck past its timeout)
        await self.routes.aclose()
        if self.lease is not None:
            await self.lease.aclose()
        self.core.set_connected(False)  # routes after close are made without a feed: degraded
        if self._owns_client and self._client is not None:
            with contextlib.suppress(Exception):
                await self._client.aclose()

    async def __aenter__(self) -> AsyncRouter:
        await self.start()
        return self

    def _tell(self, op: str, engine_id: str, reason: str) -> None:
        """Send a mark (``suspect``) or its end (``recovered``) from the feed's loop
        (any thread may call this)."""
        loop = self._loop
        if loop is None or self._closed or loop.is_closed():
            return  # not started: the local state is all there is
        with contextlib.suppress(RuntimeError):  # the loop closed under us
            loop.call_soon_threadsafe(self._spawn_mark, op, engine_id, reason)

    def _spawn_mark(self, op: str, engine_id: str, reason: str) -> None:
        task = asyncio.get_running_loop().create_task(self._mark(op, engine_id, reason))
        self._marks.add(task)
        task.add_done_callback(self._marks.discard)

    async def _mark(self, op: str, engine_id: str, reason: str) -> None:
        if self._scripts is None:
            pubcmd = "SPUBLISH" if is_cluster(self._redis) else "PUBLISH"
            self._scripts = Scripts(self._redis, self.keys, pubcmd)
        args = (engine_id, self.core.client_index) + ((reason,) if op == "suspect" else ())
        try:
            out = await asyncio.wait_for(self._scripts.call(op, *args), 5.0)
        except (redis.exceptions.RedisError, asyncio.TimeoutError) as exc:
            log.warning(
                "router %d: could not tell Redis engine %s is %s (%s); only this router knows",
                self.core.client_index,
                engine_id,
                op,
                redact(str(exc)) or type(exc).__name__,
            )
            return
        status = out[0].decode() if isinstance(out[0], bytes) else str(out[0])
        if status == "capped":
            log.warning(
                "router %d: engine %s not marked suspect for the deployment: half of the "
                "engines are suspect already; avoiding it here",
                self.core.client_index,
                engine_id,
            )

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- feed -------------------------------------------------------------------------------------

    def _apply(self, data: bytes | str | None) -> bool:
        """Adopt a published snapshot; True when it is a compact message whose roster
        this router has not seen (then the stored snapshot, which has it, is read)."""
        if not data:
            return False
        try:
            snap = Snapshot.from_json(data, self._rosters)
        except RosterUnknown:
            return True
        except MalformedData as exc:  # (from_json checks every field: nothing else is raised)
            # ignored before any of it is adopted; counted, and said once, not at every
            # poll that reads it again from the key
            self.core.counters["malformed"] += 1
            if str(exc) != self._malformed_said:
                self._malformed_said = str(exc)
                log.warning(
                    "router %d: ignoring a malformed snapshot: %s", self.core.client_index, exc
                )
            return False
        cur = self.core.snapshot
        dropped = self.core.counters["rejoin_dropped"]
        if self.core.apply_snapshot(snap):
            if cur is not None and cur.epoch != snap.epoch:
                carried = sorted(self.core.carried)
                log.warning(
                    "router %d: new epoch %s (was %s): Redis state was reset; resynced%s",
                    self.core.client_index,
                    snap.epoch,
                    cur.epoch,
                    f"; still routing to {', '.join(carried)} until they re-register"
                    if carried
                    else "",
                )
            if (n := self.core.counters["rejoin_dropped"] - dropped) > 0:
                log.warning(
                    "router %d: %d engine(s) known before epoch %s did not re-register "
                    "within %.1fs of its first snapshot; no longer routed to",
                    self.core.client_index,
                    n,
                    snap.epoch,
                    self.core.rejoin_grace_s,
                )
            self._first.set()
        return False

    @property
    def _redis(self) -> AsyncRedisClient:
        """The client, once start() made it (the feed and the writes run after start)."""
        if self._client is None:
            raise InvalidState("the router is not started: call start() first")
        return self._client

    async def _fetch(self) -> None:
        self._apply(await self._redis.get(self.keys.snapshot))

    async def _read_caps(self) -> None:
        """Read the running caps the engines declared (redisbal.running_caps): when the
        engines known change (a new one is routed with its cap from the start) and every
        ``CAPS_REFRESH_S`` (one declared again after Redis lost it)."""
        known = self.core.known
        self._caps_for = known
        self._caps_due = asyncio.get_running_loop().time() + CAPS_REFRESH_S
        try:
            caps = await fetch_caps(self._redis, self.keys)
        except redis.exceptions.ResponseError as exc:  # an ACL without the hash: none known
            if not self._caps_warned:
                self._caps_warned = True
                log.warning(
                    "router %d: cannot read the engines' declared running caps (%s); "
                    "learning them from queues (grant this user HGETALL on %s)",
                    self.core.client_index,
                    redact(str(exc)),
                    self.keys.running_caps,
                )
            return
        self.core.set_declared_caps(caps)

    async def _known_engines(self) -> None:
        if self.core.snapshot is None and not self.core.engines:
            ids = cast(list[bytes | str], await self._redis.zrange(self.keys.members, 0, -1))
            if ids:
                self.core.set_engines(
                    sorted(i.decode() if isinstance(i, bytes) else i for i in ids)
                )

    async def _feed(self) -> None:
        backoff = 0.05
        routes = self.routes
        while not self._closed:
            pubsub = None
            try:
                pubsub, sharded = await self._subscribe()
                await routes.subscribe(pubsub, sharded, partial(self._confirmed, pubsub, sharded))
                await self._known_engines()
                await self._fetch()
                await self._read_caps()
                self.core.set_connected(True)
                self._attempted.set()
                self.last_error = None
                backoff = 0.05
                loop = asyncio.get_running_loop()
                next_poll = loop.time() + self.poll_s
                while not self._closed:
                    msg = await self._next_message(pubsub, sharded, min(self.poll_s, 0.5))
                    kind = msg.get("type") if msg is not None else None
                    if kind in ("message", "smessage"):
                        assert msg is not None
                        if msg["channel"] in routes.names:
                            self.core.hear(msg["data"])
                        elif self._apply(msg["data"]):
                            self.core.counters["roster_fetches"] += 1
                            await self._fetch()  # a roster it has not seen
                    elif kind in ("unsubscribe", "sunsubscribe"):
                        # the server dropped us (e.g. the slot moved): subscribe again
                        raise redis.exceptions.ConnectionError("unsubscribed by the server")
                    if loop.time() >= next_poll:
                        await self._fetch()
                        next_poll = loop.time() + self.poll_s
                    if self.core.known is not self._caps_for or loop.time() >= self._caps_due:
                        await self._read_caps()  # engines came or went, or it is time
                    routes.tick()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # never let the feed end: resubscribe, GET, go on
                self.core.set_connected(False)
                error = f"{type(exc).__name__}: {redact(str(exc))}"
                if not isinstance(exc, FEED_ERRORS):  # a bug, or a snapshot it cannot adopt
                    if error != self.last_error:  # (once, not once per reconnect)
                        log.exception("router %d: snapshot feed failed", self.core.client_index)
                elif self.last_error is None:
                    log.warning(
                        "router %d: snapshot feed lost (%s: %s); routing on local state",
                        self.core.client_index,
                        type(exc).__name__,
                        redact(str(exc)),
                    )
                self.last_error = error
                self._attempted.set()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 1.0)
            finally:
                if pubsub is not None:
                    with contextlib.suppress(Exception):
                        await pubsub.aclose()
        self.core.set_connected(False)

    async def _subscribe(self) -> tuple[Any, bool]:
        """Subscribe to the snapshot channel; returns (pubsub, sharded).

        On Redis Cluster the scripts SPUBLISH when the server has it (7.0+) and
        PUBLISH otherwise (lua/includes/publish.lua), so the router tries SSUBSCRIBE first and
        falls back to SUBSCRIBE on "unknown command" (6.2), at every (re)connect: no
        INFO call, so a least-privilege router user needs no extra permission.
        Returns once the subscription is confirmed, so that the GET that follows
        misses nothing published in between.
        """
        client = self._redis
        if is_cluster(client):
            cluster = cast("AsyncRedisCluster", client)
            if self._subscribed_before:
                # after a lost subscription the slot map may name a dead primary: ask the
                # cluster again (the client only does it by itself for commands, so a
                # feed that never gets past its subscribe would keep its stale map)
                await cluster.nodes_manager.initialize()
            await cluster.initialize()
            self._subscribed_before = True
            sharded = cluster.pubsub()
            try:
                await sharded.ssubscribe(self.keys.channel)
                await self._confirmed(sharded, True)
                return sharded, True
            except redis.exceptions.ResponseError as exc:
                with contextlib.suppress(Exception):
                    await sharded.aclose()
                if "unknown command" not in str(exc).lower():
                    raise
        pubsub = client.pubsub()
        await pubsub.subscribe(self.keys.channel)
        await self._confirmed(pubsub, False)
        return pubsub, False

    async def _confirmed(self, pubsub: Any, sharded: bool, timeout: float = 5.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            msg = await self._next_message(pubsub, sharded, 0.5)
            if msg is not None and msg.get("type") in ("subscribe", "ssubscribe"):
                return
        raise redis.exceptions.TimeoutError(f"no subscribe confirmation in {timeout}s")

    async def refresh_cache_view(self) -> None:
        """Bring ``core.cache_view`` up to date with what the engines cache, once: the
        reader (``cache_sync``) reads Redis and changes the view in place. A no-op
        without a reader. Raises what the reader raises; the cursor then starts over
        (the next call reads the whole view again)."""
        sync = self.cache_sync
        if sync is None:
            return
        cursor, self._cache_cursor = self._cache_cursor, None
        self._cache_cursor = await sync(self._redis, self.keys, self.core.cache_view, cursor)

    async def _cache_feed(self) -> None:
        """``refresh_cache_view`` every ``cache_refresh_s`` while the router runs; with
        Redis away the view stays as it was (the engines' caches change slowly)."""
        failed = False
        while not self._closed:
            try:
                await self.refresh_cache_view()
                failed = False
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if not failed:  # once per outage, not once per refresh
                    log.warning(
                        "router %d: cache view not read (%s: %s); routing on the view it has",
                        self.core.client_index,
                        type(exc).__name__,
                        redact(str(exc)),
                    )
                failed = True
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._cache_stop.wait(), self.cache_refresh_s)

    @staticmethod
    async def _next_message(pubsub: Any, sharded: bool, timeout: float) -> dict[str, Any] | None:
        if sharded:
            msg = await pubsub.get_sharded_message(timeout=timeout)
        else:
            msg = await pubsub.get_message(timeout=timeout)
        return msg  # type: ignore[no-any-return]


class Router(_LocalRouting):
    """Blocking twin of AsyncRouter: a thin facade running it on a ``BackgroundLoop``.

    ``route()`` / ``finished()`` are plain calls on local state and thread-safe.
    """

    def __init__(
        self,
        redis_url: str | None = None,
        deployment: str = "default",
        client_index: int | str = 0,
        client_count: int = 1,
        **kwargs: Any,
    ) -> None:
        if kwargs.get("client") is not None:
            raise InvalidArgument(
                "Router makes its own asyncio client on its thread; pass redis_url"
            )
        # built on the caller's thread so that bad arguments raise here
        self._inner = AsyncRouter(redis_url, deployment, client_index, client_count, **kwargs)
        self.core = self._inner.core
        self._bg: BackgroundLoop | None = None

    def _tell(self, op: str, engine_id: str, reason: str) -> None:
        self._inner._tell(op, engine_id, reason)

    def start(self, wait: float = 0.0) -> None:
        """Start the feed thread; with ``wait`` > 0, wait that long for a first snapshot."""
        if self._bg is not None:
            return
        self._bg = BackgroundLoop("redisbal-router-feed")
        self._bg.run(self._inner.start(wait), timeout=wait + 10)

    def close(self) -> None:
        if self._bg is None:
            return
        with contextlib.suppress(Exception):
            self._bg.run(self._inner.aclose(), timeout=5)
        self._bg.close()
        self._bg = None

    def __enter__(self) -> Router:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
