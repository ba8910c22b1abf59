"""Who may use the gateway: API keys on the ``/v1`` paths, CORS for browser pages,
and the TLS context of the listening socket."""

from __future__ import annotations

import hashlib
import hmac
import ssl
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler

from redisbal.errors import InvalidArgument
from redisbal.gateway.errors import json_error

EXPOSED = ("X-Redisbal-Engine",)  # answer headers a browser page may read


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


class ApiKeys:
    """The keys a client may present as ``Authorization: Bearer <key>``. Compared in
    constant time: digests of equal length, every key compared whatever matched."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._digests = [_digest(k) for k in keys]
        if not self._digests:
            raise InvalidArgument("no API key")

    def __len__(self) -> int:
        return len(self._digests)

    def allows(self, authorization: str | None) -> bool:
        if authorization is None:
            return False
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "bearer":
            return False
        got = _digest(token.strip())
        ok = False
        for d in self._digests:
            ok |= hmac.compare_digest(got, d)
        return ok


def read_keys(path: str) -> list[str]:
    """The keys in a file: one a line; blank lines and lines starting with # skipped.
    OSError / UnicodeDecodeError / ValueError (no key) for the caller to report."""
    with open(path, encoding="utf-8") as fh:
        keys = [ln.strip() for ln in fh]
    keys = [k for k in keys if k and not k.startswith("#")]
    if not keys:
        raise InvalidArgument("holds no key")
    return keys


def auth_middleware(
    keys: ApiKeys, refused: Callable[[web.Request, web.Response], None] | None = None
) -> Any:
    """A 401 (OpenAI's ``invalid_api_key``) for a ``/v1`` request without a valid key;
    ``/health`` and ``/metrics`` stay open, and so do CORS preflights (``OPTIONS``).
    ``refused`` sees each 401 before it goes (the request id, the access log)."""

    @web.middleware
    async def check_key(request: web.Request, handler: Handler) -> web.StreamResponse:
        if (
            request.path.startswith("/v1")
            and request.method != "OPTIONS"
            and not keys.allows(request.headers.get("Authorization"))
        ):
            resp = json_error(
                401,
                "missing or invalid API key: send Authorization: Bearer <key>",
                code="invalid_api_key",
                **{"WWW-Authenticate": "Bearer"},
            )
            if refused is not None:
                refused(request, resp)
            return resp
        return await handler(request)

    return check_key


@dataclass(frozen=True)
class Cors:
    """Cross-origin access for browser pages (the options are vLLM's). ``*`` in
    ``origins``: any origin; in ``methods`` or ``headers``: whatever is asked."""

    origins: tuple[str, ...]
    methods: tuple[str, ...] = ("*",)
    headers: tuple[str, ...] = ("*",)
    credentials: bool = False

    def allowed(self, origin: str) -> bool:
        return "*" in self.origins or origin in self.origins

    def _origin_headers(self, origin: str) -> dict[str, str]:
        out = {"Vary": "Origin"}
        # with credentials a browser refuses "*": the origin itself is named
        out["Access-Control-Allow-Origin"] = (
            "*" if "*" in self.origins and not self.credentials else origin
        )
        if self.credentials:
            out["Access-Control-Allow-Credentials"] = "true"
        return out

    def preflight(self, request: web.Request) -> web.Response:
        origin = request.headers.get("Origin", "")
        if not self.allowed(origin):
            return json_error(403, f"origin {origin[:200]!r} is not allowed")
        method = request.headers.get("Access-Control-Request-Method", "")
        asked = request.headers.get("Access-Control-Request-Headers", "")
        headers = self._origin_headers(origin)
        headers["Access-Control-Allow-Methods"] = (
            method if "*" in self.methods else ", ".join(self.methods)
        )
        if asked or "*" not in self.headers:
            headers["Access-Control-Allow-Headers"] = (
                asked if "*" in self.headers else ", ".join(self.headers)
            )
        headers["Access-Control-Max-Age"] = "600"
        return web.Response(status=204, headers=headers)

    def middleware(self) -> Any:
        @web.middleware
        async def cors(request: web.Request, handler: Handler) -> web.StreamResponse:
            if (
                request.method == "OPTIONS"
                and "Origin" in request.headers
                and "Access-Control-Request-Method" in request.headers
            ):
                return self.preflight(request)
            return await handler(request)

        return cors

    async def on_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        """Every answer (errors and streams too) to an allowed origin says so."""
        origin = request.headers.get("Origin")
        if origin is not None and self.allowed(origin):
            response.headers.update(self._origin_headers(origin))
            response.headers["Access-Control-Expose-Headers"] = ", ".join(EXPOSED)


def server_ssl(certfile: str, keyfile: str | None, ca_certs: str | None) -> ssl.SSLContext:
    """The listening socket's TLS; with ``ca_certs`` clients must present a certificate
    signed by one of them. OSError / ssl.SSLError for the caller to report."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(certfile, keyfile)
    if ca_certs is not None:
        ctx.load_verify_locations(ca_certs)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx
