"""When the gateway tries another engine: which answers are retryable, and the budget
that keeps retries from amplifying a deployment-wide problem."""

from __future__ import annotations

import hashlib
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable

from redisbal.errors import InvalidArgument

# answers that say the engine did not serve the request (retried before the first byte)
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})


# answers that refuse the request itself (bad credentials, no such model): the client's
# mistake, passed on, unless another engine accepted the same (``Acceptances``)
REFUSAL_STATUSES = frozenset({401, 403, 404})


def status_kind(status: int) -> str:
    """The outcome kind (redisbal.routing.outcomes.FAILURES) of a retryable status."""
    return "429" if status == 429 else "5xx"


class Retry(Exception):
    """An attempt failed before any byte reached the client: another engine may serve it.
    ``kind`` is the outcome (redisbal.routing.outcomes.FAILURES); ``unsent``: no engine works
    on the request (the connection was refused, or the engine's process is not
    running: first_byte.Silent), so retrying it adds no load and needs no budget.
    ``detail`` is logged; ``public`` (``detail`` unless given) goes to the client: no
    engine address in it."""

    def __init__(
        self,
        kind: str,
        detail: str,
        status: int = 502,
        unsent: bool = False,
        public: str | None = None,
    ) -> None:
        super().__init__(detail)
        self.kind, self.detail, self.status, self.unsent = kind, detail, status, unsent
        self.public = detail if public is None else public


class RetryBudget:
    """Retries at most ``ratio`` of the requests of the last ``window_s`` seconds (and
    ``floor`` per window whatever the traffic, so that a quiet gateway still retries):
    when every engine fails, retries stop growing the load with the traffic."""

    def __init__(
        self,
        ratio: float = 0.2,
        window_s: float = 10.0,
        floor: int = 10,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if isinstance(ratio, bool) or not 0 <= ratio < math.inf:
            raise InvalidArgument(f"ratio must be finite and >= 0, got {ratio!r}")
        if not 0 < window_s < math.inf:
            raise InvalidArgument(f"window_s must be finite and > 0, got {window_s!r}")
        self.ratio, self.window_s, self.floor, self.clock = ratio, window_s, floor, clock
        # one [second, requests, retries] per second of the window
        self._buckets: deque[list[int]] = deque()
        self.requests = self.retries = 0  # within the window

    def _now(self) -> list[int]:
        sec = int(self.clock())
        b = self._buckets
        while b and b[0][0] <= sec - self.window_s:
            _, req, ret = b.popleft()
            self.requests -= req
            self.retries -= ret
        if not b or b[-1][0] != sec:
            b.append([sec, 0, 0])
        return b[-1]

    def request(self) -> None:
        """A request arrived."""
        self._now()[1] += 1
        self.requests += 1

    def room(self) -> bool:
        """Whether the budget has a retry now (taking none)."""
        self._now()
        return self.retries + 1 <= max(self.floor, self.ratio * self.requests)

    def allow(self) -> bool:
        """Take one retry if the budget has one."""
        if not self.room():
            return False
        self._buckets[-1][2] += 1
        self.retries += 1
        return True


class Acceptances:
    """Which engines accepted which (credentials, model) lately: the evidence that a
    401, 403 or 404 from one engine is that engine's fault. A refusal of what another
    engine of the deployment accepted within ``window_s`` (the same Authorization
    header and model) is a broken engine (a wrong engine key, a model or LoRA missing
    there); one nobody accepted (a bad key, a model no engine serves) is the client's
    own mistake and goes back to it. Credentials are kept as a digest, never as sent;
    at most ``max_keys`` pairs, the least recently accepted dropped first."""

    def __init__(
        self,
        window_s: float = 60.0,
        max_keys: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 < window_s < math.inf:
            raise InvalidArgument(f"window_s must be finite and > 0, got {window_s!r}")
        if max_keys < 1:
            raise InvalidArgument(f"max_keys must be >= 1, got {max_keys!r}")
        self.window_s, self.max_keys, self.clock = window_s, max_keys, clock
        self._by_key: OrderedDict[bytes, dict[str, float]] = OrderedDict()

    @staticmethod
    def key(auth: str | None, model: object) -> bytes:
        """The digest standing for a request's credentials and model."""
        text = f"{auth or ''}\0{model if isinstance(model, str) else ''}"
        return hashlib.blake2b(text.encode(errors="replace"), digest_size=16).digest()

    def accepted(self, key: bytes, engine: str) -> None:
        """``engine`` answered a request of ``key`` (a 2xx)."""
        engines = self._by_key.get(key)
        if engines is None:
            engines = self._by_key[key] = {}
            if len(self._by_key) > self.max_keys:
                self._by_key.popitem(last=False)
        else:
            self._by_key.move_to_end(key)
        engines[engine] = self.clock()

    def elsewhere(self, key: bytes, engine: str) -> bool:
        """Whether an engine other than ``engine`` accepted ``key`` within the window."""
        engines = self._by_key.get(key)
        if not engines:
            return False
        since = self.clock() - self.window_s
        return any(t >= since for e, t in engines.items() if e != engine)
