"""Simulated continuous-batching engines (pure model, driven by a clock).

Used by ``redisbal engine-sim``, ``redisbal demo`` and ``redisbal bench``.
The model, per engine:
- a running cap (slots); requests beyond it wait in FIFO order;
- each step admits waiting requests into free slots, then decodes one token
  for every running request; a request leaves when it has produced its
  output length (heavy-tailed: lognormal, capped);
- a step lasts ``base_step_s + per_seq_s * running + prefill_s * admitted +
  prefill_per_token_s * (prompt tokens admitted this step not found in the
  prefix cache)``, times ``slow`` (stragglers have slow > 1);
- prompts (optional: ``prompt_tokens`` and ``blocks``, the chained hashes of
  the prompt's 16-token blocks) meet a per-engine prefix cache
  (``redisbal.sim.prefix_cache``, ``cache_blocks`` > 0): the longest cached
  prefix is not computed again, and the prompt's blocks are inserted when it
  is prefilled (its output's blocks, ``done_blocks``, when it finishes);
- ``kv_capacity_tokens`` > 0 bounds the KV cache: a request is admitted only
  while the tokens held by running requests (prompt + produced) plus what it adds
  and the step's decode fit (an empty engine admits anything); ``kv_usage`` =
  held / capacity. With the prefix cache on, running requests share their prompts'
  common blocks as vLLM's do (one copy, counted once, freed with its last holder:
  ``hold_kv``), so a request adds only the blocks no running request holds, its
  last partial block and what it produces. When the next decode would not fit, the
  newest running request is preempted as vLLM's scheduler does (recompute): its KV
  freed, it goes back to the head of the queue and, admitted again, prefills its
  prompt and what it had produced (``preemptions`` counts them; a lone running
  request is never preempted);
- ``prefill_budget_tokens`` > 0 stops admitting in a step once its uncached
  prompt tokens would pass the budget (vLLM's max_num_batched_tokens, without
  chunking: the first request of a step is always admitted whole);
- a request's first token (its TTFT) is produced at the end of the step that
  admits (prefills) it;
- a request that reaches the engine waits in an input queue (``inbox``) until
  the next step begins: only then does the scheduler see it (``waiting``) and
  count it in ``admitted``. This is vLLM's timing: the engine core's input
  thread queues requests and the busy loop moves them into the scheduler
  between steps (``EngineCoreProc._process_input_queue`` before
  ``_process_engine_step``), so counts reported after a step do not include
  requests that arrived during it;
- ``admitted[c]`` counts requests received into the scheduler from API-server
  index c (cumulative), which the reporter sends so routers can reconcile
  exactly (the same moment as ``waiting`` counts them).

``SimEngine.step`` only advances state; the caller decides time (real time
against Redis, or a simulated clock for the scale projection) and whether
engines step in lockstep (one step lasts as long as the slowest engine's) or
independently.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from redisbal.routing.cache_view import BLOCK_TOKENS
from redisbal.sim.prefix_cache import PrefixCache


@dataclass(slots=True, eq=False)
class SimRequest:
    rid: int
    client_index: int
    output_len: int
    routed_at: float
    decision: object = None  # the router's Decision, handed back on finish
    arrived_at: float = 0.0
    started_at: float = -1.0
    finished_at: float = -1.0
    produced: int = 0
    engine_id: str = ""  # where the request was routed (set by the caller)
    group: int = -1  # burst index (or -1), for per-burst metrics
    lost: bool = False  # routed to an engine that was dead on arrival, or died with it
    prompt_tokens: int = 0
    blocks: tuple[int, ...] = ()  # chained hashes of the prompt's full 16-token blocks
    done_blocks: tuple[int, ...] = ()  # the same for prompt + output, cached at finish
    cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    first_token_at: float = -1.0
    preempted: int = 0  # times the engine preempted it (KV ran out)


@dataclass
class EngineParams:
    """Step-time and capacity parameters. The defaults (every token-level feature
    off) are what ``engine-sim``, ``demo`` and the real-time benchmark run with.

    Calibration of ``prefill_per_token_s`` for the quality benchmark: a
    1,000-token uncached prompt costs about one extra base step, 12 us a token
    (12 ms per 1,000), i.e. prefill runs about 80k tokens/s against 1 token per
    request per 12-15 ms of decode: the ratio (prefill some 100-1000x faster per
    token than decode per request) is what makes long uncached prompts matter
    for TTFT without dominating every step.
    """

    running_cap: int = 64
    base_step_s: float = 0.012
    per_seq_s: float = 0.00015
    prefill_s: float = 0.0004
    slow: float = 1.0
    prefill_per_token_s: float = 0.0  # per uncached prompt token admitted in the step
    kv_capacity_tokens: int = 0  # 0: KV not modelled (kv_usage None)
    cache_blocks: int = 0  # prefix cache capacity in blocks; 0: no prefix cache
    prefill_budget_tokens: int = 0  # 0: no per-step budget

    def step_time(self, running: int, admitted: int, uncached: int = 0) -> float:
        return (
            self.base_step_s
            + self.per_seq_s * running
            + self.prefill_s * admitted
            + self.prefill_per_token_s * uncached
        ) * self.slow


@dataclass
class SimEngine:
    engine_id: str
    params: EngineParams = field(default_factory=EngineParams)
    num_clients: int = 1
    waiting: deque[SimRequest] = field(default_factory=deque)
    inbox: deque[SimRequest] = field(default_factory=deque)  # arrived, not yet scheduled
    running: list[SimRequest] = field(default_factory=list)
    step_no: int = 0
    wave: int = 0
    tokens: int = 0  # tokens decoded so far (what vLLM's generation_tokens counter counts)
    admitted: list[int] = field(init=False)
    on_finish: Callable[[SimRequest], None] | None = None
    on_start: Callable[[SimRequest], None] | None = None
    cache: PrefixCache | None = field(init=False, default=None)
    kv_tokens: int = 0  # tokens held by running requests (prompt + produced)
    # the prompt blocks running requests hold -> how many hold each (prefix cache on)
    kv_blocks: dict[int, int] = field(default_factory=dict)
    prompt_tokens_seen: int = 0  # prompt tokens admitted so far
    cached_tokens_seen: int = 0  # of those, found in the prefix cache
    preemptions: int = 0  # running requests sent back to the queue (KV ran out)
    finished: int = 0  # requests that reached their output length (never an aborted one)

    def __post_init__(self) -> None:
        self.admitted = [0] * self.num_clients
        if self.params.cache_blocks > 0:
            self.cache = PrefixCache(self.params.cache_blocks)

    @property
    def kv_usage(self) -> float | None:
        """Tokens held by running requests / KV capacity (capped at 1); None when the
        KV cache is not modelled."""
        cap = self.params.kv_capacity_tokens
        return min(1.0, self.kv_tokens / cap) if cap > 0 else None

    @property
    def load(self) -> int:
        """Requests at the engine: input queue + waiting + running (for metrics and the
        oracle; the engine's own reported counts are ``waiting`` and ``running``)."""
        return len(self.inbox) + len(self.waiting) + len(self.running)

    def kv_need(self, req: SimRequest) -> int:
        """KV tokens ``req`` would add if it ran now: its prompt's blocks that no
        running request holds (all of them without the prefix cache), the rest of
        its prompt, and what it produced (a preempted request's)."""
        if self.cache is None or not req.blocks:
            return req.prompt_tokens + req.produced
        held = self.kv_blocks
        shared = sum(1 for b in req.blocks if b in held)
        return req.prompt_tokens - shared * BLOCK_TOKENS + req.produced

    def hold_kv(self, req: SimRequest) -> None:
        """``req`` runs: its KV is held, what ``kv_need`` says it adds (its prompt's
        blocks shared with the running requests that hold them)."""
        if self.cache is None or not req.blocks:
            self.kv_tokens += req.prompt_tokens + req.produced
            return
        held = self.kv_blocks
        add = req.prompt_tokens - len(req.blocks) * BLOCK_TOKENS + req.produced
        for b in req.blocks:
            n = held.get(b, 0)
            if not n:
                add += BLOCK_TOKENS
            held[b] = n + 1
        self.kv_tokens += add

    def free_kv(self, req: SimRequest) -> None:
        """``req`` stopped running (finished, preempted, aborted): its KV is freed, its
        prompt's blocks with their last holder."""
        own = req.prompt_tokens + req.produced
        if self.cache is not None and req.blocks:
            held = self.kv_blocks
            own -= len(req.blocks) * BLOCK_TOKENS
            for b in req.blocks:
                n = held[b] - 1
                if n:
                    held[b] = n
                else:
                    del held[b]
                    own += BLOCK_TOKENS
        self.kv_tokens -= own

    def arrive(self, req: SimRequest, now: float) -> None:
        """The request reached the engine: it waits in the input queue until the next
        step begins (``take_inbox``)."""
        req.arrived_at = now
        self.inbox.append(req)

    def take_inbox(self) -> int:
        """Move the input queue into the scheduler (between steps); returns how many."""
        inbox = self.inbox
        n = len(inbox)
        adm = self.admitted
        while inbox:
            req = inbox.popleft()
            ci = req.client_index
            if ci >= len(adm):
                adm.extend([0] * (ci + 1 - len(adm)))
            adm[ci] += 1
            self.waiting.append(req)
        return n

    def busy(self) -> bool:
        return bool(self.waiting or self.running or self.inbox)

    def plan(self) -> tuple[int, float]:
        """(requests this step would admit, its duration) without changing state."""
        free = self.params.running_cap - len(self.running)
        queued = len(self.waiting) + len(self.inbox)
        adm = min(free, queued) if free > 0 else 0
        return adm, self.params.step_time(len(self.running) + adm, adm)

    def begin_step(self, now: float) -> float:
        """Admit waiting requests into free slots at ``now`` (the scheduling half of a
        step) and return the step's own duration. Real-time drivers call this at the
        step's start and ``end_step`` at its end, so requests that arrive during the
        step wait for the next one, as in a real engine. The input queue is taken into
        the scheduler first (``take_inbox``)."""
        if self.inbox:
            self.take_inbox()
        p = self.params
        if p.kv_capacity_tokens > 0:
            self._preempt()
        free = p.running_cap - len(self.running)
        if p.kv_capacity_tokens <= 0 and p.prefill_budget_tokens <= 0 and self.cache is None:
            adm = min(free, len(self.waiting)) if free > 0 else 0
            for _ in range(adm):
                self._admit(self.waiting.popleft(), now, 0)
            return p.step_time(len(self.running), adm)
        return self._admit_tokens(now, free)

    def _preempt(self) -> None:
        """Preempt the newest running requests until this step's decode fits the KV
        capacity (one token more for each running request)."""
        running, cap = self.running, self.params.kv_capacity_tokens
        while len(running) > 1 and self.kv_tokens + len(running) > cap:
            req = running.pop()
            self.free_kv(req)
            req.preempted += 1
            self.preemptions += 1
            self.waiting.appendleft(req)

    def _admit(self, req: SimRequest, now: float, cached: int) -> None:
        if req.preempted:  # recomputed: what it produced is prefilled with its prompt
            self.hold_kv(req)
            self.running.append(req)
            return
        req.started_at = now
        req.cached_tokens = cached
        self.hold_kv(req)
        self.prompt_tokens_seen += req.prompt_tokens
        self.cached_tokens_seen += cached
        self.running.append(req)
        if self.on_start is not None:
            self.on_start(req)

    def _admit_tokens(self, now: float, free: int) -> float:
        """Admission with the token-level features: KV room, prefill budget, cache."""
        p = self.params
        waiting, cache = self.waiting, self.cache
        kv_cap = p.kv_capacity_tokens
        budget = p.prefill_budget_tokens
        adm = uncached = 0
        while free > 0 and waiting:
            req = waiting[0]
            need = req.prompt_tokens + req.produced  # (produced: a preempted request's)
            # room for it and for this step's decode (a token each, it included)
            kv = self.kv_tokens + len(self.running)
            if kv_cap > 0 and self.running and kv + self.kv_need(req) >= kv_cap:
                break
            cached = 0
            if cache is not None and req.blocks and not req.preempted:
                hit = cache.match(req.blocks) * BLOCK_TOKENS
                cached = max(0, min(hit, req.prompt_tokens - 1))  # the last token is computed
            new = need - cached  # (a preempted request computes all of it again)
            if budget > 0 and adm and uncached + new > budget:
                break
            waiting.popleft()
            if cache is not None and req.blocks and not req.preempted:
                cache.insert(req.blocks)
            self._admit(req, now, cached)
            adm += 1
            uncached += new
            free -= 1
        return p.step_time(len(self.running), adm, uncached)

    def end_step(self, end: float) -> int:
        """Decode one token for every running request (the compute half of a step);
        requests that reach their output length finish at ``end``. Returns how many
        finished."""
        still = []
        done = 0
        self.tokens += len(self.running)
        self.kv_tokens += len(self.running)
        for req in self.running:
            if req.produced == 0:
                req.first_token_at = end
            req.produced += 1
            if req.produced >= req.output_len:
                req.finished_at = end
                done += 1
                self.free_kv(req)
                if self.cache is not None and req.done_blocks:
                    self.cache.insert(req.done_blocks)
                if self.on_finish is not None:
                    self.on_finish(req)
            else:
                still.append(req)
        self.running = still
        self.step_no += 1
        self.finished += done
        return done

    @property
    def admitted_total(self) -> int:
        """What vLLM's plugin can count of the requests taken in: finished + waiting +
        running (the input queue not yet; an aborted request leaves waiting or running
        without reaching the finished count, so the total drifts low as vLLM's does)."""
        return self.finished + len(self.waiting) + len(self.running)

    def step(self, now: float, duration: float | None = None) -> float:
        """Run one whole step starting at ``now``; returns its duration (or uses
        ``duration``, the lockstep step time). Finished requests get finished_at =
        now + duration."""
        own = self.begin_step(now)
        dur = own if duration is None else duration
        self.end_step(now + dur)
        return dur


def output_length(
    rng: random.Random, mean: float = 40.0, sigma: float = 1.0, cap: int = 2000
) -> int:
    """Heavy-tailed output length (lognormal with the given mean), at least 1."""
    mu = math.log(mean) - sigma * sigma / 2
    return max(1, min(cap, int(rng.lognormvariate(mu, sigma))))
