"""Simulated engines and load for tests, demos and benchmarks.

``model`` is the engine model; ``http_engine`` serves it over OpenAI-compatible HTTP.
The model's names are re-exported here for the modules that import them from
``redisbal.sim``.
"""

from redisbal.sim.model import EngineParams, SimEngine, SimRequest, output_length

__all__ = ["EngineParams", "SimEngine", "SimRequest", "output_length"]
