"""Every exception redisbal raises to its callers, under one root.

``except redisbal.RedisbalError`` catches any of them; each also keeps the built-in
base it always had (``ValueError`` for bad input, ``RuntimeError`` for a state that
cannot serve the call), so ``except ValueError`` keeps working. The modules that
raise them re-export them under their old names. Redis's own errors (an outage, a
refusal) stay redis-py's: ``connection.OUTAGE_ERRORS`` names the outages.
"""

from __future__ import annotations

import redis.exceptions


class RedisbalError(Exception):
    """The root of every exception redisbal raises."""


# -- the library ---------------------------------------------------------------------------


class InvalidArgument(RedisbalError, ValueError):
    """An argument or setting redisbal cannot use; the message names it and what it
    takes (one line). The more specific classes below say which kind of input it was."""


class MalformedData(RedisbalError, ValueError):
    """Data read back that is not in redisbal's format: an engine record, a snapshot, a
    told-routes message (written by another version, or not by redisbal)."""


class InvalidState(RedisbalError, RuntimeError):
    """An object that cannot serve the call in its present state: closed, not started,
    on another event loop, or called from its own thread."""


class InvalidName(RedisbalError, ValueError):
    """A deployment or engine name that cannot be used in a Redis key."""


class InvalidReport(RedisbalError, ValueError):
    """A report argument that is not acceptable; names the field."""


class InvalidURL(RedisbalError, ValueError):
    """An engine URL that is not an http(s) base URL; names the field."""


class BadRedisURL(RedisbalError, ValueError):
    """A Redis URL that redisbal cannot use."""


class WrongServer(redis.exceptions.ResponseError, BadRedisURL):
    """The URL reaches a server that cannot be used as the URL says: not Redis at all, or
    not a Redis Cluster. A configuration error, not an outage: handled as a refusal (a
    ResponseError, which every component reports), never as a reason to route on local
    state; a RedisError, so redis-py drops the half-open connection."""


class PasswordError(redis.exceptions.AuthenticationError, BadRedisURL):
    """The server wants a password the URL does not give, or refused the one it gives.
    Still redis-py's AuthenticationError, so an outage as before: reporters and routers
    keep retrying, and recover once the server's password or ACL is put right."""


class NoEngines(RedisbalError, RuntimeError):
    """No engine is known yet: nothing to route to."""


class UnknownEngine(RedisbalError, ValueError):
    """A pinned engine that is not (or no longer) in the deployment."""


class LeaseUnavailable(RedisbalError, RuntimeError):
    """Every index up to MAX_CLIENTS is leased."""


class RosterUnknown(RedisbalError, ValueError):
    """A compact message names a roster this reader has not seen: read the stored
    snapshot, which always carries its roster."""


class LuaSourceError(RedisbalError):
    """A Lua file that is missing, or includes that form a cycle."""


# -- the integrations ----------------------------------------------------------------------


class PageError(RedisbalError, ValueError):
    """A /metrics page that does not carry the counts a report needs (one line)."""


class SidecarError(RedisbalError):
    """A configuration the sidecar cannot run with (one line, names the culprit)."""


class PluginConfigError(RedisbalError, ValueError):
    """An environment setting the plugin cannot use (one line, names the variable)."""


# -- the tooling (simulator, benchmarks) ---------------------------------------------------


class TraceError(RedisbalError, ValueError):
    """A bad trace line: the message names the line number and the field."""


class SetupFailed(RedisbalError, RuntimeError):
    """The simulator or a benchmark could not set up or drive what it runs: a server or
    process that did not start, get ready or answer; the message says which."""


class RedisServerNotFound(RedisbalError, RuntimeError):
    """No redis-server binary available."""


class DemoError(RedisbalError, RuntimeError):
    """The demo could not run to the end (the message says which process and why)."""


class RouterError(RedisbalError, RuntimeError):
    """A peer router could not be installed, started or read; the message says why."""


class CalibrationError(RedisbalError, ValueError):
    """A real-time run the simulator cannot mirror; the message says what."""


class UpstreamError(RedisbalError):
    """The gateway's request to an engine failed: dropped, reset or malformed."""


class UpstreamClosed(UpstreamError):
    """The engine closed the connection before its answer's end."""


class UpstreamUnreachable(UpstreamError):
    """No connection to the engine (refused, unresolvable, connect timeout): the
    request never reached it."""


class MissingExtra(RedisbalError, RuntimeError):
    """A feature asked for needs an optional extra that is not installed; the message
    names it and how to install it."""
