"""Following one request through the gateway: its W3C trace (continued from the client,
passed on to the engine, exported over OTLP/HTTP to a real receiver), its request id
(client -> gateway -> engine -> client) and its one access-log line, whatever
happened to it. Real engine-sim HTTP engines on a real redis-server, the openai client."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from aiohttp import web
from support.cli import scrubbed_env
from support.gateway_stack import FAST, MODEL, start_gateway, stop_gateway
from support.helpers import await_until
from support.otlp_receiver import OtlpReceiver, Span

from redisbal.gateway.access import ApiKeys
from redisbal.gateway.accesslog import AccessLog, request_id, usage_tokens
from redisbal.gateway.server import Gateway
from redisbal.gateway.tracing import Tracing, traces_endpoint
from redisbal.sim.http_engine import HttpEngine
from redisbal.sim.model import EngineParams

# 2 engines of 2 slots; a request of 8 tokens takes 8 steps of 10 ms
pytestmark = pytest.mark.gateway  # .ci/run runs these on the lowest aiohttp too

SLOW = EngineParams(running_cap=2, base_step_s=0.01, per_seq_s=0.0, prefill_s=0.0)
KEY = "sk-test-key"


class SeeingEngine(HttpEngine):
    """An engine-sim engine that keeps the headers of each generation request."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.seen: list[dict[str, str]] = []

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        self.seen.append({k.lower(): v for k, v in request.headers.items()})
        return await super()._generate(request, chat)


@dataclass
class Traced:
    gw: Gateway
    engines: list[SeeingEngine]
    receiver: OtlpReceiver
    client: openai.AsyncOpenAI
    lines: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.gw.ports[0]}"

    async def spans(self) -> list[Span]:
        assert self.gw.tracing is not None
        assert await asyncio.to_thread(self.gw.tracing.flush)
        return self.receiver.spans

    def logged(self) -> dict[str, dict[str, Any]]:
        """The access log's lines by request id (each id once)."""
        out: dict[str, dict[str, Any]] = {}
        for line in self.lines:
            rec = json.loads(line)
            assert rec["id"] not in out, f"two lines for {rec['id']}: {self.lines}"
            out[rec["id"]] = rec
        return out

    def seen(self, rid: str) -> list[tuple[str, dict[str, str]]]:
        """(engine id, headers) of every engine request with this request id."""
        return [
            (e.engine_id, h) for e in self.engines for h in e.seen if h.get("x-request-id") == rid
        ]


@contextlib.asynccontextmanager
async def traced(
    redis_url: str,
    deployment: str,
    *,
    params: EngineParams = FAST,
    hold_s: float | None = None,
    tracing: bool = True,
    access_log: bool = True,
    **gw_kw: Any,
) -> AsyncIterator[Traced]:
    """Two engines behind a gateway that traces to a receiver of the test's and writes
    its access log (JSON) to a list."""
    receiver = OtlpReceiver()
    await receiver.start()
    engines = [
        SeeingEngine(str(i), redis_url=redis_url, deployment=deployment, port=0, params=params)
        for i in range(2)
    ]
    for e in engines:
        await e.start()
    lines: list[str] = []
    gw = None
    try:
        gw = await start_gateway(
            redis_url,
            deployment,
            hold_s=hold_s,
            tracing=Tracing(traces_endpoint(receiver.url), resource={"redisbal.policy": "redisbal"})
            if tracing
            else None,
            access_log=AccessLog("json", sink=lines.append) if access_log else None,
            **gw_kw,
        )
        await await_until(lambda: len(gw.live_engines()) == 2)
        key = KEY if gw_kw.get("api_keys") else "x"
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{gw.ports[0]}/v1", api_key=key, max_retries=0
        )
        yield Traced(gw, engines, receiver, client, lines)
        await client.close()
    finally:
        if gw is not None:
            await stop_gateway(gw)
        for e in engines:
            await e.stop()
        await receiver.stop()


async def _stream(client: openai.AsyncOpenAI, rid: str, max_tokens: int = 8) -> str:
    out = []
    stream = await client.completions.create(
        model=MODEL,
        prompt=f"req {rid}",
        max_tokens=max_tokens,
        stream=True,
        extra_body={"ignore_eos": True},
        extra_headers={"X-Request-Id": rid},
    )
    async for chunk in stream:
        out.append(chunk.choices[0].text if chunk.choices else "")
    return "".join(out)


