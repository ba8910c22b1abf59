"""A Redis outage leaves no pipeline unclosed: redis-py's "Unclosed Pipeline client"
(a ResourceWarning, and a message to the event loop's exception handler, each with
the pipeline's whole state) must not appear while the sender retries.

Two engines on one sender, so each round goes out as one pipeline; the server is
frozen (SIGSTOP: every call times out) and then killed (refused), on every server
binary (EVALSHA on 6.2 loads its scripts through the pipeline first)."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import warnings
from typing import Any

import pytest
from support.topology import binaries

from redisbal import AsyncReporter, Counts
from redisbal.reporting.sender import ReportSender
from redisbal.sim.embedded import RedisServer

BINARIES = binaries()


@pytest.mark.slow
@pytest.mark.filterwarnings("error::ResourceWarning")
@pytest.mark.parametrize("binary", sorted(BINARIES))
async def test_outage_leaves_no_pipeline_unclosed(binary: str) -> None:
    loop = asyncio.get_running_loop()
    unclosed: list[str] = []

    def handler(_: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        unclosed.append(str(context.get("message")))

    loop.set_exception_handler(handler)
    server = RedisServer(BINARIES[binary], tcp=True).start()
    sender = ReportSender(server.url, backoff_s=0.05, max_backoff_s=0.1, timeout_s=0.2)
    reps = [
        AsyncReporter(deployment="dep", engines=e, sender=sender, heartbeat_s=0.02)
        for e in ("e0", "e1")
    ]
    # what earlier tests left for the collector is theirs: collected before the count
    gc.collect()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(1, 4):
                for rep in reps:
                    assert (
                        await rep.report(Counts(step=step, waiting=0, running=1), wait=True)
                    ).accepted
            assert server.proc is not None
            os.kill(server.proc.pid, signal.SIGSTOP)  # frozen: calls time out
            for step in range(4, 30):
                for rep in reps:
                    rep.report_nowait(Counts(step=step, waiting=0, running=1))
                await asyncio.sleep(0.02)
            server.kill()  # gone: calls are refused (a stopped process dies on SIGKILL)
            for step in range(30, 50):
                for rep in reps:
                    rep.report_nowait(Counts(step=step, waiting=0, running=1))
                await asyncio.sleep(0.02)
            gc.collect()
            await asyncio.sleep(0)
        assert all(rep.stats().unavailable > 0 for rep in reps), [r.stats() for r in reps]
        assert not [w for w in caught if "Unclosed" in str(w.message)], caught
        assert not [m for m in unclosed if "Unclosed" in m], unclosed
    finally:
        for rep in reps:
            await rep.aclose(leave=False, timeout=0.1)
        await sender.aclose()
        loop.set_exception_handler(None)
        server.cleanup()
