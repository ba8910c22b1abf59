"""What one proxied request did, for whoever asks afterwards: its request id (the
client's ``X-Request-Id`` when it is a safe one, else one made here), and one access
log line when it ends, whatever happened (answered, refused at the gateway, retried,
failed, the client gone mid-stream). ``Record`` gathers a request's facts on its way
through the proxy and, with tracing on, feeds its spans (redisbal.gateway.tracing).

Nothing secret goes into a line: no API key, no session key (``X-Redisbal-Key``, the
body's ``user``), no prompt or answer text."""

from __future__ import annotations

import logging
import random
import re
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from functools import partial
from typing import TYPE_CHECKING, Any

import orjson

from redisbal.errors import InvalidArgument

if TYPE_CHECKING:
    from redisbal.gateway.tracing import RequestSpans

REQUEST_ID_HEADER = "X-Request-Id"
MAX_REQUEST_ID = 128
FORMATS = ("json", "text", "off")
DEFAULT_FORMAT = "text"
# letters, digits and the punctuation of UUIDs, ULIDs, base64 and vLLM's own ids;
# nothing that could break a log line or a header
_SAFE_ID = re.compile(rf"[A-Za-z0-9._:/+=@-]{{1,{MAX_REQUEST_ID}}}\Z")
_USAGE = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')

# what a request refused by the gateway itself (no engine tried) was refused for
REFUSALS = {
    400: "bad_request",
    401: "unauthorized",
    404: "model_not_found",
    408: "body_timeout",
    413: "too_large",
    429: "overloaded",
    503: "no_engine",
}
CLIENT_GONE = 499  # the status logged for a client that left before the answer began


def request_id(given: str | None) -> str:
    """The client's request id when it is 1-128 safe characters, else a new one
    (128 random bits in hex: an id, not a secret)."""
    if given is not None and _SAFE_ID.match(given):
        return given
    return f"{random.getrandbits(128):032x}"


def usage_tokens(body: bytes) -> int | None:
    """``usage.completion_tokens`` of an OpenAI answer (or of a stream's last chunks),
    found without parsing the whole body; None when it names none."""
    at = body.rfind(b'"completion_tokens"')
    if at < 0:
        return None
    m = _USAGE.match(body, at)
    return int(m.group(1)) if m else None


class Record:
    """One request's facts, filled in by the proxy on its way and written once at its
    end (``AccessLog.write``). ``spans``: its trace, when tracing is on."""

    __slots__ = (
        "chunks",
        "client",
        "done",
        "engine",
        "error",
        "hold_s",
        "kind",
        "method",
        "model",
        "path",
        "rid",
        "spans",
        "start",
        "status",
        "stream",
        "t0",
        "tokens",
        "tries",
        "ttft_s",
    )

    def __init__(self, rid: str, method: str, path: str, client: str | None) -> None:
        self.rid, self.method, self.path, self.client = rid, method, path, client
        self.start = time.time()
        self.t0 = time.perf_counter()
        self.model: str | None = None
        self.stream: bool | None = None
        self.engine: str | None = None
        self.status = 0
        self.kind: str | None = None  # the last attempt's outcome kind (none: refused)
        self.error: str | None = None
        self.hold_s = 0.0
        self.ttft_s: float | None = None
        self.tokens: int | None = None
        self.chunks = 0
        self.tries = 0  # attempts made (engines tried)
        self.done = False  # written
        self.spans: RequestSpans | None = None

    @property
    def outcome(self) -> str:
        """ok, rejected (the engine's 4xx passed on), refused (by the gateway: no
        engine tried), failed (an error answer or error event after the attempts), or
        client_disconnect."""
        kind = self.kind
        if kind is None:
            return "client_disconnect" if self.status == CLIENT_GONE else "refused"
        if kind in ("ok", "rejected", "client_disconnect"):
            return kind
        return "failed"

    def held(self, seconds: float, timed_out: bool) -> None:
        self.hold_s = seconds
        if self.spans is not None:
            self.spans.held(seconds, timed_out)

    def first_byte(self) -> None:
        self.ttft_s = time.perf_counter() - self.t0
        if self.spans is not None:
            self.spans.first_byte()

    def attempt_end(self, kind: str, detail: str, status: int | None) -> None:
        self.kind = kind
        if self.spans is not None:
            self.spans.attempt_end(self.tries, self.engine or "", kind, detail, status)

    def gone(self) -> None:
        """The client went away before the answer was all passed on."""
        self.kind = "client_disconnect"
        if not self.status:
            self.status = CLIENT_GONE

    def chunk(self, data: bytes) -> None:
        """A streamed chunk passed on: its events counted, a usage chunk read."""
        self.chunks += data.count(b"data: ") - (b"data: [DONE]" in data)
        if b'"completion_tokens"' in data:
            self.tokens = usage_tokens(data)

    def error_name(self, outcome: str) -> str | None:
        """What went wrong, if anything: the error set on the way, else what a refusal
        was refused for, or a failure's kind."""
        if self.error is not None:
            return self.error
        if outcome == "refused":
            return REFUSALS.get(self.status, str(self.status))
        return self.kind if outcome == "failed" else None

    def fields(self) -> dict[str, Any]:
        """The line's fields (times in milliseconds)."""
        outcome = self.outcome
        error = self.error_name(outcome)
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(self.start, timezone.utc).isoformat(
                timespec="milliseconds"
            ),
            "id": self.rid,
            "method": self.method,
            "path": self.path,
            "model": self.model[:256] if self.model is not None else None,
            "stream": self.stream,
            "engine": self.engine,
            "status": self.status,
            "outcome": outcome,
            "error": error,
            "hold_ms": round(self.hold_s * 1000, 1),
            "ttft_ms": None if self.ttft_s is None else round(self.ttft_s * 1000, 1),
            "duration_ms": round((time.perf_counter() - self.t0) * 1000, 1),
            "tokens": self.tokens,
            "chunks": self.chunks if self.stream else None,
            "retries": max(0, self.tries - 1),
            "client": self.client,
        }
        trace_id = self.spans.trace_id if self.spans is not None else None
        if trace_id is not None:
            out["trace_id"] = trace_id
        return out


def _text_value(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "true" if v else "false"
    s = str(v)
    if not s or any(c in s for c in ' "=\\') or not s.isprintable():
        return orjson.dumps(s).decode()
    return s


class AccessLog:
    """One line per request to the ``redisbal.gateway.access`` logger (stderr, its own
    handler, so ``--log-level`` does not silence it): a JSON object (``json``) or
    ``key=value`` pairs (``text``, values quoted as JSON strings when they need it)."""

    def __init__(self, fmt: str = DEFAULT_FORMAT, sink: Callable[[str], None] | None = None):
        if fmt not in ("json", "text"):
            raise InvalidArgument(f"access log format must be json or text, got {fmt!r}")
        self.json = fmt == "json"
        if sink is None:
            log = logging.getLogger("redisbal.gateway.access")
            log.setLevel(logging.INFO)
            log.propagate = False
            if not log.handlers:
                handler = logging.StreamHandler(sys.stderr)
                handler.setFormatter(logging.Formatter("%(message)s"))
                log.addHandler(handler)
            sink = partial(log.info, "%s")
        self.sink = sink  # (tests pass a list's append)

    def line(self, rec: Record) -> str:
        f = rec.fields()
        if self.json:
            line: str = orjson.dumps(f).decode()
            return line
        ts: str = f.pop("ts")
        return ts + " access " + " ".join(f"{k}={_text_value(v)}" for k, v in f.items())

    def write(self, rec: Record) -> None:
        self.sink(self.line(rec))
