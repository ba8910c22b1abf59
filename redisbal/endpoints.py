"""Engine URL registry: where each engine of a deployment serves HTTP.

An engine stores its base URL (``http://host:port``, what an OpenAI client would
be pointed at) in the deployment's ``urls`` hash when it registers; gateways read
the hash (and re-read it periodically) so that they find engines and their URLs
from Redis alone. Every URL is checked before it is stored and again when it is
read: another client may have written the hash.
"""

from __future__ import annotations

import logging
from typing import Any
from urllib.parse import urlsplit

from redisbal.connection import AsyncRedisClient, RedisClient
from redisbal.errors import InvalidURL as InvalidURL
from redisbal.keys import DeploymentKeys, InvalidName, check_name

log = logging.getLogger("redisbal.endpoints")

MAX_URL_LEN = 512


def check_url(value: object, what: str = "engine url") -> str:
    """Return ``value`` as a normalised base URL (no trailing slash), else raise.

    Bounded length, http or https, a host, printable ASCII, no query or fragment:
    the gateway appends ``/v1/...`` to it and a URL with credentials is refused so
    that none is ever stored in Redis in the clear.
    """
    if not isinstance(value, str):
        raise InvalidURL(f"{what} must be a string, got {type(value).__name__}")
    if not 0 < len(value) <= MAX_URL_LEN:
        raise InvalidURL(f"{what} must be 1-{MAX_URL_LEN} characters, got {len(value)}")
    if not value.isascii() or not value.isprintable() or " " in value:
        raise InvalidURL(f"{what} must be printable ASCII without spaces: {value[:80]!r}")
    try:
        parts = urlsplit(value)
        port = parts.port  # raises on a bad port
    except ValueError as exc:
        raise InvalidURL(f"{what} {value[:80]!r}: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise InvalidURL(f"{what} must start with http:// or https://, got {value[:80]!r}")
    if not parts.hostname:
        raise InvalidURL(f"{what} has no host: {value[:80]!r}")
    if parts.username is not None or parts.password is not None:
        raise InvalidURL(f"{what} must not carry credentials")
    if parts.query or parts.fragment:
        raise InvalidURL(f"{what} must have no query or fragment: {value[:80]!r}")
    if port == 0:
        raise InvalidURL(f"{what} has port 0: {value[:80]!r}")
    return value.rstrip("/")


def parse_engine_arg(value: str) -> tuple[str, str]:
    """``ID=URL`` (the gateway's ``--engine``) -> (engine id, base URL), both checked."""
    eid, sep, url = value.partition("=")
    if not sep:
        raise InvalidURL(f"--engine wants ID=URL, got {value[:80]!r}")
    try:
        check_name(eid, "engine id")
    except InvalidName as exc:
        raise InvalidURL(str(exc)) from None
    return eid, check_url(url)


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _parse(raw: dict[Any, Any]) -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in raw.items():
        try:
            out[check_name(_text(k), "engine id")] = check_url(_text(v))
        except (InvalidName, InvalidURL) as exc:
            log.warning("endpoints: ignoring a bad entry in the urls hash: %s", exc)
    return out


async def register(client: AsyncRedisClient, keys: DeploymentKeys, engine_id: str, url: str) -> str:
    """Store ``engine_id``'s base URL (asyncio client); returns the stored URL."""
    eid, clean = check_name(engine_id, "engine_id"), check_url(url)
    await client.hset(keys.urls, eid, clean)
    return clean


def register_sync(client: RedisClient, keys: DeploymentKeys, engine_id: str, url: str) -> str:
    """Blocking twin of ``register``."""
    eid, clean = check_name(engine_id, "engine_id"), check_url(url)
    client.hset(keys.urls, eid, clean)
    return clean


async def unregister(client: AsyncRedisClient, keys: DeploymentKeys, engine_id: str) -> None:
    await client.hdel(keys.urls, check_name(engine_id, "engine_id"))


async def fetch(client: AsyncRedisClient, keys: DeploymentKeys) -> dict[str, str]:
    """Every registered engine -> URL (bad entries are skipped with a warning)."""
    return _parse(await client.hgetall(keys.urls))


def fetch_sync(client: RedisClient, keys: DeploymentKeys) -> dict[str, str]:
    return _parse(client.hgetall(keys.urls))
