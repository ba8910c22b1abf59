"""The gateway's own OTLP encoding (redisbal.gateway.otlp) decodes to exactly what the
SDK's encoder makes of the same spans, for every kind of value and span the gateway
makes (and links, which it does not); its exporter honours the standard variables."""

from __future__ import annotations

import asyncio

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from support.otlp_receiver import OtlpReceiver

from redisbal.gateway.accesslog import Record
from redisbal.gateway.otlp import Encoder
from redisbal.gateway.tracing import Tracing

PARENT = {
    "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    "tracestate": "vendor=abc,other=x y",
}


def _spans() -> list:  # type: ignore[type-arg]
    memory = InMemorySpanExporter()
    tr = Tracing(exporter=memory, resource={"redisbal.policy": "redisbal"})
    for i, headers in enumerate(({}, PARENT)):
        rec = Record(f"rid-{i}", "POST", "/v1/chat/completions", "127.0.0.1")
        rec.spans = tr.request(headers, "POST", rec.path, rec.rid)
        rec.model, rec.engine, rec.tries = "modèle ✓", "0", 2
        rec.held(0.25, timed_out=i == 1)
        route = {"redisbal.attempt": 1, "redisbal.engine": "1", "redisbal.snapshot.age_s": 0.5}
        rec.spans.attempt({**route, "redisbal.engine.running": -3, "redisbal.pinned": True}, {})
        rec.tries = 1
        rec.attempt_end("connect", "refused", None)
        rec.spans.retry("1", "connect", True, False)
        rec.tries = 2
        rec.spans.attempt({**route, "redisbal.attempt": 2, "big": 2**62, "no": False}, {})
        rec.status, rec.tokens = (200, 7) if i == 0 else (502, None)
        rec.first_byte()
        rec.attempt_end("ok" if i == 0 else "reset", "", rec.status)
        rec.spans.end(rec)
    with tr.tracer.start_as_current_span(
        "other",
        kind=trace.SpanKind.CLIENT,
        links=[trace.Link(trace.get_current_span().get_span_context(), {"why": "test"})],
        attributes={"list": ["a", "b"], "ints": [1, -2], "f": -0.5, "b": b"\x00\xff"},
    ) as span:
        span.set_status(trace.StatusCode.OK)
    tr.flush()
    spans = list(memory.get_finished_spans())
    tr.shutdown()
    return spans


def test_the_encoding_decodes_to_what_the_sdk_encodes() -> None:
    spans = _spans()
    assert len(spans) == 5 and any(s.parent and s.parent.is_remote for s in spans)
    want = encode_spans(spans)
    enc = Encoder()
    for _ in range(2):  # (the second time from the encoded attributes kept)
        got = ExportTraceServiceRequest.FromString(enc.encode(spans))
        assert got == want, (got, want)


def test_the_exporter_takes_the_standard_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    async def run() -> None:
        receiver = OtlpReceiver()
        await receiver.start()
        try:
            monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url)
            headers = "x-tenant=acme,authorization=Bearer%20t"
            monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", headers)
            monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_COMPRESSION", "gzip")
            tr = Tracing()
            rec = Record("rid-env", "POST", "/v1/completions", "127.0.0.1")
            rec.spans = tr.request({}, "POST", rec.path, rec.rid)
            rec.status, rec.kind = 200, "ok"
            rec.spans.end(rec)
            assert await asyncio.to_thread(tr.flush)
            await asyncio.to_thread(tr.shutdown)
        finally:
            await receiver.stop()
        [span] = receiver.spans
        assert span.attrs["redisbal.request_id"] == "rid-env"
        [got] = receiver.headers
        assert got["x-tenant"] == "acme" and got["Authorization"] == "Bearer t"
        assert got["Content-Encoding"] == "gzip"

    asyncio.run(run())
