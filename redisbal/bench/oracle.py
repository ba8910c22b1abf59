"""The oracle: join-the-shortest-queue on exact, instantaneous global state."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from redisbal.routing.policies import Policy
from redisbal.routing.state import EngineView, RoutingState
from redisbal.sim.model import SimEngine


@dataclass
class World:
    """What the oracle may see: every live engine's exact state, and requests in transit."""

    engines: dict[str, SimEngine] = field(default_factory=dict)
    dead: set[str] = field(default_factory=set)
    transit: dict[str, int] = field(default_factory=dict)

    def load(self, engine_id: str) -> float:
        e = self.engines.get(engine_id)
        if e is None or engine_id in self.dead:
            return math.inf
        return e.load + self.transit.get(engine_id, 0)


class OraclePolicy(Policy):
    """Join-the-shortest-queue on exact, instantaneous global state (waiting + running
    + in transit, over all API servers), uniform random tie-break. Greedy: a reference
    point, not an upper bound."""

    name = "oracle"

    def __init__(self, world: World) -> None:
        self.world = world

    def pick(self, core: RoutingState) -> EngineView:
        best: EngineView | None = None
        best_load = math.inf
        ties = 0
        rnd = core.rng.random
        for e in core.engines:
            load = self.world.load(e.engine_id)
            if load < best_load:
                best, best_load, ties = e, load, 1
            elif load == best_load and load < math.inf:
                ties += 1
                if rnd() * ties < 1.0:
                    best = e
        return best if best is not None else core.engines[0]
