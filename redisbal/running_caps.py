"""Declared running caps: how many requests each engine runs at once, by its own word.

An engine that knows its cap (vLLM's ``max_num_seqs``, SGLang's
``max_running_requests``, engine-sim's ``--running-cap``) declares it once when it
attaches, in the deployment's ``running_caps`` hash (engine id -> the cap as a
decimal), as it stores its URL; its reporter writes it again every few seconds, so
it survives a Redis that restarted empty, and deletes it when the engine leaves.
Routers read the hash when they see new engines and every few seconds: the cap
travels once per engine, never in a report. Every value is checked before it is
stored and again when it is read: another client may have written the hash.
"""

from __future__ import annotations

import logging
from typing import Any

from redisbal.connection import AsyncRedisClient, RedisClient
from redisbal.errors import InvalidArgument
from redisbal.keys import DeploymentKeys, InvalidName, check_name

log = logging.getLogger("redisbal.running_caps")

MAX_RUNNING_CAP = 1_000_000  # far above any engine's (vLLM's default: 256-1024)


def check_running_cap(value: object, what: str = "running_cap") -> int:
    """Return ``value`` if it is a whole number from 1 to MAX_RUNNING_CAP, else raise
    InvalidArgument (a bool or a float is refused: a cap is a count of requests)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(
            f"{what} must be a whole number of requests >= 1, got {type(value).__name__} {value!r}"
        )
    if not 1 <= value <= MAX_RUNNING_CAP:
        raise InvalidArgument(f"{what} must be 1..{MAX_RUNNING_CAP}, got {value}")
    return value


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def parse(raw: dict[Any, Any]) -> dict[str, int]:
    """The hash's entries as engine id -> cap; bad ones are skipped with a warning."""
    out: dict[str, int] = {}
    for k, v in raw.items():
        try:
            text = _text(v)
            if not text.isascii() or not text.isdigit():
                raise InvalidArgument(f"running cap {text[:20]!r} is not a whole number")
            out[check_name(_text(k), "engine id")] = check_running_cap(int(text))
        except (InvalidName, InvalidArgument, UnicodeDecodeError) as exc:  # (not UTF-8 text)
            log.warning("running_caps: ignoring a bad entry: %s", exc)
    return out


async def fetch(client: AsyncRedisClient, keys: DeploymentKeys) -> dict[str, int]:
    """Every declared cap (engine id -> cap) of the deployment."""
    return parse(await client.hgetall(keys.running_caps))


def fetch_sync(client: RedisClient, keys: DeploymentKeys) -> dict[str, int]:
    """Blocking twin of ``fetch``."""
    return parse(client.hgetall(keys.running_caps))
