"""``redisbal gateway``'s options for serving it beyond this machine: API keys, the
engines' key, TLS, CORS and the limits of connections and requests; and what they
make (the ``Gateway``'s keyword arguments), checked with one-line usage errors."""

from __future__ import annotations

import ipaddress
import logging
import ssl
from collections.abc import Callable
from typing import Any, TypeVar

import click

from redisbal.errors import InvalidArgument
from redisbal.ops.cli_options import FiniteFloat

log = logging.getLogger("redisbal.gateway")

F = TypeVar("F", bound=Callable[..., Any])
MAX_MODEL_LEN = 256  # a model name's length at most (Hugging Face ids are shorter)

_OPTIONS = (
    click.option(
        "--api-key",
        "api_keys",
        multiple=True,
        envvar="REDISBAL_API_KEY",
        show_envvar=True,
        metavar="KEY",
        help="Require 'Authorization: Bearer KEY' on the /v1 paths (repeatable; the env "
        "var takes several separated by spaces). A key given here shows in ps: prefer "
        "--api-key-file or the env var.",
    ),
    click.option(
        "--api-key-file",
        "api_key_files",
        multiple=True,
        envvar="REDISBAL_API_KEY_FILE",
        show_envvar=True,
        metavar="PATH",
        help="A file of API keys, one a line (# comments); repeatable.",
    ),
    click.option(
        "--engine-api-key",
        envvar="REDISBAL_ENGINE_API_KEY",
        show_envvar=True,
        metavar="KEY",
        help="Send this key to the engines (their --api-key) instead of the client's.",
    ),
    click.option(
        "--engine-api-key-file",
        envvar="REDISBAL_ENGINE_API_KEY_FILE",
        show_envvar=True,
        metavar="PATH",
        help="A file holding the engines' key.",
    ),
    click.option(
        "--ssl-certfile",
        envvar="REDISBAL_SSL_CERTFILE",
        metavar="PATH",
        help="Serve HTTPS with this certificate (PEM, the chain after it).",
    ),
    click.option(
        "--ssl-keyfile",
        envvar="REDISBAL_SSL_KEYFILE",
        metavar="PATH",
        help="The certificate's private key (PEM), unless in --ssl-certfile.",
    ),
    click.option(
        "--ssl-ca-certs",
        envvar="REDISBAL_SSL_CA_CERTS",
        metavar="PATH",
        help="Require client certificates signed by these CAs (PEM).",
    ),
    click.option(
        "--allowed-origins",
        multiple=True,
        metavar="ORIGIN[,ORIGIN]",
        help="Browser pages of these origins may call the gateway (CORS; '*': any). "
        "None by default.",
    ),
    click.option(
        "--allowed-methods",
        default="*",
        show_default=True,
        metavar="METHOD[,METHOD]",
        help="CORS: methods a page may use.",
    ),
    click.option(
        "--allowed-headers",
        default="*",
        show_default=True,
        metavar="HEADER[,HEADER]",
        help="CORS: request headers a page may send.",
    ),
    click.option(
        "--allow-credentials", is_flag=True, help="CORS: pages may send cookies and credentials."
    ),
    click.option(
        "--max-concurrent-requests",
        type=click.IntRange(0, 1 << 20),
        default=0,
        show_default=True,
        envvar="REDISBAL_MAX_CONCURRENT_REQUESTS",
        show_envvar=True,
        help="Past this many requests in flight, a 429 with Retry-After (0: no limit).",
    ),
    click.option(
        "--max-connections",
        type=click.IntRange(0, 1 << 24),
        default=0,
        show_default=True,
        help="Open client connections at most; past it a new one closes the oldest idle "
        "one (0: half the open-file limit, less a reserve).",
    ),
    click.option(
        "--header-timeout-s",
        type=FiniteFloat(0.1, 3600),
        default=10.0,
        show_default=True,
        help="Once a request head begins to arrive, the whole head must follow within "
        "this, else the connection is closed (slow clients).",
    ),
    click.option(
        "--keepalive-timeout-s",
        type=FiniteFloat(0.1, 3600),
        default=75.0,
        show_default=True,
        help="A connection that sends nothing (new, or idle after an answer) is closed "
        "after this. Keep it above your clients' and load balancers' own idle timeouts: "
        "a connection closed as a client reuses it fails that request.",
    ),
    click.option(
        "--body-timeout-s",
        type=FiniteFloat(0.1, 86400),
        default=30.0,
        show_default=True,
        help="A request body that has not all arrived within this gets a 408.",
    ),
)


