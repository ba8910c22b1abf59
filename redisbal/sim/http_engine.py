"""Simulated engines served over OpenAI-compatible HTTP (tests, demos, benchmarks).

Engine i listens on ``BASE + i`` and serves ``POST /v1/completions`` and
``POST /v1/chat/completions`` (streamed as server-sent events at the model's
step pace, or whole), ``GET /v1/models``, ``GET /metrics`` in vLLM's Prometheus
names (``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
``vllm:kv_cache_usage_perc``, labelled ``model_name`` and ``engine``) and
``GET /sim/state`` (what the tests read: requests in flight at the engine).

Faults, for reliability tests (``FaultInjection``): ``POST /sim/fault`` sets them with a
JSON body; the engine's model and reports go on as if all were well, which is the
point: ``{"mode": "status", "status": 500}`` answers every generation request with that
status (429, 500, 503, or a 4xx: a rejection, 401/403 a refusing engine) before taking
it in; ``{"mode": "stall"}`` stops every stream and whole answer from sending (the
connection stays open); ``{"mode": "stall", "after": 3}`` lets each stream send its
first 3 chunks first (a stall mid-stream: a hung detokenizer or output loop);
``{"mode": "slow", "hold_s": 1.0}`` holds the process's event loop ``hold_s`` at a
time, with a moment between holds: it is alive and gets the CPU only now and then (a
front end starved of CPU, a long step of an engine that reports between steps), so its
reports, steps and answers all come at that pace; ``{"mode": "none"}`` ends the fault
(stalled answers flow again). A hung engine is SIGSTOP's. /sim/state counts requests
``served`` (finished by the model) and ``aborted`` (their client went away first).

Each engine is a ``SimEngine`` (redisbal.sim.model) stepping on its own clock
("tick" mode), reports through the real ``AsyncReporter`` and registers
its base URL in the deployment (redisbal.endpoints). The output length is the
model's heavy-tailed draw capped by ``max_tokens`` (exactly ``max_tokens`` with
vLLM's ``ignore_eos``). A request whose client goes away leaves the engine at
once, as vLLM aborts it. The gateway's API-server index arrives in the
``X-Redisbal-Client-Index`` header, so the engine's ``admitted`` counts are exact.
Stopping (SIGTERM) leaves the deployment first, answers new requests 503 (a
gateway retries them elsewhere) and keeps stepping until the requests it holds
are finished (at most ``drain_s``), as a draining vLLM server does.

A prompt counts 4 characters a token. With the model's token-level features on
(``EngineParams``: prefix cache, per-token prefill, KV budget) a request's prompt
blocks are the chained hashes of its text's 64-character chunks
(``prefix_cache.text_blocks``), and the blocks of prompt + answer text are cached
when it finishes, so a conversation's next turn (which repeats both) hits as in
the simulator. /sim/state and /metrics count prompt and cached tokens.

Run: ``redisbal engine-sim --engines 4 --http-port 8400``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
import signal
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web
from aiohttp.typedefs import Handler

from redisbal import endpoints
from redisbal.background import cancel_and_wait
from redisbal.connection import OUTAGE_ERRORS
from redisbal.errors import InvalidArgument
from redisbal.keys import check_name
from redisbal.reporting.reporter import AsyncReporter, Counts
from redisbal.routing.cache_view import CHARS_PER_TOKEN
from redisbal.routing.cache_view import prompt_text as _prompt_text
from redisbal.sim.engine_sim import EngineTally, SimStats
from redisbal.sim.kv_publisher import Publisher, PublishingCache, TextBlocks, offset_endpoint
from redisbal.sim.load_plan import output_text
from redisbal.sim.model import EngineParams, SimEngine, SimRequest, output_length
from redisbal.sim.peer_router_endpoints import add_peer_routes, sglang_metrics
from redisbal.sim.prefix_cache import text_blocks
from redisbal.sim.report_as import Feed

log = logging.getLogger("redisbal.sim.http_engine")

MAX_TOKENS_CAP = 32768
MAX_BODY = 4 * 1024 * 1024
CLIENT_HEADER = "X-Redisbal-Client-Index"


FAULT_MODES = ("none", "status", "stall", "slow")
HOLD_GAP_S = 0.05  # "slow": the moment between holds in which the loop runs


class FaultInjection:
    """One engine's fault: what it is now, and the gate its answers wait at."""

    def __init__(self) -> None:
        self.mode = "none"
        self.status = 500
        self.after = 0  # stall: the chunks each stream still sends first
        self.hold_s = 1.0  # "slow": how long each hold of the event loop lasts
        self._flowing = asyncio.Event()  # cleared while stalled
        self._flowing.set()

    def set(self, raw: bytes) -> str | None:
        """Apply a ``POST /sim/fault`` body; the reason it is refused, or None."""
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            return f"malformed JSON: {exc}"
        mode = body.get("mode") if isinstance(body, dict) else None
        status = body.get("status", 500) if isinstance(body, dict) else None
        after = body.get("after", 0) if isinstance(body, dict) else None
        if mode not in FAULT_MODES:
            return f"mode must be one of {', '.join(FAULT_MODES)}"
        if isinstance(after, bool) or not isinstance(after, int) or not 0 <= after <= 1 << 20:
            return "after must be a whole number of chunks, 0 or more"
        if after and mode != "stall":
            return "after goes with mode stall only"
        if mode == "status" and (
            isinstance(status, bool) or not isinstance(status, int) or not 400 <= status <= 599
        ):
            return "status must be a whole number in 400..599"
        hold = body.get("hold_s", 1.0)
        if mode == "slow" and (
            isinstance(hold, bool) or not isinstance(hold, int | float) or not 0 < hold <= 60
        ):
            return "hold_s must be a number of seconds in (0, 60]"
        self.mode, self.status, self.after = mode, int(status or 500), after
        if mode == "slow":
            self.hold_s = float(hold)
        if mode == "stall":
            self._flowing.clear()
        else:
            self._flowing.set()
        return None

    @property
    def rejection(self) -> int | None:
        """The status every generation request is answered with now, if any."""
        return self.status if self.mode == "status" else None

    def cap(self) -> int:
        """How many chunks a stream may have sent now (all, unless stalled after some)."""
        return self.after if self.mode == "stall" and self.after else MAX_TOKENS_CAP + 1

    async def flowing(self, sent: int | None = None) -> None:
        """Return once answers may be sent: at once unless stalled, or while a stream
        that has sent ``sent`` chunks is below a mid-stream stall's ``after``."""
        if sent is not None and self.mode == "stall" and sent < self.after:
            return
        await self._flowing.wait()


