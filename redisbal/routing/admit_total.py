"""Routes on their way to an engine from a total admitted count: what engines that
report no per-API-server admitted counts (vLLM's plugin, the sidecar) can still say.

Such an engine can report ``total``, the requests it has taken in since its process
began: finished + waiting + running (vLLM: ``IterationStats.finished_requests``
summed, plus ``SchedulerStats``; the sidecar: ``request_success_total`` + waiting +
running). Every router knows the routes it sent to that process, and, while routers
tell each other their routes (``routing.told_routes``), the others' too: ``sent``.
Then ``gap = sent - total`` is the routes on their way plus a drift:

- requests the engine took in that never reach its finished count (vLLM drops aborted
  ones from ``finished_requests``): the total drifts low, the gap high;
- requests from outside the routers, or a router not counted: the gap low.

The drift is unknown but bounded: what is on its way is at least 0 and at most the
requests the routers still have open there (``open``: a request on its way has not
ended; an aborted one has). So the estimator keeps a baseline ``base`` for the drift,
moved only as far as needed to keep ``gap - base`` within ``[0, open]``, and counts
``gap - base`` routes on their way. A route aborted (closed, never finished) raises the
lower bound and so the baseline; a router's routes leaving the sum lower the upper
one. Nothing accumulates: each estimate is within the bounds of that moment's counts,
so the error from drift is at most the open requests, and is 0 whenever the
routers have nothing open there (idle moments pin the baseline exactly). A new
incarnation of the engine (a restart resets its counter) starts the baseline anew;
a reset the incarnation does not show is absorbed by the same bounds.
"""

from __future__ import annotations

from dataclasses import dataclass

from redisbal.barrier.snapshot import check_total
from redisbal.errors import InvalidArgument

__all__ = ["TotalReconciler", "check_total"]


@dataclass
class TotalReconciler:
    """One engine's routes on their way, from its admitted total (module docstring).
    Pure: fed counts, it keeps only the drift baseline and the incarnation."""

    incarnation: str | None = None
    base: int = 0  # the drift: gap - routes on their way

    def in_transit(self, incarnation: str | None, total: int, sent: int, open_: int) -> int:
        """Routes of all routers on their way to the engine: ``sent`` routes to its
        process ``incarnation``, ``total`` admitted, and ``open_`` the routes that may
        still be on their way: not ended, and (the tighter, the better the estimate
        under load) made recently enough, e.g. after the engine's cut less a generous
        transit allowance, since a request running for long is not in transit."""
        check_total(total)
        if sent < 0 or open_ < 0:
            raise InvalidArgument(f"sent and open must be >= 0, got {sent} and {open_}")
        if incarnation != self.incarnation:  # a new process: its total starts again
            self.incarnation, self.base = incarnation, 0
        # A total that falls is not a reset by itself (an abort takes a request out of
        # waiting or running without adding it to finished); a counter reset under the
        # same name raises the gap, and the lower bound below absorbs it at once.
        gap = sent - total
        self.base = min(max(self.base, gap - open_), gap)  # gap - base in [0, open_]
        return gap - self.base
