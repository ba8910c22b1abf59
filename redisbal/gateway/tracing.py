"""OpenTelemetry traces of the proxied requests, exported over OTLP/HTTP.

A request's trace continues the client's W3C ``traceparent``/``tracestate`` (else it
starts here) and passes on to the engine: the request's span is the parent named in
each engine request's ``traceparent``, so an engine that traces (vLLM with its own
``--otlp-traces-endpoint``) puts its spans under it. What a request went through is in
its span's events (each attempt with its routing decision, a failure, the retry that
followed, first byte), a child span for its hold, and its attributes at the end
(status, outcome, tokens). Names and attributes: docs/GATEWAY.md.

The SDK is the ``tracing`` extra, imported only when tracing is configured: without it
the proxy makes no tracing object per request and tests one branch
(redisbal.gateway.proxy)."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any, Protocol
from urllib.parse import urlsplit, urlunsplit

from redisbal.errors import InvalidURL, MissingExtra

__all__ = ["MissingExtra", "RequestSpans", "Tracing", "env_endpoint", "traces_endpoint"]

EXTRA_HINT = "pip install 'redisbal[tracing]'"
SERVICE_NAME = "redisbal-gateway"
HOLD_REASON = "every engine at its running cap"
TRACES_PATH = "/v1/traces"  # OTLP/HTTP's traces path, added to an endpoint without one


def traces_endpoint(url: str) -> str:
    """The OTLP/HTTP traces URL for ``url``: http(s), ``/v1/traces`` when it has no
    path (a collector's base URL, as vLLM's flag takes it). InvalidURL otherwise."""
    parts = urlsplit(url.strip())
    if parts.scheme == "grpc" or (parts.scheme in ("http", "https") and parts.port == 4317):
        raise InvalidURL(
            f"{url!r}: the gateway exports OTLP over HTTP (a collector's port 4318), not gRPC"
        )
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidURL(f"{url!r} is not an http(s) URL")
    if parts.path in ("", "/"):
        parts = parts._replace(path=TRACES_PATH)
    return urlunsplit(parts)


def env_endpoint() -> str | None:
    """The endpoint the standard environment names, if any (the SDK's exporter reads it
    itself; this says whether tracing is configured)."""
    return os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )


_RID = "redisbal.request_id"


class Ended(Protocol):
    """What a request's end puts on its span: its access-log record
    (redisbal.gateway.accesslog.Record, which imports this module)."""

    status: int
    model: str | None
    engine: str | None
    tokens: int | None
    tries: int
    hold_s: float
    ttft_s: float | None

    @property
    def outcome(self) -> str: ...

    def error_name(self, outcome: str) -> str | None: ...


def context_headers(sc: Any) -> dict[str, str]:
    """W3C ``traceparent`` (and ``tracestate`` when there is one) naming the span of
    ``sc`` as the parent: what the SDK's propagator writes, without a context object
    made and read back per engine request."""
    out = {"traceparent": f"00-{sc.trace_id:032x}-{sc.span_id:016x}-{sc.trace_flags:02x}"}
    if sc.trace_state:
        out["tracestate"] = sc.trace_state.to_header()
    return out


class Tracing:
    """A tracer provider of its own (not the process-wide one) with a batching OTLP/HTTP
    exporter, sampled as ``OTEL_TRACES_SAMPLER``/``OTEL_TRACES_SAMPLER_ARG`` say
    (default: follow the caller's sampled flag, sample everything else). ``exporter``:
    any SDK span exporter instead (tests); ``resource``: attributes of every span, sent
    once per batch (what is the same for every request: the policy). Raises MissingExtra
    without the SDK.

    A request's spans are made from the provider's sampler, id generator and resource
    and handed, ended, to its batch processor as the SDK's ``ReadableSpan``: not through
    the SDK's mutable span, whose locks, per-attribute checks and copy at its end were
    most of what a traced request cost the event loop (docs/GATEWAY.md). The gateway
    sets only values of the types OTLP takes, so nothing is lost by not checking them."""

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        exporter: Any = None,
        resource: Mapping[str, str] | None = None,
    ) -> None:
        try:
            from opentelemetry import trace
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import Event, ReadableSpan, TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.sdk.util.instrumentation import InstrumentationScope
            from opentelemetry.trace.propagation.tracecontext import (
                TraceContextTextMapPropagator,
            )

            if exporter is None:
                from redisbal.gateway.otlp import OTLPExporter

                exporter = OTLPExporter(endpoint)
        except ImportError as exc:
            raise MissingExtra(
                f"tracing needs the 'tracing' extra ({exc.name} is missing): {EXTRA_HINT}"
            ) from None
        from redisbal import __version__

        attrs = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": SERVICE_NAME}
        attrs |= resource or {}
        self.provider = TracerProvider(resource=Resource.create(attrs))
        self.processor = BatchSpanProcessor(exporter)
        self.provider.add_span_processor(self.processor)  # (flushed and shut down with it)
        self.tracer = self.provider.get_tracer("redisbal.gateway", __version__)
        self.propagator = TraceContextTextMapPropagator()
        self.scope = InstrumentationScope("redisbal.gateway", __version__)
        self.resource = self.provider.resource
        self._sampler = self.provider.sampler
        self._ids = self.provider.id_generator
        # (W3C's random-trace-id flag, as the SDK sets it where it knows of it)
        self._random = bool(getattr(self._ids, "is_trace_id_random", lambda: False)())
        self._trace, self._span, self._event = trace, ReadableSpan, Event
        self._server, self._internal = trace.SpanKind.SERVER, trace.SpanKind.INTERNAL
        self._ok = trace.Status(trace.StatusCode.UNSET)
        self._error = trace.StatusCode.ERROR

    def context(self, trace_id: int, flags: int, state: Any) -> Any:
        """A new span's context in the trace ``trace_id``."""
        return self._trace.SpanContext(
            trace_id,
            self._ids.generate_span_id(),
            is_remote=False,
            trace_flags=self._trace.TraceFlags(flags),
            trace_state=state,
        )

    def request(self, headers: Mapping[str, str], method: str, path: str, rid: str) -> RequestSpans:
        """The spans of a request that came with ``headers`` (its trace context)."""
        # (the method is in the span's name: an attribute of its own costs each request)
        name = f"{method} {path}"
        ctx = parent = None
        if "traceparent" in headers:
            ctx = self.propagator.extract(headers)
            parent = self._trace.get_current_span(ctx).get_span_context()
            if not parent.is_valid:
                parent = None
        if parent is None:
            trace_id, random = self._ids.generate_trace_id(), self._random
        else:
            trace_id = parent.trace_id
            random = bool(getattr(parent.trace_flags, "random_trace_id", False))
        attrs = {_RID: rid}
        got = self._sampler.should_sample(ctx, trace_id, name, self._server, attrs)
        sampled = bool(got.decision.is_sampled())  # type: ignore[no-untyped-call]
        sc = self.context(trace_id, (1 if sampled else 0) | (2 if random else 0), got.trace_state)
        return RequestSpans(self, name, sc, parent, dict(got.attributes) if sampled else None)

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Export what has ended (blocking: call it off the event loop)."""
        return bool(self.provider.force_flush(int(timeout_s * 1000)))

    def shutdown(self) -> None:
        """Export what is left and stop the exporter's thread (blocking)."""
        self.provider.shutdown()


class RequestSpans:
    """One request's trace: a server span for the whole request, with an event for each
    attempt (its routing decision), first byte, failure and retry, and a child span for
    its hold. One span, not one per attempt: spans cost the most of what tracing costs
    per request (docs/GATEWAY.md); the engine's spans are children of this one. A
    request that is not sampled records nothing, and still tells the engine so."""

    __slots__ = ("_attrs", "_context", "_events", "_name", "_parent", "_start", "_t", "context")

    def __init__(
        self, tracing: Tracing, name: str, context: Any, parent: Any, attrs: dict[str, Any] | None
    ) -> None:
        self._t, self._name, self.context, self._parent = tracing, name, context, parent
        self._attrs = attrs  # None: not sampled (nothing recorded)
        self._events: list[Any] = []
        self._start = time.time_ns()
        self._context: dict[str, str] | None = None  # the engine requests' trace headers

    @property
    def trace_id(self) -> str | None:
        """The trace's id when it is sampled (exported), else None."""
        sc = self.context
        return format(sc.trace_id, "032x") if sc.trace_flags.sampled else None

    def held(self, seconds: float, timed_out: bool) -> None:
        """The request waited ``seconds`` in the gateway (ending now)."""
        if self._attrs is None:
            return
        t, sc, now = self._t, self.context, time.time_ns()
        span = t._span(
            "redisbal.hold",
            context=t.context(sc.trace_id, sc.trace_flags, sc.trace_state),
            parent=sc,
            resource=t.resource,
            attributes={
                "redisbal.hold.seconds": seconds,
                "redisbal.hold.reason": HOLD_REASON,
                "redisbal.hold.timed_out": timed_out,
            },
            kind=t._internal,
            status=t._ok,
            start_time=now - int(seconds * 1e9),
            end_time=now,
            instrumentation_scope=t.scope,
        )
        t.processor.on_end(span)

    def attempt(self, route: dict[str, Any], headers: dict[str, str]) -> None:
        """An attempt begins with the routing decision ``route``; the trace context
        goes into the engine request's ``headers`` (this span its parent)."""
        if self._attrs is not None:
            self._events.append(self._t._event("attempt", route))
        if self._context is None:
            self._context = context_headers(self.context)
        headers.update(self._context)

    def first_byte(self) -> None:
        """(its time is the event's; the request's ``redisbal.ttft_s`` says it too)"""
        if self._attrs is not None:
            self._events.append(self._t._event("first_byte"))

    def attempt_end(self, n: int, engine: str, kind: str, detail: str, status: int | None) -> None:
        """An attempt that did not end ``ok`` (an ok one's end is the request's)."""
        if kind == "ok" or self._attrs is None:
            return
        attrs: dict[str, Any] = {
            "redisbal.attempt": n,
            "redisbal.engine": engine,
            "redisbal.outcome": kind,
        }
        if status:
            attrs["http.response.status_code"] = status
        if detail:
            attrs["redisbal.detail"] = detail
        self._events.append(self._t._event("attempt_end", attrs))

    def retry(self, engine: str, kind: str, again: bool, refused: bool) -> None:
        """An attempt failed before the first byte: retried elsewhere or not (and
        whether the retry budget refused it)."""
        if self._attrs is None:
            return
        attrs: dict[str, Any] = {
            "redisbal.engine": engine,
            "redisbal.retry.reason": kind,
            "redisbal.retry.again": again,
            "redisbal.retry.budget_refused": refused,
        }
        self._events.append(self._t._event("retry", attrs))

    def end(self, rec: Ended) -> None:
        """The request ended: the access log's facts (read off its record, not its
        line, which a request without an access log never makes) on the server span,
        which goes to the batch processor (once: a second end does nothing)."""
        attrs, t = self._attrs, self._t
        if attrs is None:
            return
        self._attrs = None
        status, outcome = rec.status, rec.outcome
        error = rec.error_name(outcome)
        attrs["http.response.status_code"] = status
        attrs["redisbal.outcome"] = outcome
        # what is absent or zero is left out: each attribute costs the request path (so
        # is the access log's chunk count: the first_byte event says the stream began)
        if rec.model is not None:
            attrs["gen_ai.request.model"] = rec.model[:256]
        if rec.engine is not None:
            attrs["redisbal.engine"] = rec.engine
        if error is not None:
            attrs["redisbal.error"] = error
        if rec.tokens is not None:
            attrs["gen_ai.usage.output_tokens"] = rec.tokens
        if rec.tries > 1:
            attrs["redisbal.retries"] = rec.tries - 1
        if rec.hold_s:
            attrs["redisbal.hold_s"] = round(rec.hold_s, 4)
        if rec.ttft_s is not None:
            attrs["redisbal.ttft_s"] = round(rec.ttft_s, 4)
        failed = status >= 500 or outcome == "failed"
        span = t._span(
            self._name,
            context=self.context,
            parent=self._parent,
            resource=t.resource,
            attributes=attrs,
            events=tuple(self._events),
            kind=t._server,
            status=t._trace.Status(t._error, error or None) if failed else t._ok,
            start_time=self._start,
            end_time=time.time_ns(),
            instrumentation_scope=t.scope,
        )
        t.processor.on_end(span)