def _url_host(host: str) -> str:
    """A host as a URL holds it: an IPv6 address in brackets."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


@dataclass(eq=False)
class _Stream:
    """The HTTP side of one simulated request: woken after every step that touches it."""

    req: SimRequest
    event: asyncio.Event = field(default_factory=asyncio.Event)
    prompt_tokens: int = 0


def _error(status: int, message: str, kind: str = "invalid_request_error") -> web.Response:
    body = {"error": {"message": message, "type": kind, "code": status}, "object": "error"}
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


def _prompt_tokens(text: str) -> int:
    """A rough token count (4 characters a token), as the usage figures need."""
    return max(1, len(text) // CHARS_PER_TOKEN)


class HttpEngine:
    """One simulated engine: model, step loop, reporter and HTTP app."""

    def __init__(
        self,
        engine_id: str,
        *,
        redis_url: str | None,
        deployment: str,
        port: int,
        host: str = "127.0.0.1",
        advertise: str | None = None,
        params: EngineParams | None = None,
        model_name: str = "redisbal-sim",
        mean_output: float = 40.0,
        seed: int | None = None,
        api_key: str | None = None,
        report_as: str = "full",
        kv_events: str | None = None,
    ) -> None:
        self.engine_id = check_name(engine_id, "engine_id")
        self.feed = Feed.of(report_as)  # what it reports and serves (redisbal.sim.report_as)
        self.send_admitted = self.feed.admitted
        self.api_key = api_key  # like vLLM's --api-key: required on the /v1 paths
        self.model = SimEngine(self.engine_id, params or EngineParams(), num_clients=1)
        self.model.on_finish = self._on_finish
        self.kv_publisher: Publisher | None = None  # --kv-events: its cache publishes
        if kv_events is not None:
            if self.model.cache is None:
                raise InvalidArgument("--kv-events needs a prefix cache (--cache-blocks)")
            self.kv_publisher = Publisher(kv_events)
            self.model.cache = PublishingCache(self.model.cache.capacity, self.kv_publisher)
        self.redis_url = redis_url
        self.deployment = deployment
        self.port = port
        self.host = host
        self.advertise = advertise
        self.url = endpoints.check_url(f"http://{_url_host(advertise or host)}:{port or 1}")
        self.model_name = model_name
        self.mean_output = mean_output
        self.rng = random.Random(seed)
        self.reporter: AsyncReporter | None = None
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._url_task: asyncio.Task[None] | None = None
        self._runner: web.AppRunner | None = None
        self._rid = 0
        self.arrived = 0
        self.served = 0
        self.steps = 0
        self.step_planned_s = 0.0  # sum of the model's step times
        self.step_taken_s = 0.0  # sum of the steps' real durations (the loop overshoots)
        self.aborted = 0
        self.inflight = 0  # HTTP requests in progress at this engine
        self.draining = False  # stopping: new requests get a 503
        self.report_min_s = 0.002
        self._reported_at = 0.0
        self.faults = FaultInjection()  # POST /sim/fault
        self._hold: asyncio.Task[None] | None = None  # the "slow" fault's holds

    # -- model loop -----------------------------------------------------------------------------

    def _on_finish(self, req: SimRequest) -> None:
        self.served += 1

    def kv_usage(self) -> float | None:
        """The model's KV usage; None when it does not model KV (a slot count then
        bounds it, and a KV usage made up from the slots would read as a full cache)."""
        return self.model.kv_usage

    def _report(self, force: bool = False) -> None:
        """Queue the counts for the reporter; at most one report per ``report_min_s``
        (a fast-stepping engine would otherwise spend its core on reports), except when
        it goes idle: that report must not be skipped."""
        if self.reporter is None:
            return
        m = self.model
        now = time.monotonic()
        if not force and m.busy() and now - self._reported_at < self.report_min_s:
            return
        self._reported_at = now
        adm = m.admitted if self.send_admitted else None
        tot = m.admitted_total if self.feed.total else None
        w, r = len(m.waiting), len(m.running)
        counts = Counts(None, w, r, 0, self.kv_usage(), adm, admitted_total=tot)
        self.reporter.report_nowait(counts)

    async def _steps(self) -> None:
        loop = asyncio.get_running_loop()
        m = self.model
        while True:
            if not m.busy():
                self._wake.clear()
                await self._wake.wait()
            began = loop.time()
            dur = m.begin_step(began)
            self._report()  # counts after taking the input queue (vLLM reports then too)
            await asyncio.sleep(dur)
            stepped = list(m.running)
            m.end_step(loop.time())
            self.steps += 1  # the model's step times against what the host gave them
            self.step_planned_s += dur
            self.step_taken_s += loop.time() - began
            for req in stepped:
                st: _Stream = req.decision  # type: ignore[assignment]
                st.event.set()
            self._report()

    def _abort(self, req: SimRequest) -> None:
        m = self.model
        for q in (m.inbox, m.waiting):
            with contextlib.suppress(ValueError):
                q.remove(req)
        if req in m.running:
            m.running.remove(req)
            m.free_kv(req)
        self.aborted += 1
        self._report(force=True)

    # -- HTTP -----------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY, middlewares=[self._check_key])
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/health", self._health)
        app.router.add_get("/sim/state", self._state)
        app.router.add_post("/sim/fault", self._set_fault)
        add_peer_routes(app, self)  # what real engines serve to routers (peer_router_endpoints)
        return app

    @web.middleware
    async def _check_key(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if (
            self.api_key is not None
            and request.path.startswith("/v1")
            and request.headers.get("Authorization") != f"Bearer {self.api_key}"
        ):
            return _error(401, "Unauthorized")
        return await handler(request)

    async def _set_fault(self, request: web.Request) -> web.Response:
        refused = self.faults.set(await request.read())
        if refused is not None:
            return _error(400, refused)
        log.info("engine %s: fault %s", self.engine_id, self.faults.mode)
        if self.faults.mode == "slow" and (self._hold is None or self._hold.done()):
            self._hold = asyncio.get_running_loop().create_task(self._holds())
        return web.Response(
            body=orjson.dumps({"mode": self.faults.mode}), content_type="application/json"
        )

    async def _holds(self) -> None:
        """The "slow" fault: hold the event loop (the whole process) ``hold_s`` at a
        time, letting it run ``HOLD_GAP_S`` between holds, until the fault ends."""
        while self.faults.mode == "slow":
            time.sleep(self.faults.hold_s)  # on purpose: nothing else in the process runs
            await asyncio.sleep(HOLD_GAP_S)

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _state(self, request: web.Request) -> web.Response:
        m = self.model
        state = {
            "engine": self.engine_id,
            "inflight": self.inflight,
            "queued": len(m.inbox) + len(m.waiting),
            "running": len(m.running),
            "arrived": self.arrived,
            "served": self.served,
            "aborted": self.aborted,
            "admitted": list(m.admitted),
            "prompt_tokens": m.prompt_tokens_seen,
            "cached_tokens": m.cached_tokens_seen,
            "steps": self.steps,
            "step_planned_s": round(self.step_planned_s, 6),
            "step_taken_s": round(self.step_taken_s, 6),
        }
        return web.Response(body=orjson.dumps(state), content_type="application/json")

    async def _models(self, request: web.Request) -> web.Response:
        data = {
            "object": "list",
            "data": [
                {"id": self.model_name, "object": "model", "created": 0, "owned_by": "redisbal"}
            ],
        }
        return web.Response(body=orjson.dumps(data), content_type="application/json")

    async def _metrics(self, request: web.Request) -> web.Response:
        if self.feed.serves_loads:  # reports as SGLang: its page (peer_router_endpoints)
            return sglang_metrics(self)
        m = self.model
        labels = f'engine="{self.engine_id}",model_name="{self.model_name}"'
        kv = self.kv_usage() or 0.0  # (vLLM always exports one)
        rows = [
            (
                "num_requests_running",
                "Number of requests in model execution batches.",
                len(m.running),
            ),
            (
                "num_requests_waiting",
                "Number of requests waiting to be processed.",
                len(m.waiting) + len(m.inbox),
            ),
            ("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", kv),
        ]
        out = []
        for name, doc, value in rows:
            out += [
                f"# HELP vllm:{name} {doc}",
                f"# TYPE vllm:{name} gauge",
                f"vllm:{name}{{{labels}}} {float(value)}",
            ]
        out += [
            "# HELP vllm:generation_tokens Number of generation tokens processed.",
            "# TYPE vllm:generation_tokens counter",
            f"vllm:generation_tokens_total{{{labels}}} {float(m.tokens)}",
            "# HELP vllm:request_success Count of successfully processed requests.",
            "# TYPE vllm:request_success counter",  # (an aborted one never finished)
            f'vllm:request_success_total{{{labels},finished_reason="stop"}} {float(m.finished)}',
        ]
        for name, doc, value in (  # vLLM's prefix-cache counters count tokens
            ("prefix_cache_queries", "Prefix cache queries, in tokens.", m.prompt_tokens_seen),
            ("prefix_cache_hits", "Prefix cache hits, in tokens.", m.cached_tokens_seen),
        ):
            out += [
                f"# HELP vllm:{name} {doc}",
                f"# TYPE vllm:{name} counter",
                f"vllm:{name}_total{{{labels}}} {float(value)}",
            ]
        return web.Response(text="\n".join(out) + "\n", content_type="text/plain")

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    def _parse(self, body: Any, chat: bool) -> tuple[int, bool, bool, str] | web.Response:
        if not isinstance(body, dict):
            return _error(400, "the body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.model_name:
            return _error(404, f"The model `{model}` does not exist.", "NotFoundError")
        if chat and not isinstance(body.get("messages"), list):
            return _error(400, "messages: a list of messages is required")
        if not chat and not isinstance(body.get("prompt", ""), str | list):
            return _error(400, "prompt: a string or a list is required")
        mt = body.get("max_completion_tokens") if chat else None
        mt = body.get("max_tokens") if mt is None else mt
        if mt is None:
            mt = MAX_TOKENS_CAP if chat else 16  # vLLM's completions default is 16
        if isinstance(mt, bool) or not isinstance(mt, int) or not 1 <= mt <= MAX_TOKENS_CAP:
            return _error(400, f"max_tokens must be a whole number in 1..{MAX_TOKENS_CAP}")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            return _error(400, "stream must be true or false")
        opts = body.get("stream_options")
        usage = isinstance(opts, dict) and opts.get("include_usage") is True
        natural = (
            mt if body.get("ignore_eos") is True else output_length(self.rng, self.mean_output)
        )
        return min(mt, natural), stream, usage, "length" if natural >= mt else "stop"

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        if self.draining:
            return _error(503, f"engine {self.engine_id} is shutting down", "unavailable")
        status = self.faults.rejection
        if status is not None:
            return _error(status, f"engine {self.engine_id}: injected fault {status}", "fault")
        try:
            body = orjson.loads(await request.read())
        except web.HTTPRequestEntityTooLarge:
            return _error(413, f"the body exceeds {MAX_BODY} bytes")
        except orjson.JSONDecodeError as exc:
            return _error(400, f"malformed JSON: {exc}")
        parsed = self._parse(body, chat)
        if isinstance(parsed, web.Response):
            return parsed
        n_out, stream, include_usage, reason = parsed
        try:
            ci = int(request.headers.get(CLIENT_HEADER, "0"))
        except ValueError:
            ci = 0
        ci = ci if 0 <= ci < 4096 else 0
        loop = asyncio.get_running_loop()
        self._rid += 1
        text = _prompt_text(body, chat)
        req = SimRequest(self._rid, ci, n_out, loop.time(), engine_id=self.engine_id)
        req.prompt_tokens = _prompt_tokens(text)
        if self.model.cache is not None:  # the prompt's blocks, and with the answer's
            req.blocks = text_blocks(text)
            req.done_blocks = text_blocks(text + output_text(n_out))
            if self.kv_publisher is not None:  # what the cache stores goes out with tokens
                req.blocks = TextBlocks(req.blocks, text)
                req.done_blocks = TextBlocks(req.done_blocks, text + output_text(n_out))
        st = _Stream(req, prompt_tokens=req.prompt_tokens)
        req.decision = st
        self.inflight += 1
        self.arrived += 1
        finished = False
        try:
            self.model.arrive(req, loop.time())
            self._wake.set()
            rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:16]}"
            if not stream:
                while req.finished_at < 0:
                    await st.event.wait()
                    st.event.clear()
                await self.faults.flowing()
                finished = True
                return web.Response(
                    body=orjson.dumps(self._whole(rid, chat, st, reason)),
                    content_type="application/json",
                )
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            resp.headers["Cache-Control"] = "no-cache"
            await resp.prepare(request)
            sent = 0
            while True:
                if sent >= req.produced and req.finished_at < 0:  # nothing new to send
                    await st.event.wait()
                    st.event.clear()
                await self.faults.flowing(sent)
                chunks = []
                while sent < min(req.produced, self.faults.cap()):
                    last = sent + 1 == req.produced and req.finished_at >= 0
                    chunks.append(self._chunk(rid, chat, sent, reason if last else None))
                    sent += 1
                if req.finished_at >= 0 and sent == req.produced:
                    if include_usage:
                        chunks.append(self._usage_chunk(rid, chat, st))
                    chunks.append(b"data: [DONE]\n\n")
                    finished = True
                if chunks:
                    await resp.write(b"".join(chunks))
                if finished:
                    break
            await resp.write_eof()
            return resp
        except ConnectionResetError:  # (aiohttp's ClientConnectionResetError too)
            # the client went away mid-answer: nobody reads this; aiohttp drops it quietly
            return web.Response(status=499)
        finally:
            self.inflight -= 1
            if not finished:  # the client went away (or the write failed): abort
                self._abort(req)

    def _base(self, rid: str, chat: bool) -> dict[str, Any]:
        kind = "chat.completion" if chat else "text_completion"
        return {"id": rid, "object": kind, "created": int(time.time()), "model": self.model_name}

    def _usage(self, st: _Stream) -> dict[str, int]:
        n = st.req.produced
        return {
            "prompt_tokens": st.prompt_tokens,
            "completion_tokens": n,
            "total_tokens": st.prompt_tokens + n,
        }

    def _whole(self, rid: str, chat: bool, st: _Stream, reason: str) -> dict[str, Any]:
        text = output_text(st.req.produced)
        d = self._base(rid, chat)
        if chat:
            choice: dict[str, Any] = {
                "index": 0,
                "finish_reason": reason,
                "message": {"role": "assistant", "content": text},
            }
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        d["choices"] = [choice]
        d["usage"] = self._usage(st)
        return d

    def _chunk(self, rid: str, chat: bool, i: int, reason: str | None) -> bytes:
        d = self._base(rid, chat)
        if chat:
            d["object"] = "chat.completion.chunk"
            delta: dict[str, Any] = {"content": f" t{i}"}
            if i == 0:
                delta["role"] = "assistant"
            d["choices"] = [{"index": 0, "delta": delta, "finish_reason": reason}]
        else:
            d["choices"] = [
                {"index": 0, "text": f" t{i}", "logprobs": None, "finish_reason": reason}
            ]
        return b"data: " + orjson.dumps(d) + b"\n\n"

    def _usage_chunk(self, rid: str, chat: bool, st: _Stream) -> bytes:
        d = self._base(rid, chat)
        if chat:
            d["object"] = "chat.completion.chunk"
        d["choices"] = []
        d["usage"] = self._usage(st)
        return b"data: " + orjson.dumps(d) + b"\n\n"

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        self._runner = web.AppRunner(
            self.app(), handler_cancellation=True, access_log=None, shutdown_timeout=1.0
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, backlog=1024)
        await site.start()
        if self.port == 0:  # an ephemeral port (tests): advertise the one bound
            self.port = self._runner.addresses[0][1]
            self.url = endpoints.check_url(
                f"http://{_url_host(self.advertise or self.host)}:{self.port}"
            )
        self._task = asyncio.get_running_loop().create_task(self._steps())
        if self.redis_url:
            cap = self.model.params.running_cap if self.feed.declares_cap else None
            self.reporter = AsyncReporter(
                self.redis_url, self.deployment, self.engine_id, mode="tick", running_cap=cap
            )
            await self.reporter.register()
            with contextlib.suppress(*OUTAGE_ERRORS):
                await endpoints.register(
                    self.reporter.client, self.reporter.keys, self.engine_id, self.url
                )
            self._report()
            self._url_task = asyncio.get_running_loop().create_task(self._keep_url())
        log.info("engine %s serving %s", self.engine_id, self.url)

    async def _keep_url(self, every_s: float = 2.0) -> None:
        """Re-register the URL now and then: a Redis that restarted empty lost it."""
        assert self.reporter is not None
        while True:
            await asyncio.sleep(every_s)
            with contextlib.suppress(*OUTAGE_ERRORS):
                await endpoints.register(
                    self.reporter.client, self.reporter.keys, self.engine_id, self.url
                )

    async def stop(self, drain_s: float = 30.0) -> None:
        """Leave, refuse new requests, finish the ones in progress (their streams would
        otherwise hang until aiohttp's 60 s shutdown timeout cut them), then close."""
        self.draining = True
        await cancel_and_wait(self._hold)
        await cancel_and_wait(self._url_task)  # (it sits in Redis calls)
        if self.reporter is not None:
            reporter, self.reporter = self.reporter, None  # the steps below report nothing
            with contextlib.suppress(Exception):
                await endpoints.unregister(reporter.client, reporter.keys, self.engine_id)
            await reporter.aclose(leave=True)
        deadline = time.monotonic() + drain_s
        while self.inflight and self._task is not None and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._runner is not None:
            await self._runner.cleanup()
        if self.kv_publisher is not None:
            self.kv_publisher.close()


async def serve_engines(
    ids: list[str],
    *,
    redis_url: str | None,
    deployment: str,
    port_base: int,
    host: str = "127.0.0.1",
    advertise: str | None = None,
    params: EngineParams | None = None,
    slow: dict[str, float] | None = None,
    model_name: str = "redisbal-sim",
    mean_output: float = 40.0,
    seed: int | None = None,
    duration: float | None = None,
    sample_s: float = 0.01,
    report_as: str = "full",
    kv_events: str | None = None,
) -> SimStats:
    """Serve engine ``ids[k]`` on ``port_base + k`` (every engine on a port of its own
    choosing when ``port_base`` is 0) until SIGTERM/SIGINT (or ``duration`` seconds), then
    leave the deployment. Returns the run's per-engine figures, sampled every
    ``sample_s``. Without ``redis_url`` the engines only serve: something else (a
    /metrics sidecar) reports them. ``kv_events``: engine k publishes its KV-cache
    events on that endpoint's port + k (``sim.kv_publisher``)."""
    base = params or EngineParams()
    slow = slow or {}
    unknown = sorted(set(slow) - set(ids))
    if unknown:
        raise InvalidArgument(f"--slow names engines this process does not run: {unknown}")
    engines = [
        HttpEngine(
            engine_id,
            redis_url=redis_url,
            deployment=deployment,
            port=0 if port_base == 0 else port_base + k,
            host=host,
            advertise=advertise,
            params=dataclasses.replace(base, slow=base.slow * slow.get(engine_id, 1.0)),
            model_name=model_name,
            mean_output=mean_output,
            seed=None if seed is None else seed + k,
            report_as=report_as,
            kv_events=None if kv_events is None else offset_endpoint(kv_events, k),
        )
        for k, engine_id in enumerate(ids)
    ]
    stats = SimStats(mode="tick")
    for e in engines:
        stats.engines[e.engine_id] = EngineTally(e.engine_id, slow=e.model.params.slow)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    for e in engines:
        await e.start()
    print(f"http engines ready: {' '.join(e.url for e in engines)}", flush=True)
    models = [e.model for e in engines]
    end = None if duration is None else loop.time() + duration
    while not stop.is_set() and (end is None or loop.time() < end):
        stats.sample(models, loop.time())
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), sample_s)
    stats.sample(models, loop.time())
    await asyncio.gather(*(e.stop() for e in engines))  # drain them side by side
    for e in engines:
        tally = stats.engines[e.engine_id]
        tally.assigned, tally.served = e.arrived, e.served
    return stats
