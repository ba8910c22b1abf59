"""redisbal: a Redis-backed shared-state load balancer for data-parallel LLM engines.

Engines report step-tagged queue counts (``EngineReporter``); a Lua barrier in
Redis publishes a consistent snapshot once every live engine has reported the
step; API servers route each request locally from that snapshot plus their own
bookkeeping (``AsyncRouter`` / ``Router``); ``redisbal coordinator`` keeps
membership, liveness and stalled barriers in order.
"""

from redisbal.engine import (
    AsyncEngineReporter,
    EngineReporter,
    InvalidReport,
    ReporterStats,
    ReportResult,
    ReportSender,
)
from redisbal.keys import DeploymentKeys, InvalidName
from redisbal.policies import POLICIES, Decision, NoEngines, UnknownEngine
from redisbal.router import AsyncRouter, Router
from redisbal.snapshot import EngineCounts, Snapshot

__version__ = "0.1.0"

__all__ = [
    "POLICIES",
    "AsyncEngineReporter",
    "AsyncRouter",
    "Decision",
    "DeploymentKeys",
    "EngineCounts",
    "EngineReporter",
    "InvalidName",
    "InvalidReport",
    "NoEngines",
    "ReportResult",
    "ReportSender",
    "ReporterStats",
    "Router",
    "Snapshot",
    "UnknownEngine",
    "__version__",
]
