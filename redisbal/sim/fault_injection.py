"""Faults injected into a simulated HTTP engine, for reliability tests.

``POST /sim/fault`` (redisbal.sim.http_engine) sets them with a JSON body; the
engine's model and reports go on as if all were well, which is the point:
``{"mode": "status", "status": 500}`` answers every generation request with
that status (429, 500, 503, or a 4xx: a rejection) before taking it in;
``{"mode": "stall"}`` stops every stream and whole answer from sending (the
connection stays open); ``{"mode": "none"}`` ends the fault (stalled answers
flow again). A hung engine is SIGSTOP's.
"""

from __future__ import annotations

import asyncio

import orjson

MODES = ("none", "status", "stall")


class FaultInjection:
    """One engine's fault: what it is now, and the gate its answers wait at."""

    def __init__(self) -> None:
        self.mode = "none"
        self.status = 500
        self._flowing = asyncio.Event()  # cleared while stalled
        self._flowing.set()

    def set(self, raw: bytes) -> str | None:
        """Apply a ``POST /sim/fault`` body; the reason it is refused, or None."""
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            return f"malformed JSON: {exc}"
        mode = body.get("mode") if isinstance(body, dict) else None
        status = body.get("status", 500) if isinstance(body, dict) else None
        if mode not in MODES:
            return f"mode must be one of {', '.join(MODES)}"
        if mode == "status" and (
            isinstance(status, bool) or not isinstance(status, int) or not 400 <= status <= 599
        ):
            return "status must be a whole number in 400..599"
        self.mode, self.status = mode, int(status or 500)
        if mode == "stall":
            self._flowing.clear()
        else:
            self._flowing.set()
        return None

    @property
    def rejection(self) -> int | None:
        """The status every generation request is answered with now, if any."""
        return self.status if self.mode == "status" else None

    async def flowing(self) -> None:
        """Return once answers may be sent (at once unless stalled)."""
        await self._flowing.wait()
