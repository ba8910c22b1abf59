"""The process tests' own helper (support.procs.Proc): once its child is gone, both of
its pipes are closed. One left open warns (ResourceWarning, unclosed file) when the
garbage collector reaches it, in whichever later test of the worker that is."""

from __future__ import annotations

import time

import pytest
from support.helpers import wait_until
from support.procs import Proc


def pipes_closed(p: Proc) -> bool:
    assert p.proc.stdout is not None and p.proc.stderr is not None
    return p.proc.stdout.closed and p.proc.stderr.closed


@pytest.mark.parametrize("stop", ["kill", "terminate"])
def test_a_stopped_proc_has_closed_its_pipes(redis_url: str, deployment: str, stop: str) -> None:
    args = ["--url", redis_url, "--deployment", deployment, "--id", "e0", "--t0", str(time.time())]
    p = Proc("engine", args, "engine e0")
    try:
        p.wait_ready()
    finally:
        getattr(p, stop)()
    assert pipes_closed(p)
    assert p.last(), "its stdout lines were read"


def test_a_proc_that_exits_by_itself_closes_its_pipes() -> None:
    p = Proc("engine", ["--url", "redis://127.0.0.1:9/0"], "engine")  # no --deployment: exits
    wait_until(lambda: pipes_closed(p), 20, "both pipes closed")
    assert p.proc.wait(5) == 2
    assert "required" in p.tail(), p.tail()
