"""What an outside checker can drive with only the public names of docs/DESIGN.md.

Each test uses ``redisbal.Reporter`` / ``redisbal.AsyncRouter`` /
``redisbal.Router`` exactly as the README shows them, with default settings
unless the public API offers a knob, against a real redis-server.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest
import redis
from support.helpers import await_until, io_of_this_thread, wait_until

import redisbal
from redisbal import Counts
from redisbal.barrier.record import parse_record
from redisbal.barrier.snapshot import Roster
from redisbal.errors import RedisbalError
from redisbal.keys import DeploymentKeys
from redisbal.routing.policies import make_policy
from redisbal.sim.embedded import RedisServer


async def test_checker_flow(redis_url: str, deployment: str) -> None:
    """No snapshot until every engine reported; consistent cut; stale rejection;
    routing avoids the loaded engine; pinning; unknown pins are clear errors."""
    reps = [redisbal.Reporter(redis_url, deployment=deployment, engines=str(i)) for i in range(4)]
    router = redisbal.AsyncRouter(redis_url, deployment=deployment, client_index=0, client_count=2)
    await router.start()
    try:
        for i, rep in enumerate(reps[:3]):
            assert rep.report(Counts(step=1, waiting=0, running=10 + i, wave=0), wait=True).accepted
        await asyncio.sleep(0.2)
        assert router.snapshot is None, "a snapshot before every engine reported"
        # engine 0 is already at step 2 when the last engine reports step 1
        assert reps[0].report(Counts(step=2, waiting=50, running=64, wave=0), wait=True).accepted
        assert reps[3].report(Counts(step=1, waiting=0, running=0, wave=0), wait=True).accepted
        await await_until(lambda: router.snapshot is not None)
        snap = router.snapshot
        assert snap is not None and (snap.wave, snap.step) == (0, 1)
        assert snap.engines["0"].running == 10, "the cut holds engine 0's step-1 counts"
        assert {e: c.step for e, c in snap.engines.items()} == {str(i): 1 for i in range(4)}
        # a report older than the engine's latest is rejected and changes nothing
        stale = reps[0].report(Counts(step=1, waiting=99, running=99, wave=0), wait=True)
        assert stale.status == "stale" and not stale.accepted
        # next step: engine 2 is loaded; the router avoids it
        for i, rep in enumerate(reps):
            rep.report(
                Counts(step=3, waiting=40 if i == 2 else 0, running=64 if i == 2 else 1, wave=0),
                wait=True,
            )
        await await_until(lambda: router.snapshot is not None and router.snapshot.step == 3)
        chosen = [router.route() for _ in range(30)]
        assert "2" not in {d.engine_id for d in chosen}
        for d in chosen:
            router.finished(d)
        pinned = router.route(engine_id="2")
        assert pinned.engine_id == "2"
        router.finished(pinned)
        with pytest.raises(redisbal.UnknownEngine, match="'9'"):
            router.route(engine_id="9")
    finally:
        await router.aclose()
        for rep in reps:
            rep.close()


def test_dead_engine_expires_and_barrier_resumes(
    fresh_server: RedisServer, deployment: str
) -> None:
    """A crashed engine (no leave, no heartbeat) expires after dead_after (5 s by
    default, no coordinator running), the barrier resumes, routing avoids it."""
    url = fresh_server.url
    live = [redisbal.Reporter(url, deployment=deployment, engines=e) for e in ("a", "b")]
    crashed = redisbal.Reporter(url, deployment=deployment, engines="c", heartbeat=False)
    router = redisbal.Router(url, deployment=deployment, client_index=0, client_count=1)
    router.start()
    try:
        for rep in (*live, crashed):
            rep.report(Counts(step=1, waiting=0, running=1), wait=True)
        wait_until(lambda: router.snapshot is not None and "c" in router.snapshot.engines)
        steps = iter(range(2, 10**6))

        def live_step_on() -> bool:  # "c" crashed: it reports no more; the others step on
            step = next(steps)
            for rep in live:
                rep.report(Counts(step=step, waiting=0, running=1), wait=True)
            return router.snapshot is not None and "c" not in router.snapshot.engines

        wait_until(live_step_on, 20, "the dead engine to expire", interval=0.05)
        snap = router.snapshot
        assert snap.gone.get("c") == "expired" or "c" not in snap.engines
        assert snap.step > 1, "the barrier did not resume past the dead engine"
        assert all(router.route().engine_id != "c" for _ in range(20))
    finally:
        router.close()
        for rep in live:
            rep.close()
        crashed.close(leave=False)


async def test_routing_goes_on_with_redis_stopped(
    fresh_server: RedisServer, deployment: str
) -> None:
    url = fresh_server.url
    reps = [
        redisbal.Reporter(url, deployment=deployment, engines=str(i), heartbeat=False)
        for i in range(3)
    ]
    router = redisbal.AsyncRouter(url, deployment=deployment, client_index=0, client_count=1)
    await router.start()
    try:
        for rep in reps:
            rep.report(Counts(step=1, waiting=0, running=1), wait=True)
        await await_until(lambda: router.snapshot is not None)
        assert not router.route().degraded
        fresh_server.kill()
        await await_until(lambda: router.degraded, timeout=10)
        with io_of_this_thread() as io:
            decisions = [router.route() for _ in range(300)]
        assert not io, f"route() touched the network with Redis down: {io}"
        assert all(d.degraded for d in decisions)
        assert {d.engine_id for d in decisions} == {"0", "1", "2"}
        for d in decisions:
            router.finished(d)
    finally:
        await router.aclose()
        for rep in reps:
            rep.close(leave=False)


def test_the_stored_snapshot_is_the_published_one(redis_url: str, deployment: str) -> None:
    """Sanity for checkers that read Redis: the stored snapshot parses as a Snapshot."""
    reps = [
        redisbal.Reporter(redis_url, deployment=deployment, engines=str(i), heartbeat=False)
        for i in range(2)
    ]
    try:
        for rep in reps:
            rep.report(Counts(step=5, waiting=1, running=2, kv_usage=0.25), wait=True)
        raw = redis.Redis.from_url(redis_url).get(DeploymentKeys(deployment).snapshot)
        snap = redisbal.Snapshot.from_json(raw)  # type: ignore[arg-type]
        assert snap.step == 5 and snap.engines["1"].kv_usage == 0.25
    finally:
        for rep in reps:
            rep.close()


# -- the public surface, without Redis ---------------------------------------------------------

# Exceptions that never reach a caller: the gateway's control flow between its own functions.
INTERNAL_SIGNALS = {"redisbal.gateway.retry.Retry", "redisbal.gateway.first_byte.Silent"}


def _modules() -> list[str]:
    return [
        m.name
        for m in pkgutil.walk_packages(redisbal.__path__, "redisbal.")
        if m.name != "redisbal.__main__"  # runs the CLI when imported
    ]


def test_every_exception_redisbal_defines_is_a_redisbal_error() -> None:
    """One root for callers (``except redisbal.RedisbalError``), each class defined once,
    in redisbal.errors (the CLI's ConfigError, a click exception, in cli_common)."""
    found: dict[str, type[BaseException]] = {}
    for name in _modules():
        for attr, obj in vars(importlib.import_module(name)).items():
            if (
                inspect.isclass(obj)
                and issubclass(obj, BaseException)
                and obj.__module__.startswith("redisbal")
                and not attr.startswith("_")
            ):
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    assert len(found) >= 20, sorted(found)  # the walk found them: not vacuous
    outside = sorted(q for q, c in found.items() if not issubclass(c, RedisbalError))
    assert outside == sorted(INTERNAL_SIGNALS), outside
    homes = {q.rsplit(".", 1)[0] for q in found if q not in INTERNAL_SIGNALS}
    assert homes == {"redisbal.errors", "redisbal.ops.cli_options"}, homes


def test_exceptions_keep_their_builtin_bases_and_old_homes() -> None:
    """``except ValueError`` and the old import paths keep working."""
    from redisbal.connection import BadRedisURL, PasswordError, WrongServer
    from redisbal.keys import InvalidName
    from redisbal.reporting.reporter import InvalidReport
    from redisbal.routing.policies import NoEngines, UnknownEngine

    for exc in (BadRedisURL, WrongServer, InvalidReport, InvalidName, UnknownEngine):
        assert issubclass(exc, ValueError) and issubclass(exc, RedisbalError), exc
    assert issubclass(NoEngines, RuntimeError) and issubclass(NoEngines, RedisbalError)
    assert issubclass(WrongServer, redis.exceptions.ResponseError)
    assert issubclass(PasswordError, redis.exceptions.AuthenticationError)
    assert redisbal.RedisbalError is RedisbalError and redisbal.InvalidReport is InvalidReport


def test_public_names_are_the_api_not_its_wiring() -> None:
    """``redisbal.__all__`` lists what users call; the sender and the key builder are
    internal (reachable in their modules, not exported)."""
    assert set(redisbal.__all__) <= set(vars(redisbal)), "a name in __all__ is missing"
    for internal in ("ReportSender", "DeploymentKeys", "Scripts", "RouterCore"):
        assert internal not in redisbal.__all__, internal
    for name in redisbal.__all__:
        obj = getattr(redisbal, name)
        if inspect.isclass(obj) and issubclass(obj, BaseException):
            assert issubclass(obj, RedisbalError), name


def _bare_raises(root: Path | None = None) -> list[str]:
    """Every ``raise`` in the package (or the tree at ``root``) of a built-in ValueError
    or RuntimeError (or a built-in subclass of one) other than NotImplementedError, as
    "path:line in function"."""
    import ast
    import builtins

    def bare(node: ast.AST) -> bool:
        exc = node.exc if isinstance(node, ast.Raise) else None
        target = exc.func if isinstance(exc, ast.Call) else exc
        cls = getattr(builtins, target.id, None) if isinstance(target, ast.Name) else None
        return (
            isinstance(cls, type)
            and issubclass(cls, ValueError | RuntimeError)
            and cls is not NotImplementedError
        )

    def scan(node: ast.AST, rel: str, function: str, found: list[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                scan(child, rel, child.name, found)
                continue
            if bare(child):
                found.append(f"{rel}:{child.lineno} in {function}")
            scan(child, rel, function, found)

    root = root or Path(redisbal.__file__).parent
    found: list[str] = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).as_posix()
        scan(ast.parse(path.read_text(encoding="utf-8")), rel, "<module>", found)
    return found


def test_no_bare_value_or_runtime_error_is_raised() -> None:
    """DESIGN: every ValueError and RuntimeError redisbal raises is a
    RedisbalError (InvalidArgument, InvalidState, ... in redisbal.errors), so that
    ``except redisbal.RedisbalError`` catches it; a bare one is named here."""
    assert _bare_raises() == []


def test_the_raise_scan_finds_a_bare_raise(tmp_path: Path) -> None:
    """The scan is not vacuous: bare raises in a module, a method and a nested function
    are each named, a RedisbalError subclass and NotImplementedError are not."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "m.py").write_text(
        "from redisbal.errors import InvalidArgument\n"
        "raise ValueError('module')\n"
        "class C:\n"
        "    def f(self):\n"
        "        raise RuntimeError\n"
        "    def g(self):\n"
        "        def inner():\n"
        "            raise UnicodeError('a ValueError too')\n"
        "        raise InvalidArgument('fine')\n"
        "    def h(self):\n"
        "        raise NotImplementedError\n"
    )
    assert _bare_raises(pkg) == ["pkg/m.py:2 in <module>", "pkg/m.py:5 in f", "pkg/m.py:8 in inner"]


@pytest.mark.parametrize(
    "call",
    [
        lambda: redisbal.Reporter("redis://127.0.0.1:1", "d", engines="e", heartbeat_s=-1.0),
        lambda: redisbal.Router("redis://127.0.0.1:1", "d", client_index=3, client_count=2),
        lambda: Roster.from_json(["e", "e"], ["1", "1"]),
        lambda: make_policy("nope"),
        lambda: parse_record("nonsense"),
    ],
    ids=["reporter-argument", "router-argument", "roster", "policy-name", "record"],
)
def test_bad_input_raises_a_redisbal_error_that_is_a_value_error(call: object) -> None:
    with pytest.raises(RedisbalError) as err:
        call()  # type: ignore[operator]
    assert isinstance(err.value, ValueError), type(err.value)
    assert "\n" not in str(err.value)
