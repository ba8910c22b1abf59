"""redisbal: a Redis-backed shared-state load balancer for data-parallel LLM engines.

Engines report step-tagged queue counts (``Reporter`` / ``AsyncReporter``, for one
engine or for several from one process, one call per round); a Lua barrier in
Redis publishes a consistent snapshot once every live engine has reported the
step; API servers route each request locally from that snapshot plus their own
bookkeeping (``AsyncRouter`` / ``Router``); ``redisbal coordinator`` keeps
membership, liveness and stalled barriers in order. A custom routing policy is a
``Policy`` or a ``ScoringPolicy`` (a score per ``EngineView``, lowest wins). Every
ValueError and RuntimeError redisbal raises is a ``RedisbalError`` (redisbal.errors).
"""

from redisbal.barrier.snapshot import EngineCounts, Snapshot
from redisbal.errors import (
    BadRedisURL,
    InvalidArgument,
    InvalidName,
    InvalidState,
    LeaseUnavailable,
    MalformedData,
    RedisbalError,
)
from redisbal.reporting.reporter import (
    AsyncReporter,
    Counts,
    InvalidReport,
    Reporter,
    ReporterStats,
    ReportResult,
)
from redisbal.routing.policies import (
    DEFAULT_POLICY,
    POLICIES,
    NoEngines,
    Policy,
    ScoringPolicy,
    UnknownEngine,
)
from redisbal.routing.router import AsyncRouter, Router
from redisbal.routing.state import Decision, EngineView, RequestInfo, RoutingState

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_POLICY",
    "POLICIES",
    "AsyncReporter",
    "AsyncRouter",
    "BadRedisURL",
    "Counts",
    "Decision",
    "EngineCounts",
    "EngineView",
    "InvalidArgument",
    "InvalidName",
    "InvalidReport",
    "InvalidState",
    "LeaseUnavailable",
    "MalformedData",
    "NoEngines",
    "Policy",
    "RedisbalError",
    "ReportResult",
    "Reporter",
    "ReporterStats",
    "RequestInfo",
    "Router",
    "RoutingState",
    "ScoringPolicy",
    "Snapshot",
    "UnknownEngine",
    "__version__",
]
