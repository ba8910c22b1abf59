"""A real OTLP/HTTP traces endpoint for the tests: an aiohttp server on loopback that
decodes each ``ExportTraceServiceRequest`` (protobuf, as the SDK's exporter sends it)
into plain spans."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass
class Span:
    name: str
    trace_id: str
    span_id: str
    parent: str  # "" for a root
    kind: int  # the protobuf's: 2 server, 3 client
    attrs: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]]
    error: bool
    status_message: str
    service: str = ""
    resource: dict[str, Any] = field(default_factory=dict)
    start_ns: int = 0
    end_ns: int = 0
    event_ns: list[int] = field(default_factory=list)  # when each event came


def _value(v: Any) -> Any:
    which = v.WhichOneof("value")
    return None if which is None else getattr(v, which)


def _attrs(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


@dataclass
class OtlpReceiver:
    spans: list[Span] = field(default_factory=list)
    requests: int = 0
    headers: list[dict[str, str]] = field(default_factory=list)  # each export's
    _runner: web.AppRunner | None = None
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _traces(self, request: web.Request) -> web.Response:
        assert request.content_type == "application/x-protobuf", request.content_type
        body = await request.read()  # (aiohttp undoes a gzip or deflate Content-Encoding)
        msg = ExportTraceServiceRequest()
        msg.ParseFromString(body)
        self.requests += 1
        self.headers.append(dict(request.headers))
        for rs in msg.resource_spans:
            resource = _attrs(rs.resource.attributes)
            service = resource.get("service.name", "")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    self.spans.append(
                        Span(
                            name=s.name,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent=s.parent_span_id.hex(),
                            kind=s.kind,
                            attrs=_attrs(s.attributes),
                            events=[(e.name, _attrs(e.attributes)) for e in s.events],
                            error=s.status.code == 2,
                            status_message=s.status.message,
                            service=service,
                            resource=resource,
                            start_ns=s.start_time_unix_nano,
                            end_ns=s.end_time_unix_nano,
                            event_ns=[e.time_unix_nano for e in s.events],
                        )
                    )
        return web.Response(
            body=ExportTraceServiceResponse().SerializeToString(),
            content_type="application/x-protobuf",
        )

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/traces", self._traces)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def trace(self, trace_id: str) -> list[Span]:
        return [s for s in self.spans if s.trace_id == trace_id]

    def roots(self) -> list[Span]:
        return [s for s in self.spans if s.kind == 2]