def _parent(traceparent: str) -> tuple[str, str]:
    """(trace id, parent span id) of a sampled W3C traceparent."""
    version, trace_id, span_id, flags = traceparent.split("-")
    assert version == "00" and int(flags, 16) & 1, traceparent  # sampled
    return trace_id, span_id


def _children(spans: list[Span], root: Span, name: str) -> list[Span]:
    kids = [s for s in spans if s.parent == root.span_id and s.name == name]
    return sorted(kids, key=lambda s: s.start_ns)


async def test_a_held_request_retried_after_a_500_shows_each_step_in_its_trace(
    redis_url: str, deployment: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "redisbal.gateway")
    async with traced(redis_url, deployment, params=SLOW, hold_s=5.0) as t:
        router = t.gw.router
        adm = router.admission
        assert adm is not None
        # a first wave teaches the running cap (the queues it leaves at the engines)
        await asyncio.gather(*(_stream(t.client, f"warm-{k}") for k in range(12)))
        await await_until(lambda: router.core.running_cap == 2)
        ids = [f"wave-{k}" for k in range(12)]
        before = sum(e.arrived for e in t.engines)
        tasks = [asyncio.ensure_future(_stream(t.client, rid)) for rid in ids]
        # every slot taken, the rest held: each request of the wave at an engine or held,
        # so that what engine 1 gets from now on are held requests released to it (a
        # probe of it once it fails is a copy: no request of the wave)
        await await_until(
            lambda: adm.held > 0 and sum(e.arrived for e in t.engines) - before + adm.held >= 12
        )
        t.engines[1].faults.set(b'{"mode": "status", "status": 500}')  # engine 1 now fails
        assert all(await asyncio.gather(*tasks))  # every one served all the same
        spans = await t.spans()
        logged = t.logged()

    # a request both held and retried: its trace has every step, in order
    both = [
        rid
        for rid in ids
        if logged[rid]["retries"] >= 1 and logged[rid]["hold_ms"] > 0 and rid in logged
    ]
    assert both, {rid: (logged[rid]["retries"], logged[rid]["hold_ms"]) for rid in ids}
    rid = both[0]
    line = logged[rid]
    [root] = [s for s in spans if s.kind == 2 and s.attrs.get("redisbal.request_id") == rid]
    assert root.parent == ""  # no traceparent from the client: the trace starts here
    assert line["trace_id"] == root.trace_id
    assert root.name == "POST /v1/completions"
    assert root.service == "redisbal-gateway"
    assert root.resource["redisbal.policy"] == "redisbal"  # (once per batch, not per span)
    assert root.attrs["http.response.status_code"] == 200
    assert root.attrs["redisbal.outcome"] == "ok" == line["outcome"]
    assert root.attrs["redisbal.retries"] == line["retries"] >= 1
    assert root.attrs["gen_ai.request.model"] == MODEL
    assert root.attrs["redisbal.engine"] == "0" == line["engine"]
    [hold] = _children(spans, root, "redisbal.hold")
    assert hold.attrs["redisbal.hold.seconds"] > 0
    assert hold.attrs["redisbal.hold.reason"] == "every engine at its running cap"
    assert hold.attrs["redisbal.hold.timed_out"] is False
    names = [name for name, _ in root.events]
    # its events in order: routed to engine 1, which answered 500; retried; routed to 0,
    # whose first byte came
    assert [n for n in names if n != "retry"][:3] == ["attempt", "attempt_end", "attempt"]
    attempts = [a for name, a in root.events if name == "attempt"]
    assert len(attempts) == line["retries"] + 1
    first, last = attempts[0], attempts[-1]
    assert hold.end_ns <= root.event_ns[names.index("attempt")]  # held, then routed
    assert first["redisbal.attempt"] == 1 and first["redisbal.engine"] == "1"
    assert "redisbal.key" not in first  # (no key: none said)
    assert first["redisbal.snapshot.age_s"] >= 0
    assert {"redisbal.engine.pending", "redisbal.engine.running"} <= set(first)
    assert "redisbal.pinned" not in first  # flags only when set
    failed = dict(root.events)["attempt_end"]
    assert failed["redisbal.attempt"] == 1 and failed["redisbal.engine"] == "1"
    assert failed["http.response.status_code"] == 500 and failed["redisbal.outcome"] == "5xx"
    retry = [a for name, a in root.events if name == "retry"]
    assert retry[0] == {
        "redisbal.engine": "1",
        "redisbal.retry.reason": "5xx",
        "redisbal.retry.again": True,
        "redisbal.retry.budget_refused": False,
    }
    assert last["redisbal.attempt"] == len(attempts) and last["redisbal.engine"] == "0"
    assert names[-1] == "first_byte"
    assert line["ttft_ms"] is not None and line["ttft_ms"] >= line["hold_ms"]
    assert line["tokens"] is None and line["chunks"] >= 8  # a stream: its events counted
    # the gateway's log line about it names it
    assert any(
        r.getMessage().startswith(f"gateway: request {rid}: engine 1 failed")
        for r in caplog.records
    )
    # each engine request named the request's span as its parent: an engine that traces
    # puts its spans under it
    parents = {eid: _parent(h["traceparent"]) for eid, h in t.seen(rid)}
    assert parents == {"1": (root.trace_id, root.span_id), "0": (root.trace_id, root.span_id)}


