"""The gateway's spans to an OTLP/HTTP collector, encoded here rather than by the SDK's
exporter: at 100% sampling the SDK's encoder was the largest part of what tracing costs
a request (each attribute built as a protobuf object in Python, the resource hashed
through JSON for every span). This writes the protobuf wire format directly, with the
encoded attributes that recur (engine, status, outcome, model) kept, and sends it as the
SDK's exporter would: ``POST`` of ``application/x-protobuf``, the standard ``OTEL_*``
variables for the endpoint, headers, timeout, compression and TLS files, retried with
backoff on 429, 502, 503, 504 and connection errors. tests/gateway/test_otlp_encoding.py
checks that it decodes to what the SDK's own encoder makes.

Imported only with the ``tracing`` extra (redisbal.gateway.tracing)."""

from __future__ import annotations

import contextlib
import gzip
import logging
import os
import struct
import time
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import requests
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.util.re import parse_env_headers

log = logging.getLogger("redisbal.gateway")

DEFAULT_ENDPOINT = "http://localhost:4318/v1/traces"
RETRYABLE = frozenset({429, 502, 503, 504})
CACHE_MAX = 4096  # encoded attributes kept (the recurring ones; cleared when full)

_q = struct.Struct("<Q").pack
_d = struct.Struct("<d").pack
_i = struct.Struct("<I").pack
_SMALL = [bytes([n]) for n in range(128)]


def _varint(n: int) -> bytes:
    if n < 128:
        return _SMALL[n]
    out = bytearray()
    while n >= 128:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field (``tag``: its key byte(s))."""
    return tag + _varint(len(payload)) + payload


def _any(v: Any) -> bytes:
    """An AnyValue's payload."""
    if isinstance(v, bool):
        return b"\x10\x01" if v else b"\x10\x00"
    if isinstance(v, str):
        return _field(b"\x0a", v.encode())
    if isinstance(v, int):
        return b"\x18" + _varint(v & 0xFFFFFFFFFFFFFFFF)  # int64: two's complement
    if isinstance(v, float):
        return b"\x21" + _d(v)
    if isinstance(v, bytes):
        return _field(b"\x3a", v)
    if isinstance(v, Sequence):
        return _field(b"\x2a", b"".join(_field(b"\x0a", _any(x)) for x in v))
    return b""


def _kv(tag: bytes, k: str, v: Any) -> bytes:
    """A KeyValue field."""
    return _field(tag, _field(b"\x0a", k.encode()) + _field(b"\x12", _any(v)))


class Encoder:
    """ExportTraceServiceRequest bytes for a batch of SDK spans."""

    def __init__(self) -> None:
        self._kv: dict[tuple[bytes, str, Any, type], bytes] = {}

    def _attrs(self, tag: bytes, attrs: Mapping[str, Any] | None) -> bytes:
        if not attrs:
            return b""
        out = []
        cache = self._kv
        for k, v in attrs.items():
            if isinstance(v, float):  # (times and ages: never twice the same)
                out.append(_kv(tag, k, v))
                continue
            key = (tag, k, v, type(v))  # (True and 1 are equal keys, not equal values)
            try:
                kv = cache[key]
            except KeyError:
                if len(cache) >= CACHE_MAX:
                    cache.clear()
                kv = cache[key] = _kv(tag, k, v)
            except TypeError:  # a sequence value: not hashable
                kv = _kv(tag, k, v)
            out.append(kv)
        return b"".join(out)

    def span(self, s: ReadableSpan) -> bytes:
        sc = s.get_span_context()
        assert sc is not None and s.start_time is not None and s.end_time is not None
        parts = [
            _field(b"\x0a", sc.trace_id.to_bytes(16, "big")),
            _field(b"\x12", sc.span_id.to_bytes(8, "big")),
        ]
        if sc.trace_state:
            state = ",".join(f"{k}={v}" for k, v in sc.trace_state.items())
            parts.append(_field(b"\x1a", state.encode()))
        parent = s.parent
        if parent is not None:
            parts.append(_field(b"\x22", parent.span_id.to_bytes(8, "big")))
        parts += (
            _field(b"\x2a", s.name.encode()),
            b"\x30" + _varint(s.kind.value + 1),
            b"\x39" + _q(s.start_time),
            b"\x41" + _q(s.end_time),
            self._attrs(b"\x4a", s.attributes),
        )
        if s.dropped_attributes:
            parts.append(b"\x50" + _varint(s.dropped_attributes))
        for e in s.events:
            ev = b"\x09" + _q(e.timestamp) + _field(b"\x12", e.name.encode())
            ev += self._attrs(b"\x1a", e.attributes)
            if dropped := getattr(e, "dropped_attributes", 0):  # (older SDKs: no such count)
                ev += b"\x20" + _varint(dropped)
            parts.append(_field(b"\x5a", ev))
        if s.dropped_events:
            parts.append(b"\x60" + _varint(s.dropped_events))
        for link in s.links:
            lc = link.context
            lk = _field(b"\x0a", lc.trace_id.to_bytes(16, "big"))
            lk += _field(b"\x12", lc.span_id.to_bytes(8, "big"))
            lk += self._attrs(b"\x22", link.attributes)
            if dropped := getattr(link, "dropped_attributes", 0):
                lk += b"\x28" + _varint(dropped)
            lk += b"\x35" + _i(0x100 | (0x200 if lc.is_remote else 0))
            parts.append(_field(b"\x6a", lk))
        if s.dropped_links:
            parts.append(b"\x70" + _varint(s.dropped_links))
        status = s.status
        st = _field(b"\x12", status.description.encode()) if status.description else b""
        code = status.status_code.value
        parts.append(_field(b"\x7a", st + (b"\x18" + _varint(code) if code else b"")))
        # flags: whether the parent is remote is known (0x100), and if it is (0x200)
        remote = parent is not None and parent.is_remote
        parts.append(b"\x85\x01" + _i(0x100 | (0x200 if remote else 0)))
        return b"".join(parts)

    def encode(self, spans: Sequence[ReadableSpan]) -> bytes:
        """Spans grouped by resource, then by instrumentation scope, as the SDK does
        (the gateway's are all of one of each)."""
        groups: dict[int, tuple[Any, dict[int, tuple[Any, list[bytes]]]]] = {}
        for s in spans:
            res, scope = s.resource, s.instrumentation_scope
            by_id = groups.setdefault(id(res), (res, {}))[1]
            by_id.setdefault(id(scope), (scope, []))[1].append(self.span(s))
        out = []
        for res, by_id in groups.values():
            # equal scopes are one (as the SDK groups them), whichever object each span has
            scopes: dict[Any, list[bytes]] = {}
            for one, encoded in by_id.values():
                scopes.setdefault(one, []).extend(encoded)
            body = _field(b"\x0a", self._attrs(b"\x0a", res.attributes))
            for scope, encoded in scopes.items():
                sc = b""
                if scope is not None:
                    sc = _field(b"\x0a", scope.name.encode())
                    if scope.version:
                        sc += _field(b"\x12", scope.version.encode())
                    sc += self._attrs(b"\x1a", getattr(scope, "attributes", None))
                ss = _field(b"\x0a", sc) + b"".join(_field(b"\x12", x) for x in encoded)
                if scope is not None and scope.schema_url:
                    ss += _field(b"\x1a", scope.schema_url.encode())
                body += _field(b"\x12", ss)
            if res.schema_url:
                body += _field(b"\x1a", res.schema_url.encode())
            out.append(_field(b"\x0a", body))
        return b"".join(out)