def check_model(name: str) -> str:
    """A model name as given to ``--model``: what clients send as ``model``. ValueError
    when it cannot be one (empty, too long, spaces or control characters)."""
    if not 0 < len(name) <= MAX_MODEL_LEN:
        raise InvalidArgument(f"a model name must be 1-{MAX_MODEL_LEN} characters, got {name!r}")
    if not name.isprintable() or any(c.isspace() for c in name):
        raise InvalidArgument(f"a model name has no spaces or control characters, got {name!r}")
    return name


def exposure_options(f: F) -> F:
    for opt in reversed(_OPTIONS):
        f = opt(f)
    return f


def _read(path: str, what: str) -> list[str]:
    from redisbal.gateway.access import read_keys

    try:
        return read_keys(path)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else str(exc).split(":")[0]
        raise click.BadParameter(f"{path}: {reason}", param_hint=what) from None


def _items(values: tuple[str, ...] | str) -> tuple[str, ...]:
    raw = values if isinstance(values, tuple) else (values,)
    return tuple(x.strip() for v in raw for x in v.split(",") if x.strip())


def is_loopback(host: str) -> bool:
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: not known to be loopback
        return False


def exposure(kw: dict[str, Any], nofile: int) -> dict[str, Any]:
    """Pop the exposure options from ``kw``; the Gateway's keyword arguments."""
    from redisbal.gateway.access import ApiKeys, Cors, server_ssl
    from redisbal.gateway.guard import Limits, default_max_connections

    keys = [k for k in kw.pop("api_keys") if k]
    for path in kw.pop("api_key_files"):
        keys += _read(path, "--api-key-file")
    engine_key = kw.pop("engine_api_key")
    engine_file = kw.pop("engine_api_key_file")
    if engine_key is not None and engine_file is not None:
        raise click.UsageError("give --engine-api-key or --engine-api-key-file, not both")
    if engine_file is not None:
        got = _read(engine_file, "--engine-api-key-file")
        if len(got) != 1:
            raise click.BadParameter(f"{engine_file}: holds {len(got)} keys, not one")
        engine_key = got[0]
    certfile, keyfile, ca = kw.pop("ssl_certfile"), kw.pop("ssl_keyfile"), kw.pop("ssl_ca_certs")
    ctx: ssl.SSLContext | None = None
    if certfile is None and (keyfile is not None or ca is not None):
        raise click.UsageError("--ssl-keyfile and --ssl-ca-certs need --ssl-certfile")
    if certfile is not None:
        try:
            ctx = server_ssl(certfile, keyfile, ca)
        except (OSError, ssl.SSLError) as exc:
            reason = str(exc.reason or exc) if isinstance(exc, ssl.SSLError) else exc.strerror
            raise click.BadParameter(
                f"cannot load the TLS certificate or key: {reason}", param_hint="--ssl-certfile"
            ) from None
    origins = _items(kw.pop("allowed_origins"))
    methods, headers = _items(kw.pop("allowed_methods")), _items(kw.pop("allowed_headers"))
    credentials = kw.pop("allow_credentials")
    cors = Cors(origins, methods or ("*",), headers or ("*",), credentials) if origins else None
    cap = kw.pop("max_connections") or default_max_connections(nofile)
    if cap > nofile:
        log.warning("gateway: --max-connections %d is above the open-file limit %d", cap, nofile)
    limits = Limits(
        header_timeout_s=kw.pop("header_timeout_s"),
        keepalive_timeout_s=kw.pop("keepalive_timeout_s"),
        max_connections=cap,
    )
    return {
        "api_keys": ApiKeys(keys) if keys else None,
        "engine_api_key": engine_key,
        "ssl_context": ctx,
        "cors": cors,
        "limits": limits,
        "max_concurrent": kw.pop("max_concurrent_requests"),
        "body_timeout_s": kw.pop("body_timeout_s"),
    }


def warn_if_open(host: str, served: dict[str, Any]) -> None:
    """One warning at start when anyone who can reach the address may use it."""
    if served.get("api_keys") is None and not is_loopback(host):
        log.warning(
            "gateway: listening on %s without an API key: anyone who can reach it may use "
            "it (set --api-key-file or REDISBAL_API_KEY)",
            host,
        )
    if served.get("ssl_context") is None and not is_loopback(host) and served.get("api_keys"):
        log.info("gateway: API keys travel in clear text without TLS (--ssl-certfile)")