async def test_the_clients_trace_and_request_id_go_to_the_engine_and_back(
    redis_url: str, deployment: str
) -> None:
    tid, sid = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    async with traced(redis_url, deployment) as t:
        raw = await t.client.completions.with_raw_response.create(
            model=MODEL,
            prompt="hello",
            max_tokens=5,
            extra_body={"ignore_eos": True},
            extra_headers={
                "traceparent": f"00-{tid}-{sid}-01",
                "tracestate": "vendor=opaque",
                "X-Request-Id": "req-42.a:b",
                "X-Redisbal-Key": "session-1",
            },
        )
        assert raw.headers["x-request-id"] == "req-42.a:b"
        assert raw.parse().usage.completion_tokens == 5
        # ids that are not safe (a space, too long) are replaced; none: one is made
        made = []
        for given in ("has space", "x" * 129, None):
            extra = {} if given is None else {"X-Request-Id": given}
            r = await t.client.completions.with_raw_response.create(
                model=MODEL, prompt="hi", max_tokens=2, extra_headers=extra
            )
            made.append(r.headers["x-request-id"])
        spans = await t.spans()
        logged = t.logged()

    [root] = [s for s in t.receiver.trace(tid) if s.kind == 2]
    assert root.parent == sid  # the client's span is its parent: the trace continued
    assert root.attrs["redisbal.request_id"] == "req-42.a:b"
    assert root.attrs["gen_ai.usage.output_tokens"] == 5
    [(name, route)] = root.events  # whole: no first_byte event
    assert name == "attempt" and route["redisbal.key"] == "given"
    assert "session-1" not in str(root.attrs) + str(route)  # the key itself: never
    [(_, seen)] = t.seen("req-42.a:b")  # the engine got the id (vLLM's request id)
    assert _parent(seen["traceparent"]) == (tid, root.span_id)
    assert seen["tracestate"] == "vendor=opaque"
    line = logged["req-42.a:b"]
    assert line["trace_id"] == tid and line["tokens"] == 5 and line["outcome"] == "ok"
    assert line["stream"] is False and line["chunks"] is None and line["ttft_ms"] is None
    for rid in made:
        assert len(rid) == 32 and int(rid, 16) >= 0
        assert rid in logged and len(t.seen(rid)) == 1
        [r] = [s for s in spans if s.kind == 2 and s.attrs["redisbal.request_id"] == rid]
        assert r.parent == ""
    assert len(set(made)) == 3
    assert set(logged) == {"req-42.a:b", *made}


