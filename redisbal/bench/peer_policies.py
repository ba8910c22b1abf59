"""Peer routers' policies, emulated: the routers users would pick instead of redisbal,
for the benchmark to compare on the simulated clock.

Each policy follows one public source (named in its docstring, with the defaults
taken from it) and sees what that router would see when it runs inside one of
redisbal's API servers: its own routes and completions (``EngineView.inflight``,
``routed``) and, for the ones that read engine metrics, the shared snapshot's
counts (``waiting``, ``kv_usage``). None reads redisbal's pending bookkeeping.
Prefix-aware ones take the request's prompt block hashes (``RequestInfo.blocks``,
chained hashes of 16-token blocks) as their unit of text.

``PEER_POLICIES`` maps a name to a factory with the sources' defaults;
``make_peer(name, kv_blocks=...)`` builds one with its prefix index sized for the
simulated engine's KV cache.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence

from redisbal.errors import InvalidArgument
from redisbal.routing.policies import Policy
from redisbal.routing.state import EngineView, RoutingState

# vLLM's reference engine in the GIE prefix plugin's sizing note: Llama-3-8B on an H100
# 80GB caches about 500K tokens = 31,250 blocks of 16 tokens.
REFERENCE_KV_BLOCKS = 31_250


def _blocks(core: RoutingState) -> tuple[int, ...]:
    req = core.request
    return (req.blocks or ()) if req is not None else ()


class PowerOfTwoPolicy(Policy):
    """Ray Serve's default request router: power of two choices.

    Source: ray-project/ray ``python/ray/serve/_private/request_router/pow_2_router.py``
    (``PowerOfTwoChoicesRequestRouter.choose_replicas``: ``random.sample`` of two
    distinct replicas) and ``request_router.py`` (``_select_from_candidate_replicas``:
    the lower queue length wins with a strict ``<``, so on a tie the first of the two
    sampled, i.e. a random one, wins).

    The queue length here is this router's own in-flight count per engine. Ray's
    is a cache (``RAY_SERVE_QUEUE_LENGTH_CACHE_TIMEOUT_S`` = 10 s) of the replica's
    ongoing requests, filled by probing the replica and bumped by +1 at each send of
    this router (``on_send_request``); with one router and exact completions that is
    the in-flight count. Not modelled: ``max_ongoing_requests`` rejection and backoff
    (engines here never refuse), and the probe of other routers' requests.
    """

    name = "p2c"

    def pick(self, core: RoutingState) -> EngineView:
        engines = core.engines
        n = len(engines)
        if n == 1:
            return engines[0]
        rnd = core.rng.random
        i = int(rnd() * n)
        j = int(rnd() * (n - 1))
        if j >= i:  # two distinct engines, in random order, as random.sample gives
            j += 1
        a, b = engines[i], engines[j]
        return b if b.inflight < a.inflight else a


class SglangCacheAwarePolicy(Policy):
    """SGLang router's ``cache_aware`` policy (the router's default).

    Sources: sgl-project/sglang ``sgl-router/src/policies/cache_aware.rs``
    (``select_worker``), ``sgl-router/src/policies/tree.rs`` (the multi-tenant radix
    tree: ``prefix_match``, ``insert``, ``get_smallest_tenant``,
    ``evict_tenant_by_size``), defaults from ``sgl-router/py_src/sglang_router/
    router_args.py`` (``RouterArgs``): cache_threshold 0.3, balance_abs_threshold 64,
    balance_rel_threshold 1.5, max_tree_size 2**26 characters per tenant,
    eviction_interval_secs 120 (60 in earlier releases). (The Rust
    ``CacheAwareConfig::default`` has 0.5 / 32 / 1.1 / 10,000; launched routers use
    the Python defaults, as their startup log shows.)

    Per request: the load is each worker's ``load()``, the router's own count of
    its active requests (``BasicWorker.load_counter``): here ``inflight``. If
    ``max - min > abs`` and ``max > min * rel``, route to the first least-loaded
    engine (and still insert the prompt into its tree). Otherwise match the prompt
    in the shared tree (one tree, each node tagged with the engines that were sent
    that prefix); if matched / prompt length > cache_threshold, route to a tenant
    of the deepest matched node, else to the engine whose tree is smallest (ties:
    a fixed arbitrary order, drawn once from the router's rng, as DashMap's hash
    order is). The prompt is then inserted for the chosen engine.

    Text unit: one block hash stands for one character, so match rate and tree
    size count blocks (the partial last block of a prompt is not in ``blocks``).
    With no blocks SGLang's text is empty: match rate 0, so the smallest tree.

    Eviction: SGLang evicts each tenant's least recently used leaves down to
    max_tree_size every eviction interval. Its default, 2**26 characters at ~4
    characters per token and 16 tokens per block, is 2**20 blocks: 33.6 times the
    reference engine's KV cache (``REFERENCE_KV_BLOCKS``). Scaled: the limit is
    ``kv_blocks`` x 2**20 / 31,250 blocks per engine (``kv_blocks``: the simulated
    engine's KV capacity in blocks), enforced at insert rather than on a timer,
    with the LRU order kept by a route counter (policies have no clock).
    """

    name = "sglang-cache-aware"

    def __init__(
        self,
        *,
        kv_blocks: int = REFERENCE_KV_BLOCKS,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
        max_tree_blocks: int | None = None,
    ) -> None:
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        if max_tree_blocks is None:
            max_tree_blocks = max(1, round(kv_blocks * 2**20 / REFERENCE_KV_BLOCKS))
        self.max_tree_blocks = max_tree_blocks
        # the tree: chained block hash -> the tenants (engines) holding that block, in
        # insertion order (SGLang takes "the first tenant" of a DashMap: arbitrary)
        self.nodes: dict[int, dict[str, None]] = {}
        # per tenant: its nodes, least recently used first; ancestors are always
        # more recent than their descendants, so the first one is a leaf of it
        self.lru: dict[str, OrderedDict[int, None]] = {}
        self.order: list[str] = []  # the fixed arbitrary tie order of tenants
        self._ids: tuple[str, ...] = ()
        self._salt: int | None = None
        self.by_id: dict[str, EngineView] = {}

    def reset(self, core: RoutingState) -> None:
        self.by_id = {e.engine_id: e for e in core.engines}
        ids = tuple(self.by_id)
        if ids == self._ids:
            return
        self._ids = ids
        if self._salt is None:
            self._salt = int(core.rng.random() * 2**32)
        salt = self._salt
        for eid in ids:  # init_workers / add_worker: insert("", url)
            self.lru.setdefault(eid, OrderedDict())
        self.order = sorted(ids, key=lambda i: zlib.crc32(i.encode(), salt))

    def tree_size(self, engine_id: str) -> int:
        """The engine's tree size in blocks (SGLang's tenant_char_count)."""
        lru = self.lru.get(engine_id)
        return len(lru) if lru is not None else 0

    def prefix_match(self, blocks: Sequence[int]) -> tuple[int, str | None]:
        """(blocks matched in the shared tree, a tenant of the deepest matched node);
        refreshes that tenant's path, as ``Tree::prefix_match`` does."""
        nodes = self.nodes
        n = 0
        node = None
        for h in blocks:
            nd = nodes.get(h)
            if nd is None:
                break
            node = nd
            n += 1
        if node is None:
            return 0, None
        tenant = next(iter(node))
        lru = self.lru[tenant]
        for k in range(n - 1, -1, -1):  # deepest first: ancestors end up more recent
            if blocks[k] in lru:  # (always, unless a prompt repeats a hash)
                lru.move_to_end(blocks[k])
        return n, tenant

    def insert(self, blocks: Sequence[int], tenant: str) -> None:
        nodes = self.nodes
        lru = self.lru.setdefault(tenant, OrderedDict())
        for h in reversed(blocks):  # deepest first: ancestors end up more recent
            tenants = nodes.get(h)
            if tenants is None:
                nodes[h] = {tenant: None}
                lru[h] = None
            elif tenant in tenants:
                lru.move_to_end(h)
            else:
                tenants[tenant] = None
                lru[h] = None
        for _ in range(len(lru) - self.max_tree_blocks):
            h, _ = lru.popitem(last=False)
            tenants = nodes[h]
            del tenants[tenant]
            if not tenants:
                del nodes[h]

    def pick(self, core: RoutingState) -> EngineView:
        engines = core.engines
        loads = [e.inflight for e in engines]
        hi, lo = max(loads), min(loads)
        if hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold:
            return engines[loads.index(lo)]
        blocks = _blocks(core)
        matched, tenant = self.prefix_match(blocks)
        if blocks and tenant is not None and matched / len(blocks) > self.cache_threshold:
            chosen = tenant
        else:
            lru = self.lru
            chosen, size = None, math.inf
            for eid in self.order:
                s = len(lru[eid])
                if s < size:
                    chosen, size = eid, s
        # SGLang: the chosen worker if it is healthy, else the first healthy one
        eng = self.by_id.get(chosen) if chosen is not None else None
        return eng if eng is not None else engines[0]

    def routed(self, core: RoutingState, eng: EngineView) -> None:
        blocks = _blocks(core)
        if blocks:
            self.insert(blocks, eng.engine_id)


class LlmdPolicy(Policy):
    """llm-d's inference scheduler with its default scheduling profile.

    Profile (weights): queue-scorer 2, kv-cache-utilization-scorer 2,
    prefix-cache-scorer 3, max-score-picker; from llm-d/llm-d
    ``guides/inference-scheduling/scheduler/inference-scheduling.values.yaml`` and
    the ``default-plugins.yaml`` of kubernetes-sigs/gateway-api-inference-extension
    ``config/charts/inferencepool/templates/epp-config.yaml`` (the same weights).
    Scorers, in GIE ``pkg/epp/scheduling/framework/plugins/``:

    - ``queuescorer/queue.go``: (max_waiting - waiting) / (max_waiting - min_waiting)
      over the candidates, 1.0 for all when they are equal;
    - ``kvcacheutilizationscorer/kvcache_utilization.go``: 1 - KV-cache usage
      (``kv_usage``; 0 when an engine reports none);
    - ``prefixcachescorer/plugin.go`` + ``indexer.go`` (approximate mode): the
      prompt's block hashes (at most ``MaxPrefixBlocksToMatch`` = 256; block size
      64 characters, or with AutoTune the engine's 16-token block, which is what
      ``RequestInfo.blocks`` holds); walking the hashes in order until one no
      endpoint has, each endpoint scores the count of those it holds / the number of
      hashes (0 for all without hashes). After each route the request's hashes are
      added to the chosen endpoint's LRU, of ``LRUCapacityPerServer`` = 31,250
      entries, or with AutoTune (on by default) the engine's number of GPU blocks:
      ``kv_blocks`` here.

    Total = sum of weight x score; the highest wins, ties at random (the picker
    shuffles, then sorts stably). Staleness: the EPP polls each engine's metrics
    every 50 ms (``--refresh-metrics-interval``) and does not bump them for its own
    routes; here the waiting count and KV usage are the latest snapshot's, so the
    benchmark's snapshot interval stands in for the polling interval.

    Cost: the queue and KV parts change only with a snapshot, so they are summed
    per engine at ``reset``; a route then costs O(matched blocks), not O(engines).
    """

    name = "llmd"
    queue_weight = 2.0
    kv_weight = 2.0
    prefix_weight = 3.0
    max_prefix_blocks = 256

    def __init__(self, *, kv_blocks: int = REFERENCE_KV_BLOCKS) -> None:
        self.lru_capacity = kv_blocks
        self.hash_to_pods: dict[int, set[str]] = {}
        self.pod_lru: dict[str, OrderedDict[int, None]] = {}
        self.base: dict[str, float] = {}  # queue + KV part of each engine's score
        self.by_id: dict[str, EngineView] = {}
        self.top: list[EngineView] = []  # the engines with the highest base
        self.top_base = -math.inf

    def reset(self, core: RoutingState) -> None:
        engines = core.engines
        waits = [e.waiting for e in engines]
        lo, hi = (min(waits), max(waits)) if waits else (0, 0)
        base: dict[str, float] = {}
        top: list[EngineView] = []
        best = -math.inf
        for e in engines:
            q = 1.0 if hi == lo else (hi - e.waiting) / (hi - lo)
            kv = 1.0 - (e.kv_usage or 0.0)
            s = self.queue_weight * _clamp(q) + self.kv_weight * _clamp(kv)
            base[e.engine_id] = s
            if s > best:
                best, top = s, [e]
            elif s == best:
                top.append(e)
        self.base, self.top, self.top_base = base, top, best
        self.by_id = {e.engine_id: e for e in engines}

    def scores(self, core: RoutingState) -> dict[str, float]:
        """Every choosable engine's total score for the current request (O(N): for
        tests and inspection; ``pick`` does not call it)."""
        matched = self.match(_blocks(core)[: self.max_prefix_blocks])
        total = len(_blocks(core)[: self.max_prefix_blocks])
        return {
            eid: b + (self.prefix_weight * matched.get(eid, 0) / total if total else 0.0)
            for eid, b in self.base.items()
        }

    def match(self, hashes: Sequence[int]) -> dict[str, int]:
        """``matchLongestPrefix``: endpoint -> blocks it holds among the leading
        hashes that some endpoint holds."""
        res: dict[str, int] = {}
        h2p = self.hash_to_pods
        for h in hashes:
            pods = h2p.get(h)
            if not pods:
                break
            for p in pods:
                res[p] = res.get(p, 0) + 1
        return res

    def pick(self, core: RoutingState) -> EngineView:
        if not self.by_id:
            self.reset(core)
        hashes = _blocks(core)[: self.max_prefix_blocks]
        best, winners = self.top_base, self.top
        if hashes:
            total = len(hashes)
            base, by_id, w = self.base, self.by_id, self.prefix_weight
            for eid, n in self.match(hashes).items():
                e = by_id.get(eid)
                if e is None:
                    continue  # known to the index, not choosable now
                s = base[eid] + w * n / total
                if s > best:
                    best, winners = s, [e]
                elif s == best:
                    winners = [*winners, e]
        return winners[int(core.rng.random() * len(winners))]

    def routed(self, core: RoutingState, eng: EngineView) -> None:
        hashes = _blocks(core)[: self.max_prefix_blocks]
        if not hashes:
            return
        eid = eng.engine_id
        lru = self.pod_lru.get(eid)
        if lru is None:
            lru = self.pod_lru[eid] = OrderedDict()
        h2p = self.hash_to_pods
        cap = self.lru_capacity
        for h in hashes:
            if h in lru:
                lru.move_to_end(h)
                continue
            lru[h] = None
            if len(lru) > cap:  # the LRU's eviction callback drops the pod from the hash
                old, _ = lru.popitem(last=False)
                pods = h2p.get(old)
                if pods is not None:
                    pods.discard(eid)
                    if not pods:
                        del h2p[old]
            pods = h2p.get(h)
            if pods is None:
                pods = h2p[h] = set()
            pods.add(eid)


def _clamp(x: float) -> float:
    return 0.0 if x < 0.0 else 1.0 if x > 1.0 else x


def _point(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def _mix64(x: int) -> int:
    """A block hash spread over the ring (splitmix64's finalizer)."""
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


class BoundedLoadHashPolicy(Policy):
    """Consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam,
    "Consistent Hashing with Bounded Loads", SODA 2018, arXiv:1608.01350; the
    scheme of HAProxy's ``hash-balance-factor`` and Vimeo's deployment).

    Engines sit at ``points`` points each (40, as redisbal's own ring) on a 64-bit
    hash ring; a request goes to the first engine clockwise from its key's hash
    whose load is below the capacity ceil(c x (m + 1) / n), where m is the number
    of requests in flight, n the number of engines and c = 1.25 (HAProxy's
    ``hash-balance-factor 125``). Loads are this router's own in-flight counts, as
    a single load balancer sees them. The walk ends: the loads sum to m < n x cap.

    Keys: ``RequestInfo.key``; without one, the prompt's first block hash (so
    requests sharing a first block share an engine, as a prefix-hash balancer
    does); with neither, the least in-flight engine (ties at random). Cost: a
    bisect plus the walk (expected O(1/(c-1)^2) engines), not O(engines).
    """

    name = "chbl"

    def __init__(self, *, c: float = 1.25, points: int = 40) -> None:
        self.c = c
        self.points = points
        self.ring: list[int] = []
        self.owner: list[EngineView] = []
        self.index: dict[str, EngineView] = {}
        self.total = 0  # requests in flight over the ring's engines
        self._ids: tuple[str, ...] = ()

    def reset(self, core: RoutingState) -> None:
        self.index = {e.engine_id: e for e in core.engines}
        self.total = sum(e.inflight for e in core.engines)
        ids = tuple(e.engine_id for e in core.engines)
        if ids != self._ids or len(self.owner) != len(ids) * self.points:
            self._ids = ids
            pts = sorted(
                (_point(b"%d#" % v + e.engine_id.encode()), k)
                for k, e in enumerate(core.engines)
                for v in range(self.points)
            )
            self.ring = [p for p, _ in pts]
            self.owner = [core.engines[k] for _, k in pts]
        else:  # same engines, maybe new EngineView objects: keep the ring, refresh owners
            self.owner = [self.index[e.engine_id] for e in self.owner]

    def capacity(self, n: int) -> int:
        return math.ceil(self.c * (self.total + 1) / n)

    def pick(self, core: RoutingState) -> EngineView:
        if not self.ring:
            self.reset(core)
        req = core.request
        if req is not None and req.key is not None:
            at = _point(req.key.encode())
        elif req is not None and req.blocks:
            at = _mix64(req.blocks[0])
        else:
            engines = core.engines
            least = min(e.inflight for e in engines)
            tied = [e for e in engines if e.inflight == least]
            return tied[int(core.rng.random() * len(tied))]
        return self.walk(at)

    def walk(self, at: int) -> EngineView:
        """The first engine clockwise from ring position ``at`` below capacity."""
        ring, owner = self.ring, self.owner
        cap = self.capacity(len(self.index))
        m = len(ring)
        i = bisect.bisect_left(ring, at)
        for k in range(m):
            e = owner[(i + k) % m]
            if e.inflight < cap:
                return e
        return owner[i % m]  # unreachable while total counts every in-flight request

    def routed(self, core: RoutingState, eng: EngineView) -> None:
        if eng.engine_id in self.index:
            self.total += 1

    def finished(self, core: RoutingState, eng: EngineView) -> None:
        if eng.engine_id in self.index and self.total > 0:
            self.total -= 1


PEER_POLICIES: dict[str, Callable[[], Policy]] = {
    "p2c": PowerOfTwoPolicy,
    "sglang-cache-aware": SglangCacheAwarePolicy,
    "llmd": LlmdPolicy,
    "chbl": BoundedLoadHashPolicy,
}
# the peers whose index is sized by an engine's KV cache (``kv_blocks``)
_KV_SIZED: dict[str, Callable[..., Policy]] = {
    "sglang-cache-aware": SglangCacheAwarePolicy,
    "llmd": LlmdPolicy,
}


def make_peer(name: str, *, kv_blocks: int | None = None) -> Policy:
    """A peer policy by name, with its source's defaults; ``kv_blocks`` (an engine's
    KV-cache capacity in 16-token blocks) sizes the prefix indexes of the peers that
    scale with it (the others ignore it)."""
    factory = PEER_POLICIES.get(name)
    if factory is None:
        raise InvalidArgument(
            f"unknown peer policy {name!r}; choose from {', '.join(PEER_POLICIES)}"
        )
    if kv_blocks is not None and name in _KV_SIZED:
        if isinstance(kv_blocks, bool) or not isinstance(kv_blocks, int) or kv_blocks < 1:
            raise InvalidArgument(f"kv_blocks must be a whole number >= 1, got {kv_blocks!r}")
        return _KV_SIZED[name](kv_blocks=kv_blocks)
    return factory()
