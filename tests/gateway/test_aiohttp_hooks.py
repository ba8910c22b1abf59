"""aiohttp's private hooks that the gateway's connection guard (redisbal.gateway.guard)
leans on still exist, with the shapes the guard's overrides assume.

aiohttp may rename or reshape a private name in any minor release. The guard would not
fail loudly then: an override that aiohttp no longer calls simply stops working, and
with it the slowloris bound and the connection cap. So each hook is checked here, on
the installed aiohttp (CI runs this on the newest the pin allows and on its floor), by
inspecting aiohttp's own classes and a real runner's server and handler; a failure
names the hook. When one fails, fix the guard for that release before raising the
upper bound of the pin in pyproject.toml.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_runner import BaseRunner
from aiohttp.web_server import Server

from redisbal.gateway.guard import (
    ConnectionGuard,
    GuardedHandler,
    GuardedRunner,
    GuardedServer,
    Limits,
)

pytestmark = pytest.mark.gateway  # .ci/run runs these on the lowest aiohttp too

AIOHTTP = f"aiohttp {aiohttp.__version__}"
KEEPALIVE_S = 12.5  # a value of our own, to find where the runner's kwargs land

# RequestHandler's methods the guard overrides or calls: (parameters after self, async).
# The guard's overrides take the same parameters (checked too), so aiohttp's calls reach them.
HANDLER_METHODS: dict[str, tuple[list[str], bool]] = {
    "_handle_request": (["request", "start_time", "request_handler"], True),
    "connection_made": (["transport"], False),
    "connection_lost": (["exc"], False),
    "data_received": (["data"], False),
    "handle_error": (["request", "status", "exc", "message"], False),
    "force_close": ([], False),
}

# Where aiohttp's code must still do what the guard relies on: (function, text in it, why).
CALL_SITES: dict[str, tuple[Callable[..., Any], str, str]] = {
    "RequestHandler.start calls _handle_request": (
        RequestHandler.start,
        "self._handle_request(",
        "the guard marks a connection idle again when _handle_request returns",
    ),
    "BaseRunner.setup calls _make_server": (
        BaseRunner.setup,
        "self._make_server()",
        "GuardedRunner swaps in its server there",
    ),
    "RequestHandler.data_received queues heads on _messages": (
        RequestHandler.data_received,
        "self._messages.append(",
        "the guard takes a non-empty _messages for a whole request head",
    ),
    "RequestHandler.connection_lost clears _manager": (
        RequestHandler.connection_lost,
        "self._manager = None",
        "the guard counts a connection's loss once, while _manager is set",
    ),
    "RequestHandler.force_close sets _force_close": (
        RequestHandler.force_close,
        "self._force_close = True",
        "the guard leaves a connection that is closing out of the idle ones",
    ),
}


def params(fn: Callable[..., Any]) -> list[str]:
    """The parameter names of a method, without self."""
    return list(inspect.signature(fn).parameters)[1:]


@pytest.mark.parametrize("name", sorted(HANDLER_METHODS))
def test_request_handler_method(name: str) -> None:
    want, is_async = HANDLER_METHODS[name]
    hook = f"{AIOHTTP}: RequestHandler.{name}"
    theirs = getattr(RequestHandler, name, None)
    assert theirs is not None, f"{hook} is gone"
    assert params(theirs) == want, f"{hook} takes {params(theirs)}, the guard assumes {want}"
    assert inspect.iscoroutinefunction(theirs) is is_async, f"{hook}: async is not {is_async}"
    ours = getattr(GuardedHandler, name)
    if ours is not theirs:  # an override: it must take what aiohttp passes
        assert params(ours) == want, f"GuardedHandler.{name} takes {params(ours)}, not {want}"


def test_constructors_take_what_the_guard_passes() -> None:
    handler = inspect.signature(RequestHandler.__init__).parameters
    assert list(handler)[1] == "manager", f"{AIOHTTP}: RequestHandler(manager, ...) changed"
    assert handler["loop"].kind is inspect.Parameter.KEYWORD_ONLY, (
        f"{AIOHTTP}: RequestHandler(..., loop=) changed"
    )
    server = inspect.signature(Server.__init__).parameters
    assert list(server)[1] == "handler", f"{AIOHTTP}: Server(handler, ...) changed"
    for name in ("request_factory", "handler_cancellation", "loop"):
        assert name in server, f"{AIOHTTP}: Server(..., {name}=) is gone"
    assert any(p.kind is inspect.Parameter.VAR_KEYWORD for p in server.values()), (
        f"{AIOHTTP}: Server(**kwargs) is gone: the handler's settings travel there"
    )
    make = getattr(web.AppRunner, "_make_server", None)
    assert make is not None, f"{AIOHTTP}: AppRunner._make_server is gone"
    assert inspect.iscoroutinefunction(make) and params(make) == [], (
        f"{AIOHTTP}: AppRunner._make_server is no longer `async def _make_server(self)`"
    )


@pytest.mark.parametrize("site", sorted(CALL_SITES))
def test_aiohttp_still_calls_the_hook(site: str) -> None:
    fn, text, why = CALL_SITES[site]
    assert text in inspect.getsource(fn), f"{AIOHTTP}: no longer true: {site} ({why})"


@contextlib.asynccontextmanager
async def guarded_runner() -> AsyncIterator[GuardedRunner]:
    """A real GuardedRunner, set up (its server built) in the test's loop, on no socket."""
    r = GuardedRunner(web.Application(), ConnectionGuard(Limits()), keepalive_timeout=KEEPALIVE_S)
    await r.setup()
    try:
        yield r
    finally:
        await r.cleanup()


async def test_the_runner_builds_the_guarded_server() -> None:
    async with guarded_runner() as runner:
        server = runner.server
    assert isinstance(server, GuardedServer), (
        f"{AIOHTTP}: AppRunner._make_server was not called: the server is {type(server)}"
    )
    assert server._loop is asyncio.get_running_loop(), f"{AIOHTTP}: Server._loop changed"
    assert isinstance(server._kwargs, dict), f"{AIOHTTP}: Server._kwargs is gone"
    assert server._kwargs.get("keepalive_timeout") == KEEPALIVE_S, (
        f"{AIOHTTP}: Server._kwargs no longer holds the runner's handler settings"
    )
    for name in ("request_handler", "request_factory", "handler_cancellation"):
        assert hasattr(server, name), f"{AIOHTTP}: Server.{name} is gone"


async def test_a_connection_handler_has_the_attributes_the_guard_reads() -> None:
    async with guarded_runner() as runner:
        server = runner.server
        assert server is not None
        handler = server()  # what the event loop calls for each new connection
    assert isinstance(handler, GuardedHandler), f"{AIOHTTP}: Server.__call__ changed"
    expect = {
        "_messages": lambda v: isinstance(v, deque) and not v,
        "_force_close": lambda v: v is False,
        "_manager": lambda v: v is server,
        "_loop": lambda v: v is asyncio.get_running_loop(),
    }
    for name, ok in expect.items():
        hook = f"{AIOHTTP}: RequestHandler.{name}"
        assert hasattr(handler, name), f"{hook} is gone"
        assert ok(getattr(handler, name)), f"{hook} is {getattr(handler, name)!r}"