async def test_access_log_has_one_line_per_request_whatever_happens(
    redis_url: str, deployment: str
) -> None:
    """Each request with an id of its own; the log's status and outcome for each id
    are what its client saw, including a client that left mid-stream."""
    got: dict[str, tuple[int, str]] = {}  # id -> (status the client saw, outcome expected)
    async with (
        traced(redis_url, deployment, api_keys=ApiKeys([KEY]), max_body=4096) as t,
        aiohttp.ClientSession() as http,
    ):
        auth = {"Authorization": f"Bearer {KEY}"}
        c = await t.client.completions.create(
            model=MODEL, prompt="a", max_tokens=3, extra_headers={"X-Request-Id": "whole"}
        )
        got["whole"] = (200, "ok") if c.choices[0].text else (0, "")
        assert c.usage is not None
        whole_tokens = c.usage.completion_tokens  # (the simulator may end before max_tokens)
        got["stream"] = (200, "ok") if await _stream(t.client, "stream") else (0, "")
        # a client that leaves mid-stream
        body = {"model": MODEL, "prompt": "a", "max_tokens": 2000, "ignore_eos": True}
        r = await http.post(
            t.url + "/v1/completions",
            json={**body, "stream": True},
            headers={**auth, "X-Request-Id": "gone"},
        )
        assert r.headers["X-Request-Id"] == "gone"
        await r.content.readuntil(b"\n\n")
        r.close()
        got["gone"] = (200, "client_disconnect")
        # a client that leaves while its body is on its way (nothing answered: 499)
        _, writer = await asyncio.open_connection("127.0.0.1", t.gw.ports[0])
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
            + b"\r\nX-Request-Id: partial\r\nContent-Type: application/json\r\n"
            + b"Content-Length: 100\r\n\r\n{\"model\": "
        )  # fmt: skip
        await writer.drain()
        await asyncio.sleep(0.2)
        writer.close()
        got["partial"] = (499, "client_disconnect")
        await await_until(lambda: len(t.lines) == 4)
        # refused at the gateway: no key, a body too large, malformed JSON
        for rid, headers, data, status in (
            ("nokey", {}, orjson.dumps(body), 401),
            ("large", auth, orjson.dumps({**body, "prompt": "x" * 5000}), 413),
            ("badjson", auth, b"{nope", 400),
        ):
            async with http.post(
                t.url + "/v1/completions",
                data=data,
                headers={**headers, "X-Request-Id": rid, "Content-Type": "application/json"},
            ) as r:
                assert r.headers["X-Request-Id"] == rid
                assert r.status == status
                got[rid] = (r.status, "refused")
        # the engines refuse it (passed on), then fail it (retried, then given up)
        for rid, status, outcome in (("engine400", 400, "rejected"), ("engine500", 500, "failed")):
            for e in t.engines:
                e.faults.set(orjson.dumps({"mode": "status", "status": status}))
            with pytest.raises(openai.APIStatusError) as err:
                await t.client.completions.create(
                    model=MODEL, prompt="a", max_tokens=3, extra_headers={"X-Request-Id": rid}
                )
            assert err.value.response.headers["x-request-id"] == rid
            got[rid] = (err.value.status_code, outcome)
        await await_until(lambda: len(t.lines) == len(got))
        await asyncio.sleep(0.2)  # (nothing more comes)
        spans = await t.spans()
        logged = t.logged()

    assert set(logged) == set(got)
    assert {rid: (line["status"], line["outcome"]) for rid, line in logged.items()} == got
    assert logged["nokey"]["error"] == "unauthorized"
    assert logged["large"]["error"] == "too_large"
    assert logged["badjson"]["error"] == "bad_request"
    assert logged["engine400"]["engine"] in ("0", "1") and logged["engine400"]["retries"] == 0
    assert logged["engine500"]["error"] == "5xx" and logged["engine500"]["retries"] == 1
    assert logged["gone"]["engine"] in ("0", "1") and logged["gone"]["chunks"] >= 1
    assert logged["whole"]["tokens"] == whole_tokens
    for line in logged.values():  # nothing secret: the key appears nowhere
        assert KEY not in json.dumps(line)
    # a trace for each request but the one no key was given for
    roots = {s.attrs["redisbal.request_id"]: s for s in spans if s.kind == 2}
    assert set(roots) == set(got) - {"nokey"}
    assert roots["partial"].attrs["http.response.status_code"] == 499
    assert {rid: s.attrs["redisbal.outcome"] for rid, s in roots.items()} == {
        rid: line["outcome"] for rid, line in logged.items() if rid != "nokey"
    }
    assert roots["engine500"].error and not roots["engine400"].error


