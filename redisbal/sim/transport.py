"""How simulated requests travel between ``redisbal api`` and ``redisbal engine-sim``.

This is a simulation transport, not part of the balancer: the balancer only
decides *which* engine gets a request; in a real deployment the API server
then sends it over its own RPC. Here the "RPC" is two kinds of Redis lists,
under the deployment's hash tag so that they live in its Cluster slot:

- ``redisbal:{<dep>}:sim:req:<engine>``: requests for one engine. An API
  server RPUSHes ``"<client_index> <rid> <burst> <output_len>"``; the
  engine-sim process pops them in batches (LPOP with a count).
- ``redisbal:{<dep>}:sim:done:<client_index>``: completions for one API
  server: the engine-sim RPUSHes ``"<rid> <decode_ms>"`` (``DoneMsg``); the API
  server pops them in batches and calls ``router.finished()``. ``decode_ms`` is
  how long the request took from its first token to its end on the engine's
  clock, so the API server gets the TTFT from its own clock alone: its
  end-to-end latency minus that (no two processes' clocks are compared).
- ``redisbal:{<dep>}:sim:progress``: HASH of counters (sent:<i>, done:<i>)
  that ``redisbal demo`` shows as a progress line.

Keys are built only from names that passed ``check_name`` (engine ids) or
from whole numbers (client indexes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from redisbal.errors import InvalidArgument
from redisbal.keys import DeploymentKeys, check_name

POP_BATCH = 1024
NO_BURST = -1


@dataclass(frozen=True, slots=True)
class RequestMsg:
    """One simulated request on the wire."""

    client_index: int
    rid: int
    burst: int  # burst number, or NO_BURST for background (Poisson) traffic
    output_len: int

    def encode(self) -> str:
        return f"{self.client_index} {self.rid} {self.burst} {self.output_len}"

    @classmethod
    def decode(cls, raw: bytes | str) -> RequestMsg:
        text = raw.decode() if isinstance(raw, bytes) else raw
        ci, rid, burst, out = text.split()
        return cls(int(ci), int(rid), int(burst), int(out))


@dataclass(frozen=True, slots=True)
class DoneMsg:
    """One completion on the wire: the request and its decode time (first token to
    end, in ms; None from a sender that does not tell)."""

    rid: int
    decode_ms: float | None = None

    def encode(self) -> str:
        return str(self.rid) if self.decode_ms is None else f"{self.rid} {self.decode_ms:.3f}"

    @classmethod
    def decode(cls, raw: bytes | str) -> DoneMsg:
        text = raw.decode() if isinstance(raw, bytes) else raw
        rid, _, ms = text.partition(" ")
        return cls(int(rid), float(ms) if ms else None)


def ttft_s(e2e_s: float, decode_ms: float) -> float:
    """Time to first token as an API server sees it: its own end-to-end latency minus
    the decode time the engine measured (never below 0: the two clocks tick at
    slightly different times)."""
    return max(0.0, e2e_s - decode_ms / 1000.0)


class SimKeys:
    """Key names of the simulation transport of one deployment."""

    def __init__(self, deployment: str) -> None:
        self.base = DeploymentKeys(deployment)

    def requests(self, engine_id: str) -> str:
        return self.base.key("sim:req:" + check_name(engine_id, "engine_id"))

    def done(self, client_index: int) -> str:
        if isinstance(client_index, bool) or not isinstance(client_index, int) or client_index < 0:
            raise InvalidArgument(f"client_index must be a whole number >= 0, got {client_index!r}")
        return self.base.key(f"sim:done:{client_index}")

    @property
    def progress(self) -> str:
        return self.base.key("sim:progress")


def popped(reply: Any) -> list[bytes]:
    """LPOP with a count returns None for an empty list; normalise to a list."""
    if reply is None:
        return []
    if isinstance(reply, list):
        return reply
    return [reply]