def env_headers(value: str) -> Mapping[str, str]:
    """``OTEL_EXPORTER_OTLP_HEADERS``'s ``k=v,k2=v2``, percent-decoded, as the SDK parses
    it (leniently where the API can: spaces around the pairs)."""
    try:
        return parse_env_headers(value, liberal=True)
    except TypeError:  # (an API before ``liberal``)
        return parse_env_headers(value)


def _env(name: str) -> str | None:
    """``OTEL_EXPORTER_OTLP_TRACES_<name>``, else ``OTEL_EXPORTER_OTLP_<name>``."""
    return os.environ.get(f"OTEL_EXPORTER_OTLP_TRACES_{name}") or os.environ.get(
        f"OTEL_EXPORTER_OTLP_{name}"
    )


def env_traces_url() -> str:
    """The traces URL the standard variables name (the signal's own as it is; the
    general one with ``/v1/traces`` added), else the default."""
    if url := os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return url
    if base := os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return base.rstrip("/") + "/v1/traces"
    return DEFAULT_ENDPOINT


class OTLPExporter(SpanExporter):
    """Batches of spans POSTed to ``endpoint`` (else the one the variables name)."""

    def __init__(self, endpoint: str | None = None) -> None:
        self.url = endpoint or env_traces_url()
        self.encoder = Encoder()
        self.timeout_s = float(_env("TIMEOUT") or 10.0)
        self.compression = (_env("COMPRESSION") or "none").strip().lower()
        self.session = requests.Session()
        self.session.headers.update(env_headers(_env("HEADERS") or ""))
        self.session.headers["Content-Type"] = "application/x-protobuf"
        if self.compression in ("gzip", "deflate"):
            self.session.headers["Content-Encoding"] = self.compression
        if cert := _env("CERTIFICATE"):
            self.session.verify = cert
        key, cert = _env("CLIENT_KEY"), _env("CLIENT_CERTIFICATE")
        if cert:
            self.session.cert = (cert, key) if key else cert
        self._shutdown = False
        # what requests works out for every POST (the environment's proxies and netrc,
        # the session's headers merged, the URL parsed), worked out once: most of what a
        # POST cost in Python, paid per batch (each export sends a copy with its body)
        self._request: requests.PreparedRequest | None = None
        with contextlib.suppress(requests.exceptions.RequestException):  # (exports say why)
            self._request = self.session.prepare_request(requests.Request("POST", self.url))
        self._send = self.session.merge_environment_settings(
            self.url, {}, None, self.session.verify, self.session.cert
        )

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self._shutdown:
            return SpanExportResult.FAILURE
        data = self.encoder.encode(spans)
        if self.compression == "gzip":
            data = gzip.compress(data)
        elif self.compression == "deflate":
            data = zlib.compress(data)
        deadline = time.monotonic() + self.timeout_s
        delay = 1.0
        while True:
            left = deadline - time.monotonic()
            try:
                if self._request is None:
                    resp = self.session.post(self.url, data=data, timeout=max(0.1, left))
                else:
                    req = self._request.copy()
                    req.prepare_body(data, None)
                    resp = self.session.send(req, timeout=max(0.1, left), **self._send)
            except requests.exceptions.RequestException as exc:
                why = f"{type(exc).__name__}: {exc}"
                status = None
            else:
                if resp.ok:
                    return SpanExportResult.SUCCESS
                why, status = f"{resp.status_code} {resp.text[:200]}", resp.status_code
            if (status is not None and status not in RETRYABLE) or self._shutdown:
                break
            if time.monotonic() + delay > deadline:
                break
            time.sleep(delay)
            delay *= 2
        log.warning("gateway: %d spans not exported to %s: %s", len(spans), self.url, why)
        return SpanExportResult.FAILURE

    def shutdown(self) -> None:
        self._shutdown = True
        self.session.close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True  # (nothing is held here: the batch processor holds what is left)
