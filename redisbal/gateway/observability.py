"""``redisbal gateway``'s options for following requests afterwards: the access log's
format and the OTLP traces endpoint; and what they make (the ``Gateway``'s
``access_log`` and ``tracing``), checked with one-line usage errors."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any, TypeVar

import click

from redisbal.gateway.accesslog import DEFAULT_FORMAT, FORMATS

log = logging.getLogger("redisbal.gateway")

F = TypeVar("F", bound=Callable[..., Any])

_OPTIONS = (
    click.option(
        "--access-log",
        type=click.Choice(FORMATS),
        default=DEFAULT_FORMAT,
        show_default=True,
        envvar="REDISBAL_ACCESS_LOG",
        show_envvar=True,
        help="One line per proxied request to stderr (id, model, engine, status, hold, "
        "time to first token, duration, tokens, retries, outcome; no keys, no prompt "
        "text): key=value text, JSON, or none.",
    ),
    click.option(
        "--otlp-traces-endpoint",
        envvar="REDISBAL_OTLP_TRACES_ENDPOINT",
        show_envvar=True,
        metavar="URL",
        help="Export traces of the requests over OTLP/HTTP to this collector (e.g. "
        "http://otel-collector:4318; /v1/traces is added to a URL without a path). The "
        "OTEL_* variables apply (OTEL_TRACES_SAMPLER, OTEL_SERVICE_NAME, "
        "OTEL_EXPORTER_OTLP_HEADERS...); OTEL_EXPORTER_OTLP_ENDPOINT or its _TRACES_ "
        "form alone turns it on too. Needs the 'tracing' extra.",
    ),
)


def observability_options(f: F) -> F:
    for opt in reversed(_OPTIONS):
        f = opt(f)
    return f


def observability(kw: dict[str, Any]) -> dict[str, Any]:
    """Pop the options from ``kw``; the Gateway's ``access_log`` and ``tracing``."""
    from redisbal.gateway.accesslog import AccessLog
    from redisbal.gateway.tracing import MissingExtra, Tracing, env_endpoint, traces_endpoint

    fmt, endpoint = kw.pop("access_log"), kw.pop("otlp_traces_endpoint")
    access_log = None if fmt == "off" else AccessLog(fmt)
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        if endpoint or env_endpoint():
            log.info("gateway: OTEL_SDK_DISABLED=true: not tracing")
        return {"access_log": access_log, "tracing": None}
    if not endpoint and not env_endpoint():
        return {"access_log": access_log, "tracing": None}
    for var in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        protocol = os.environ.get(var)
        if protocol and protocol.strip() != "http/protobuf":
            raise click.UsageError(f"{var}={protocol}: the gateway exports http/protobuf only")
    url = None
    if endpoint:
        try:
            url = traces_endpoint(endpoint)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--otlp-traces-endpoint") from None
    try:
        tracing = Tracing(url, resource={"redisbal.policy": kw.get("policy") or "redisbal"})
    except MissingExtra as exc:
        if endpoint:
            raise click.ClickException(f"--otlp-traces-endpoint: {exc}") from None
        log.warning("gateway: an OTLP endpoint is set in the environment, but %s", exc)
        return {"access_log": access_log, "tracing": None}
    log.info("gateway: exporting traces to %s", url or env_endpoint())
    return {"access_log": access_log, "tracing": tracing}
