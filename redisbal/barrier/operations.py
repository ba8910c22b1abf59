"""Running the Lua operations: as Redis 7 functions (FCALL) or scripts (EVALSHA).

Each operation is one file ``lua/<name>.lua`` with the includes it needs
(redisbal/barrier/loader.py builds the sources), so it exists once in source while
every call stays one atomic server-side operation. Two ways to run them, same
source, same results:

- **Functions (Redis >= 7.0, preferred).** All operations form one library,
  ``redisbal_<hash>``, defined once by ``FUNCTION LOAD``; a call is ``FCALL``.
  The shared helpers are defined at load time instead of on every call. The
  hash of the library text is in its name, so two redisbal versions on one
  server never clash.
- **Scripts (Redis 6.2, or a user without ``+fcall``).** Each operation is its
  includes followed by its own file, run with ``EVALSHA`` through
  ``register_script`` (redis-py reloads it after NOSCRIPT by itself).

``Scripts`` picks by itself: it tries FCALL, loads the library when the server
lacks it (restart without persistence, FUNCTION FLUSH, a failover to a node
that never had it), and falls back to EVALSHA for good when the server has no
functions or the user may not call or load them. Callers never see any of it.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import redis

from redisbal.barrier.loader import NUM_KEYS, SCRIPT_NAMES, library, script_source
from redisbal.connection import AsyncRedisClient, RedisClient
from redisbal.errors import InvalidState
from redisbal.keys import DeploymentKeys

MAX_REASON = 200  # lua/suspect.lua refuses a longer reason
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def suspect_reason(reason: str) -> str:
    """A suspect mark's reason as lua/suspect.lua takes it: control characters replaced
    by spaces, cut to MAX_REASON characters (it is free text a caller saw, never an
    error of the caller's)."""
    return _CONTROL.sub(" ", reason)[:MAX_REASON]


def report_reply(raw: Any) -> tuple[str, int, int, int]:
    """(status, version, wave, step) from what lua/report.lua returns (a "conflict"
    reply also names the record's incarnation: ``raw[4]``)."""
    status, version, wave, step = raw[:4]
    if isinstance(status, bytes):
        status = status.decode()
    return str(status), int(version), int(wave), int(step)


def load_library(client: redis.Redis) -> str:
    """Load (or replace with the same text) the function library; returns its name.
    FUNCTION LOAD is server-wide: see docs/DEPLOY.md before granting it to a user."""
    name, source = library()
    client.function_load(source, replace=True)
    return name


def _classify(exc: redis.RedisError) -> str:
    """What an error from FCALL or FUNCTION LOAD means for the mode: 'load' (the
    library is missing), 'scripts' (no functions here, or not allowed), or 'raise'."""
    if isinstance(exc, (redis.ConnectionError, redis.TimeoutError)):
        return "raise"  # an outage: the caller's business
    msg = str(exc).lower()
    if msg.startswith("redisbal:") or "redisbal: " in msg:
        return "raise"  # our own validation errors, from a function that ran
    if "function not found" in msg or "library not found" in msg:
        return "load"
    if isinstance(exc, redis.exceptions.NoPermissionError) or "unknown command" in msg:
        return "scripts"
    if "doesn't exist in redis commands" in msg:  # redis-py's cluster client, on 6.2
        return "scripts"
    return "raise"


class Scripts:
    """The operations of one deployment on one client (sync or asyncio): ``call``
    returns what the client returns, a value or an awaitable of it.

    ``mode`` is "functions" or "scripts" once known ("probe" before the first call);
    ``use_functions=False`` forces EVALSHA."""

    def __init__(
        self,
        client: RedisClient | AsyncRedisClient,
        keys: DeploymentKeys,
        pubcmd: str = "PUBLISH",
        *,
        use_functions: bool = True,
    ) -> None:
        self.keys = keys
        self.pubcmd = pubcmd
        self.mode = "probe" if use_functions else "scripts"
        self._client = client
        self._async = inspect.iscoroutinefunction(getattr(client, "execute_command", None))
        self._keys = keys.script_keys()
        self._lib = library()[0]
        self._scripts = {name: client.register_script(script_source(name)) for name in SCRIPT_NAMES}

    def function_name(self, name: str) -> str:
        if name not in SCRIPT_NAMES:
            raise KeyError(f"unknown script {name!r}; known: {', '.join(SCRIPT_NAMES)}")
        return f"{self._lib}_{name}"

    def fcall_args(self, name: str, *args: str | int | float) -> list[Any]:
        """What ``call`` sends as FCALL's arguments for operation ``name``: the function,
        the key count, the keys, then ARGV = deployment, publish command, *args (for a
        caller that writes the command itself, as scripts/bench_scale_procs.py does)."""
        return self._fcall_args(name, [self.keys.deployment, self.pubcmd, *args])

    def _fcall_args(self, name: str, argv: list[Any]) -> list[Any]:
        return [self.function_name(name), NUM_KEYS, *self._keys, *argv]

    def call(self, name: str, *args: str | int | float, client: Any = None) -> Any:
        """Run operation ``name`` with ARGV = deployment, publish command, *args.
        ``client`` runs it on another client or a pipeline: a pipeline queues FCALL
        once this object has seen the library work, EVALSHA before."""
        argv = [self.keys.deployment, self.pubcmd, *args]
        target = self._client if client is None else client
        if self.mode == "scripts" or (client is not None and _is_pipeline(client)):
            if self.mode == "functions":
                return client.fcall(*self._fcall_args(name, argv))
            return self._scripts[name](keys=self._keys, args=argv, client=client)
        run = self._run(name, argv, target, _awaited if self._async else _ready)
        return run if self._async else _run_to_end(run)

    async def _run(
        self, name: str, argv: list[Any], target: Any, io: Callable[[Any], Awaitable[Any]]
    ) -> Any:
        """One call's Redis operations, written once with asyncio. ``io`` turns what the
        client returned into an awaitable: the client's own coroutine (asyncio client),
        or a value that is ready at once (blocking client), so that a blocking call runs
        this coroutine to its end without ever suspending (``_run_to_end``)."""
        fcall_args = self._fcall_args(name, argv)
        for attempt in range(2):
            try:
                out = await io(target.fcall(*fcall_args))
            except redis.RedisError as exc:
                action = _classify(exc)
                if action == "load" and attempt == 0:
                    try:
                        await io(target.function_load(library()[1], replace=True))
                        continue
                    except redis.RedisError as load_exc:
                        action = _classify(load_exc)
                if action != "scripts":
                    raise
                self.mode = "scripts"
                break
            self.mode = "functions"
            return out
        return await io(self._scripts[name](keys=self._keys, args=argv, client=target))


def _awaited(result: Awaitable[Any]) -> Awaitable[Any]:
    return result


async def _ready(value: Any) -> Any:
    return value


def _run_to_end(coro: Coroutine[Any, Any, Any]) -> Any:
    """The result of a coroutine that never suspends (every await is on a ready value)."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise InvalidState("a blocking Scripts call suspended: it was given an asyncio client")


def _is_pipeline(client: Any) -> bool:
    return hasattr(client, "command_stack") or type(client).__name__.endswith("Pipeline")