async def test_untraced_the_clients_context_passes_through_and_no_record_is_made(
    redis_url: str, deployment: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Neither tracing nor an access log: nothing per request but the id (the proxy
    makes no Record), and the client's trace context reaches the engine unchanged."""
    import redisbal.gateway.proxy as proxy

    def no_record(*a: Any, **kw: Any) -> None:
        raise AssertionError("a Record made without tracing or an access log")

    monkeypatch.setattr(proxy, "Record", no_record)
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    async with traced(redis_url, deployment, tracing=False, access_log=False) as t:
        raw = await t.client.completions.with_raw_response.create(
            model=MODEL,
            prompt="a",
            max_tokens=2,
            extra_headers={"traceparent": parent, "X-Request-Id": "plain"},
        )
        assert raw.headers["x-request-id"] == "plain"
        assert await _stream(t.client, "plain-stream")
        [(_, seen)] = t.seen("plain")
        assert seen["traceparent"] == parent
        assert "tracestate" not in seen
        assert t.receiver.requests == 0


async def test_sampled_out_requests_export_nothing_and_keep_their_ids(
    redis_url: str, deployment: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0")
    async with traced(redis_url, deployment) as t:
        raw = await t.client.completions.with_raw_response.create(
            model=MODEL, prompt="a", max_tokens=2, extra_headers={"X-Request-Id": "unsampled"}
        )
        assert raw.headers["x-request-id"] == "unsampled"
        assert await t.spans() == []
        [(_, seen)] = t.seen("unsampled")
        assert int(seen["traceparent"][-2:], 16) & 1 == 0  # the engine is told: not sampled
        assert "trace_id" not in t.logged()["unsampled"]


def test_request_ids_and_usage() -> None:
    assert request_id("abc-DEF_1.2:3/4+5=6@7") == "abc-DEF_1.2:3/4+5=6@7"
    for bad in ("", "a b", "a\tb", "é", "x" * 129, 'a"b', "a\\b"):
        made = request_id(bad)
        assert made != bad and len(made) == 32
    assert request_id("x" * 128) == "x" * 128
    assert usage_tokens(b'{"usage": {"prompt_tokens": 3, "completion_tokens": 17}}') == 17
    assert usage_tokens(b'{"choices": []}') is None


def test_text_lines_quote_what_needs_it() -> None:
    from redisbal.gateway.accesslog import Record

    lines: list[str] = []
    log = AccessLog("text", sink=lines.append)
    rec = Record("r1", "POST", "/v1/completions", "127.0.0.1")
    rec.model, rec.status, rec.kind = 'my "model" x=1', 200, "ok"
    log.write(rec)
    [line] = lines
    assert ' access id=r1 method=POST path=/v1/completions model="my \\"model\\" x=1" ' in line
    assert " status=200 outcome=ok error=- " in line


def _gateway_cli(*args: str, block: bool = False) -> subprocess.CompletedProcess[str]:
    code = "import sys\n"
    if block:  # as without the tracing extra installed
        code += "sys.modules['opentelemetry'] = None\n"
    code += "from redisbal.ops.cli import main\nsys.argv[0] = 'redisbal'\nmain()\n"
    return subprocess.run(
        [sys.executable, "-c", code, "gateway", *args, "--redis-url", "redis://127.0.0.1:1"],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_tracing_without_its_extra_or_with_a_grpc_endpoint_is_a_one_line_error() -> None:
    done = _gateway_cli("--otlp-traces-endpoint", "http://127.0.0.1:4318", block=True)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    [line] = done.stderr.strip().splitlines()
    assert "'tracing' extra" in line and "pip install 'redisbal[tracing]'" in line
    done = _gateway_cli("--otlp-traces-endpoint", "grpc://127.0.0.1:4317")
    assert done.returncode == 2 and "not gRPC" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_the_gateway_imports_no_tracing_sdk_until_asked() -> None:
    # (redis-py imports the OpenTelemetry API when it is installed; the SDK's tracer and
    # exporter, with their thread, come only with tracing)
    code = (
        "SDK = ('opentelemetry.sdk.trace', 'opentelemetry.exporter', 'redisbal.gateway.otlp')\n"
        "import sys, redisbal.gateway.cli, redisbal.gateway.server\n"
        "from redisbal.gateway.observability import observability\n"
        "got = observability({'access_log': 'json', 'otlp_traces_endpoint': None})\n"
        "assert got['tracing'] is None and got['access_log'] is not None\n"
        "print(sorted(m for m in sys.modules if m.startswith(SDK)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=scrubbed_env()
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_traces_endpoint() -> None:
    assert traces_endpoint("http://c:4318") == "http://c:4318/v1/traces"
    assert traces_endpoint("https://c/otlp/v1/traces") == "https://c/otlp/v1/traces"
    for bad in ("grpc://c:4317", "http://c:4317", "c:4318", "ftp://c"):
        with pytest.raises(ValueError):
            traces_endpoint(bad)
