"""Bad input, fuzzed: every public entry point and every Lua script called directly.

What each case must get (docs/DESIGN.md, bad input): a clear error that
names the field, and nothing stored: for the scripts the deployment's keys are
DUMPed before and after each call and compared byte for byte, and the whole db
is SCANned for keys that appeared. Valid input generated on the way must work.

The scripts are called with raw EVALSHA through redis-py, the way a client that
bypasses the Python checks (another language, a bug, an attacker with access to
Redis) would call them: wrong KEYS (count, order, another deployment's keys),
wrong ARGV count, and one field at a time replaced by a value that field must
refuse (non-numeric, negative, huge, unicode, braces, empty, very long).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import click
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.helpers import Blocking, contents, keys_of

from redisbal import (
    POLICIES,
    AsyncReporter,
    AsyncRouter,
    Counts,
    InvalidName,
    InvalidReport,
    Reporter,
    Router,
    UnknownEngine,
)
from redisbal.barrier.operations import SCRIPT_NAMES, script_source
from redisbal.barrier.snapshot import Snapshot
from redisbal.keys import NAME_RE, DeploymentKeys
from redisbal.ops.coordinator import CoordinatorConfig
from redisbal.routing.router_core import RouterCore

FUZZ = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

FENCE = "7"  # the fence stored in the fuzzed deployment's config
MAX_COUNT = 10**9
MAX_STEP = 2**32 - 1
MAX_WAVE = 2**20 - 1

# -- strategies of values a field must refuse --------------------------------------------------

any_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=80)
weird_text = st.one_of(
    any_text,
    st.sampled_from(
        [
            "",
            " ",
            "{x}",
            "a}b",
            "{",
            "é",
            "١٢",
            "1e3",
            "0x10",
            "1.5",
            "nan",
            "inf",
            "-",
            "\x00",
            "1 ",
            " 1",
            "+1",
            "1_000",
            "٣",
            "a" * 65,
            "9" * 17,
            "-" * 3,
            "e0\n",
            "null",
        ]
    ),
    st.text(max_size=2000, alphabet="{}:,.-_ 0123456789abc\t\n"),
)


def is_int_in(s: str, lo: int, hi: int) -> bool:
    """What int_arg in lua/includes/args.lua accepts."""
    return bool(re.fullmatch(r"-?[0-9]+", s)) and len(s) <= 16 and lo <= int(s) <= hi


def bad_int(lo: int, hi: int) -> st.SearchStrategy[str]:
    return st.one_of(
        st.integers().filter(lambda n: not lo <= n <= hi).map(str),
        st.integers(min_value=10**16, max_value=10**40).map(str),
        st.floats(allow_nan=True, allow_infinity=True).map(repr),
        weird_text,
    ).filter(lambda s: not is_int_in(s, lo, hi))


def is_name(s: str) -> bool:
    return bool(NAME_RE.fullmatch(s)) and s.isascii()


bad_name = st.one_of(weird_text, st.text(min_size=65, max_size=200, alphabet="abc")).filter(
    lambda s: not is_name(s)
)


def is_kv(s: str) -> bool:
    if s == "":
        return True
    return bool(len(s) <= 24 and re.fullmatch(r"[0-9]*\.?[0-9]+", s)) and 0 <= float(s) <= 1


bad_kv = st.one_of(
    st.floats().map(repr), st.floats(min_value=1.0001, max_value=1e9).map(str), weird_text
).filter(lambda s: not is_kv(s))


def is_admitted(s: str) -> bool:
    if s == "":
        return True
    parts = s.split(",")
    return len(s) <= 65536 and all(
        re.fullmatch(r"[0-9]+", p) and (p == "0" or not p.startswith("0")) for p in parts
    )


bad_admitted = st.one_of(
    weird_text,
    st.lists(st.integers(0, 10**20).map(str), min_size=1, max_size=5).map(",".join),
    st.sampled_from(["1,,2", ",1", "1,", "01", "1,007", "-1", "1;2", "[1]"]),
).filter(lambda s: not is_admitted(s))

bad_total = st.one_of(
    weird_text,
    st.integers(-(10**20), 10**20).map(str),
    st.sampled_from(["01", "-0", "1" * 16, " 1", "1e3", "+1"]),
).filter(lambda s: s != "" and not re.fullmatch(r"0|[1-9][0-9]{0,14}", s))

bad_pubcmd = weird_text.filter(lambda s: s not in ("PUBLISH", "SPUBLISH"))


# -- the deployment under fuzz -----------------------------------------------------------------


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class Target:
    """A deployment with real state (config, members, reports, a published snapshot)
    and a raw-EVALSHA caller for each script."""

    def __init__(self, r: redis.Redis, deployment: str) -> None:
        self.r = r
        self.keys = DeploymentKeys(deployment)
        self.other = DeploymentKeys(deployment + ".other")
        self.scripts = {n: r.register_script(script_source(n)) for n in SCRIPT_NAMES}
        k = self.keys.script_keys()
        cfg = ["dead_after_ms", "600000", "stall_ms", "600000", "join_grace_ms", "0"]
        for keys in (self.keys, self.other):
            dk = keys.script_keys()
            self.call("configure", dk, [keys.deployment, "PUBLISH", "ep1", *cfg])
            for step in (1, 2):
                for e in ("e0", "e1"):
                    self.call(
                        "report",
                        dk,
                        [
                            keys.deployment,
                            "PUBLISH",
                            "ep1",
                            e,
                            "0",
                            str(step),
                            "3",
                            "4",
                            "0.5",
                            "1,2",
                        ],
                    )
        r.hset(self.keys.config, "fence", FENCE)
        assert r.get(self.keys.snapshot), "set-up should have published a snapshot"
        self.valid_keys = k

    def call(self, name: str, keys: list[str], argv: list[Any]) -> Any:
        return self.scripts[name](keys=keys, args=argv)

    def state(self, called: Sequence[str] = ()) -> tuple[dict[str, object], set[bytes]]:
        """The contents of both deployments' keys, and which keys exist among those that
        hold either deployment's name or were passed to the call. Nothing else: the
        database is shared, and other tests' keys come and go meanwhile."""
        dumps = contents(self.r, [*self.keys.all_keys(), *self.other.all_keys()])
        tags = [self.keys.deployment, self.other.deployment]
        return dumps, keys_of(self.r, tags, [k for k in called if isinstance(k, str)])

    def expect_refused(self, name: str, keys: list[str], argv: list[Any], why: str = "") -> str:
        """The call must fail with a redisbal error and leave every key as it was."""
        before = self.state(keys)
        try:
            out = self.call(name, keys, argv)
        except redis.ResponseError as exc:
            msg = str(exc)
        else:
            after = self.state(keys)
            raise AssertionError(
                f"{name} accepted malformed input ({why}): keys={keys!r} argv={argv!r} -> {out!r}; "
                f"state changed: {after != before}"
            )
        after = self.state(keys)
        assert msg.startswith("redisbal: "), f"{name}: raw error for {why}: {msg}"
        assert after[1] == before[1], f"{name}: keys appeared/vanished: {after[1] ^ before[1]}"
        changed = [k for k in before[0] if before[0][k] != after[0][k]]
        assert not changed, f"{name} wrote {changed} before failing ({why}: {msg})"
        return msg


@pytest.fixture
def target(r: redis.Redis, deployment: str) -> Iterator[Target]:
    t = Target(r, deployment)
    yield t
    for keys in (t.keys, t.other):
        r.delete(*keys.all_keys())


def valid_argv(t: Target, name: str) -> list[str]:
    """A well-formed ARGV for each script (never executed as is: one field gets broken)."""
    d = t.keys.deployment
    return {
        "report": [d, "PUBLISH", "ep1", "e0", "0", "3", "1", "2", "0.25", "5,6", INC, "1", "17"],
        # three reports with admitted totals ("": none); the fuzz breaks a field of the
        # second (e1): nothing is stored
        "report_many": [
            *(d, "PUBLISH", "ep1", "3"),
            *("e0", "0", "3", "1", "2", "0.25", "5,6", INC, "1", ""),
            *("e1", "0", "3", "7", "8", "", "", "-", "0", "9"),
            *("e5", "0", "tick", "0", "0", "1", "", INC, "1", "0"),
        ],
        "leave": [d, "PUBLISH", "e0", INC],
        "register": [d, "PUBLISH", "ep1", "e7"],
        "reap": [d, "PUBLISH", "10", FENCE],
        "force": [d, "PUBLISH", "", FENCE],
        "configure": [d, "PUBLISH", "ep1", "stall_ms", "100"],
        "new_epoch": [d, "PUBLISH", "ep2"],
        "lease": [d, "PUBLISH", "c1", "1000", "acquire"],
        "suspect": [d, "PUBLISH", "e0", "3", "connect refused"],
        "recovered": [d, "PUBLISH", "e0", "3"],
    }[name]


INC = "lq0k1x2a-0f3c"  # a valid incarnation (lua/includes/incarnation.lua)
bad_incarnation = weird_text.filter(
    lambda s: s != "-" and (len(s) > 40 or not re.fullmatch(r"[A-Za-z0-9]{1,12}-[0-9A-Fa-f]+", s))
)

# field index -> strategy of values that field must refuse (while the rest stays valid)
BAD_FIELDS: dict[str, dict[int, st.SearchStrategy[str]]] = {
    "report": {
        0: bad_name,
        1: bad_pubcmd,
        3: bad_name,
        4: bad_int(0, MAX_WAVE),
        5: bad_int(0, MAX_STEP).filter(lambda s: s != "tick"),
        6: bad_int(0, MAX_COUNT),
        7: bad_int(0, MAX_COUNT),
        8: bad_kv,
        9: bad_admitted,
        10: bad_incarnation,
        11: weird_text.filter(lambda s: s not in ("0", "1")),
        12: bad_total,
    },
    "report_many": {
        0: bad_name,
        1: bad_pubcmd,
        3: bad_int(3, 3),
        14: st.one_of(bad_name, st.sampled_from(["e0", "e5"])),  # e0, e5: given twice
        15: bad_int(0, MAX_WAVE),
        16: bad_int(0, MAX_STEP).filter(lambda s: s != "tick"),
        17: bad_int(0, MAX_COUNT),
        18: bad_int(0, MAX_COUNT),
        19: bad_kv,
        20: bad_admitted,
        21: bad_incarnation,
        22: weird_text.filter(lambda s: s not in ("0", "1")),
        23: bad_total,
    },
    "leave": {0: bad_name, 1: bad_pubcmd, 2: bad_name, 3: bad_incarnation},
    "register": {0: bad_name, 1: bad_pubcmd, 3: bad_name},
    "reap": {
        0: bad_name,
        1: bad_pubcmd,
        2: bad_int(1, 100000),
        3: weird_text.filter(lambda s: s not in ("", FENCE)),
    },
    "force": {
        0: bad_name,
        1: bad_pubcmd,
        2: bad_int(0, 86400000).filter(bool),
        3: weird_text.filter(lambda s: s not in ("", FENCE)),
    },
    "configure": {
        0: bad_name,
        1: bad_pubcmd,
        3: weird_text.filter(
            lambda s: (
                s
                not in (
                    "dead_after_ms",
                    "stall_ms",
                    "tick_ms",
                    "join_grace_ms",
                    "idle_publish_ms",
                    "stall_after_ms",
                    "suspect_ms",
                    "compact_from",
                    "expected",
                    "owner",
                )
            )
        ),
        4: bad_int(1, 86400000),
    },
    "new_epoch": {0: bad_name, 1: bad_pubcmd, 2: bad_name},
    "lease": {
        0: bad_name,
        1: bad_pubcmd,
        2: bad_name,
        3: bad_int(100, 600000),
        4: weird_text.filter(lambda s: s not in ("acquire", "release")),
    },
    "suspect": {
        0: bad_name,
        1: bad_pubcmd,
        2: bad_name,
        3: bad_int(0, 4095).filter(lambda s: s != "-"),  # ("-": not a router, valid)
        4: st.one_of(
            st.text(min_size=201, max_size=300), st.sampled_from(["a\nb", "\x00", "\x7f"])
        ),
    },
    "recovered": {
        0: bad_name,
        1: bad_pubcmd,
        2: bad_name,
        3: bad_int(0, 4095).filter(lambda s: s != "-"),
    },
}


@pytest.mark.servers
@pytest.mark.parametrize("name", SCRIPT_NAMES)
@FUZZ
@given(data=st.data())
def test_scripts_refuse_a_bad_field_and_store_nothing(
    target: Target, name: str, data: st.DataObject
) -> None:
    argv = valid_argv(target, name)
    index = data.draw(st.sampled_from(sorted(BAD_FIELDS[name])), label="field")
    argv[index] = data.draw(BAD_FIELDS[name][index], label="value")
    target.expect_refused(name, target.valid_keys, argv, f"ARGV[{index + 1}]={argv[index]!r}")


def _bad_keys(t: Target) -> st.SearchStrategy[list[str]]:
    good = t.valid_keys
    return st.one_of(
        st.integers(0, len(good) - 1).map(lambda n: good[:n]),  # too few
        st.lists(any_text, min_size=1, max_size=3).map(lambda extra: good + extra),  # too many
        st.permutations(good).filter(lambda p: p != good),  # wrong order
        st.just(t.other.script_keys()),  # another deployment's keys
        st.tuples(st.integers(0, len(good) - 1), weird_text)
        .map(lambda iv: [iv[1] if i == iv[0] else k for i, k in enumerate(good)])
        .filter(lambda ks: ks != good),
    )


@pytest.mark.servers
@pytest.mark.parametrize("name", SCRIPT_NAMES)
@FUZZ
@given(data=st.data())
def test_scripts_refuse_wrong_keys(target: Target, name: str, data: st.DataObject) -> None:
    keys = data.draw(_bad_keys(target), label="keys")
    target.expect_refused(name, keys, valid_argv(target, name), f"KEYS={keys!r}")


MIN_ARGS = {
    "report": 10,
    "report_many": 31,  # (a shorter ARGV does not match its count: 31 or 34 for 3)
    "leave": 3,
    "register": 3,
    "reap": 3,
    "force": 3,
    "configure": 3,
    "new_epoch": 3,
    "lease": 5,
    "suspect": 5,
    "recovered": 4,
}
MAX_ARGS = {
    "report": 13,
    "report_many": 34,
    "leave": 4,
    "reap": 4,
    "force": 4,
    "new_epoch": 3,
    "lease": 5,
    "suspect": 5,
    "recovered": 4,
}


@pytest.mark.servers
@pytest.mark.parametrize("name", SCRIPT_NAMES)
@FUZZ
@given(data=st.data())
def test_scripts_refuse_a_wrong_number_of_arguments(
    target: Target, name: str, data: st.DataObject
) -> None:
    argv = valid_argv(target, name)
    choices = [st.integers(0, MIN_ARGS[name] - 1).map(lambda n: argv[:n])]
    if name in MAX_ARGS:
        choices.append(st.lists(any_text, min_size=1, max_size=4).map(lambda x: argv + x))
    if name == "configure":  # field/value pairs: an odd count is malformed
        choices.append(any_text.map(lambda x: [*argv, x]))
    bad = data.draw(st.one_of(choices), label="argv")
    target.expect_refused(name, target.valid_keys, bad, f"{len(bad)} arguments")


@pytest.mark.servers
def test_bad_epoch_candidate_on_an_empty_deployment_stores_nothing(
    r: redis.Redis, deployment: str
) -> None:
    """The epoch candidate is only used when state is missing: then it must be a name."""
    t = Target.__new__(Target)
    t.r, t.keys, t.other = r, DeploymentKeys(deployment), DeploymentKeys(deployment + ".x")
    t.scripts = {n: r.register_script(script_source(n)) for n in SCRIPT_NAMES}
    t.valid_keys = t.keys.script_keys()
    d = deployment
    for bad in ("", "{x}", "a b", "é", "x" * 65):
        t.expect_refused(
            "report", t.valid_keys, [d, "PUBLISH", bad, "e0", "0", "1", "1", "1", "", ""]
        )
        t.expect_refused("register", t.valid_keys, [d, "PUBLISH", bad, "e0"])
        t.expect_refused("configure", t.valid_keys, [d, "PUBLISH", bad])
    assert not list(r.scan_iter(match=f"redisbal:{{{deployment}}}*"))


@pytest.mark.servers
def test_direct_callers_cannot_make_a_snapshot_that_routers_cannot_parse(target: Target) -> None:
    """Spellings the script accepts must still give valid JSON (".5" and "0.50" for kv_usage
    are stored as 0.5000; leading zeros in admitted are refused: they are not JSON)."""
    d, k = target.keys.deployment, target.valid_keys
    for i, kv in enumerate((".5", "00.5", "1", "0", "0.123456789", "0.25")):
        step = str(10 + i)  # both engines report each step: the barrier publishes it
        target.call("report", k, [d, "PUBLISH", "ep1", "e0", "0", step, "1", "1", kv, "3"])
        target.call("report", k, [d, "PUBLISH", "ep1", "e1", "0", step, "1", "1", kv, "0,1"])
        snap = Snapshot.from_json(target.r.get(target.keys.snapshot))  # type: ignore[arg-type]
        assert snap.step == int(step)
        assert snap.engines["e0"].kv_usage == pytest.approx(round(float(kv), 4))
    for adm in ("01", "1,00", "0,012"):
        target.expect_refused(
            "report", k, [d, "PUBLISH", "ep1", "e0", "0", "99", "1", "1", "", adm]
        )
    # the script does not count an admitted entry's digits (docs/DESIGN.md): a count
    # past what the reporters send is still a JSON integer, for every spelling the
    # script takes (fast and slow path), and routers read such a list as not reported
    for waiting in ("1", "01"):
        for adm in ("1,12345678901234567890", "1000000000000000", "0,999999999999999"):
            step = str(int(step) + 1)
            target.call("report", k, [d, "PUBLISH", "ep1", "e0", "0", step, waiting, "1", "", adm])
            target.call("report", k, [d, "PUBLISH", "ep1", "e1", "0", step, "1", "1", "", "0,1"])
            snap = Snapshot.from_json(target.r.get(target.keys.snapshot))  # type: ignore[arg-type]
            assert snap.step == int(step) and snap.engines["e0"].waiting == 1
            assert snap.engines["e0"].admitted == tuple(int(a) for a in adm.split(","))
            core = RouterCore(0, 2)
            core.apply_snapshot(snap)
            assert core.by_id["e1"].exact
            assert core.by_id["e0"].exact == adm.startswith("0,"), adm


# -- the Python entry points ------------------------------------------------------------------

count_values = st.one_of(
    st.integers(-(10**12), 10**12),
    st.sampled_from([0, MAX_COUNT, MAX_COUNT + 1, -1, 2**63, True, False]),
    st.floats(allow_nan=True),
    st.text(max_size=5),
    st.none(),
    st.lists(st.integers(), max_size=2),
)
kv_values = st.one_of(
    st.none(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(-2, 2),
    st.sampled_from([True, "0.5", b"0.5", float("nan"), 1e-300]),
)
admitted_values = st.one_of(
    st.none(),
    st.lists(st.integers(-5, 10**16), max_size=6),
    st.lists(count_values, max_size=3),
    st.sampled_from(["1,2", b"12", (1, 2), {1: 2}, 5, [True], [1.0]]),
    st.lists(st.just(1), min_size=4097, max_size=4097),
)


def ok_count(v: object, hi: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= hi


def report_is_valid(
    step: object, waiting: object, running: object, wave: object, kv: object, admitted: object
) -> bool:
    """The contract of Reporter.report, written independently of reporting/reporter.py."""
    if not (ok_count(step, MAX_STEP) and ok_count(wave, MAX_WAVE)):
        return False
    if not (ok_count(waiting, MAX_COUNT) and ok_count(running, MAX_COUNT)):
        return False
    if kv is not None and not (
        isinstance(kv, int | float)
        and not isinstance(kv, bool)
        and math.isfinite(kv)
        and 0 <= kv <= 1
    ):
        return False
    if admitted is None:
        return True
    if not isinstance(admitted, list | tuple) or len(admitted) > 4096:
        return False
    return all(ok_count(a, 10**15 - 1) for a in admitted)


report_args = st.fixed_dictionaries(
    {
        "step": st.one_of(st.integers(0, 1000), count_values),
        "waiting": count_values,
        "running": count_values,
        "wave": st.one_of(st.just(0), count_values),
        "kv_usage": kv_values,
        "admitted": admitted_values,
    }
)


def _check_report(
    call: Callable[[dict[str, Any]], Any], target: Target, args: dict[str, Any]
) -> None:
    valid = report_is_valid(
        args["step"],
        args["waiting"],
        args["running"],
        args["wave"],
        args["kv_usage"],
        args["admitted"],
    )
    before = target.state()
    if valid:
        res = call(args)
        assert res.status in ("accepted", "stale"), res
        Snapshot.from_json(target.r.get(target.keys.snapshot))  # type: ignore[arg-type]
        return
    with pytest.raises(InvalidReport) as exc:
        call(args)
    assert any(
        f in str(exc.value) for f in ("step", "waiting", "running", "wave", "kv_usage", "admitted")
    ), f"error does not name the field: {exc.value}"
    assert target.state() == before, "an invalid report stored something"


@FUZZ
@given(args=report_args)
def test_engine_reporter_report(target: Target, redis_url: str, args: dict[str, Any]) -> None:
    rep = Reporter(redis_url, target.keys.deployment, "e0", heartbeat=False, register=False)
    try:
        _check_report(lambda a: rep.report(a, wait=True), target, args)
    finally:
        rep.close(leave=False)


@FUZZ
@given(args=report_args)
def test_async_engine_reporter_report(target: Target, redis_url: str, args: dict[str, Any]) -> None:
    rep = Blocking(AsyncReporter(redis_url, target.keys.deployment, "e0", heartbeat=False))
    try:
        _check_report(lambda a: rep.report(a, wait=True), target, args)
    finally:
        rep.close(leave=False)


names = st.one_of(bad_name, st.sampled_from(["ok", "e-1", "A.b_c", "9"]), st.integers(), st.none())


@FUZZ
@given(
    deployment=names,
    engine_id=names,
    mode=st.one_of(st.sampled_from(["lockstep", "tick"]), any_text),
)
def test_reporter_constructor_checks_names_before_touching_redis(
    target: Target, redis_url: str, deployment: Any, engine_id: Any, mode: Any
) -> None:
    before = target.state()
    ok = (
        isinstance(deployment, str)
        and is_name(deployment)
        and isinstance(engine_id, str)
        and is_name(engine_id)
        and mode in ("lockstep", "tick")
    )
    if ok:  # a valid reporter may register itself: that is its job
        rep = Reporter(
            redis_url, deployment=deployment, engines=engine_id, mode=mode, heartbeat=False
        )
        rep.close(leave=True)
        if deployment not in (target.keys.deployment, target.other.deployment):
            target.r.delete(*DeploymentKeys(deployment).all_keys())
        return
    with pytest.raises((InvalidName, InvalidReport)):
        Reporter(
            redis_url,
            deployment=deployment,
            engines=engine_id,
            mode=mode,
            heartbeat=False,
        )
    assert target.state() == before, "a rejected reporter wrote to Redis"


GOOD_ROUTER_ARGS: dict[str, st.SearchStrategy[Any]] = {
    "deployment": st.sampled_from(["ok", "d-1", "A.b_c"]),
    "client_index": st.just(0),
    "client_count": st.integers(1, 64),
    "policy": st.sampled_from(sorted(POLICIES)),
    "engines": st.one_of(st.none(), st.lists(st.sampled_from(["e0", "e1", "x.2"]), max_size=3)),
    "poll_s": st.floats(0.01, 60),
    "stale_after_s": st.floats(0.01, 600),
}
BAD_SECONDS = [float("nan"), float("inf"), "1", True, None]
BAD_ROUTER_ARGS: dict[str, st.SearchStrategy[Any]] = {
    "deployment": st.one_of(bad_name, st.integers(), st.none()),
    "client_index": st.one_of(
        st.integers(-3, -1), st.integers(64, 100), st.sampled_from([True, 1.0, "0", None])
    ),
    "client_count": st.one_of(st.integers(-3, 0), st.sampled_from([True, 2.0, "2", None])),
    "policy": any_text.filter(lambda s: s not in POLICIES),
    "engines": st.lists(st.one_of(bad_name, st.integers()), min_size=1, max_size=2),
    "poll_s": st.one_of(st.floats(max_value=0), st.sampled_from(BAD_SECONDS)),
    "stale_after_s": st.one_of(st.floats(max_value=0), st.sampled_from(BAD_SECONDS)),
}


@st.composite
def router_args(draw: st.DrawFn) -> dict[str, Any]:
    """Valid arguments with at most one of them broken (so both outcomes are exercised)."""
    args = {k: draw(v) for k, v in GOOD_ROUTER_ARGS.items()}
    broken = draw(st.sampled_from([None, *BAD_ROUTER_ARGS]))
    if broken is not None:
        args[broken] = draw(BAD_ROUTER_ARGS[broken])
    return args


def router_args_valid(a: dict[str, Any]) -> bool:
    d, ci, cc = a["deployment"], a["client_index"], a["client_count"]
    if not (isinstance(d, str) and is_name(d)):
        return False
    if not (ok_count(cc, 10**9) and cc >= 1 and ok_count(ci, 10**9) and ci < cc):
        return False
    if a["policy"] not in POLICIES:
        return False
    if a["engines"] and not all(isinstance(e, str) and is_name(e) for e in a["engines"]):
        return False
    return all(
        isinstance(a[k], int | float)
        and not isinstance(a[k], bool)
        and math.isfinite(a[k])
        and a[k] > 0
        for k in ("poll_s", "stale_after_s")
    )


@FUZZ
@given(args=router_args())
def test_router_constructors(redis_url: str, args: dict[str, Any]) -> None:
    """Bad arguments raise ValueError (InvalidName is one) at construction, before any I/O."""
    for cls in (Router, AsyncRouter):
        if router_args_valid(args):
            router = cls(redis_url, **args)
            if args["engines"]:
                assert router.route().engine_id in args["engines"]
            if isinstance(router, Router):
                router.close()
        else:
            with pytest.raises(ValueError):
                cls(redis_url, **args)


@FUZZ
@given(engine_id=st.one_of(names, any_text, st.sampled_from(["e0", "e1", "e2"])))
def test_router_route_pinned(redis_url: str, engine_id: Any) -> None:
    router = AsyncRouter(redis_url, "fuzz", engines=["e0", "e1", "e2"])
    if engine_id is None or engine_id in ("e0", "e1", "e2"):
        d = router.route(engine_id=engine_id)
        assert engine_id is None or (d.engine_id == engine_id and d.pinned)
        router.finished(d)
    else:
        with pytest.raises(UnknownEngine, match="cannot pin"):
            router.route(engine_id=engine_id)
    assert router.core.counters["routes"] == (engine_id is None or engine_id in ("e0", "e1", "e2"))


CONFIG_FIELDS = {  # name: (lo, hi) whole ms
    "dead_after_ms": (100, 86_400_000),
    "stall_ms": (1, 86_400_000),
    "tick_ms": (1, 60_000),
    "join_grace_ms": (0, 600_000),
    "idle_publish_ms": (10, 3_600_000),
}


@st.composite
def config_args(draw: st.DrawFn) -> dict[str, Any]:
    args: dict[str, Any] = {
        "dead_after_ms": draw(st.integers(1000, 86_400_000)),
        "stall_ms": draw(st.integers(1, 999)),
        "tick_ms": draw(st.integers(1, 60_000)),
        "join_grace_ms": draw(st.integers(0, 600_000)),
        "idle_publish_ms": draw(st.integers(10, 3_600_000)),
        "expected": draw(st.lists(st.sampled_from(["e0", "e1", "a.b", "Z-9"]), unique=True)),
    }
    broken = draw(st.sampled_from([None, "expected", *CONFIG_FIELDS]))
    if broken == "expected":
        args["expected"] = draw(
            st.one_of(
                any_text,
                st.just(["a", "a"]),
                st.lists(st.one_of(bad_name, st.integers()), min_size=1),
                st.none(),
                st.just(("e0",)),
            )
        )
    elif broken is not None:
        lo, hi = CONFIG_FIELDS[broken]
        args[broken] = draw(
            st.one_of(
                st.integers(max_value=lo - 1),
                st.integers(min_value=hi + 1),
                st.sampled_from([True, 1.5, str(lo), None, float("nan")]),
            )
        )
    if draw(st.booleans()) and broken is None:  # stall_ms must stay below dead_after_ms
        args["stall_ms"] = min(args["dead_after_ms"], 86_400_000)
    return args


@FUZZ
@given(args=config_args())
def test_coordinator_config_check(args: dict[str, Any]) -> None:
    cfg = CoordinatorConfig(**args)
    ok = all(ok_count(args[k], hi) and args[k] >= lo for k, (lo, hi) in CONFIG_FIELDS.items())
    ok = ok and args["stall_ms"] < args["dead_after_ms"]
    exp = args["expected"]
    ok = (
        ok and isinstance(exp, list | tuple) and all(isinstance(e, str) and is_name(e) for e in exp)
    )
    ok = ok and len(set(exp)) == len(exp)
    if ok:
        cfg.check()
    else:
        with pytest.raises(ValueError):
            cfg.check()


@pytest.mark.servers
def test_fuzz_helpers_agree_with_the_scripts(target: Target) -> None:
    """The oracles above must match the scripts on their edges, or the fuzzing proves nothing."""
    d, k = target.keys.deployment, target.valid_keys
    for kv in ("0", "1", "0.5", ".5", "1.0000"):
        assert is_kv(kv)
        target.call("report", k, [d, "PUBLISH", "ep1", "e0", "0", "50", "1", "1", kv, ""])
    for adm in ("0", "0,1", "999999999999999"):
        assert is_admitted(adm)
        target.call("report", k, [d, "PUBLISH", "ep1", "e0", "0", "50", "1", "1", "", adm])
    assert not is_kv("1.0001") and not is_admitted("01")


# -- the CLI ----------------------------------------------------------------------------------


def _cli_options() -> list[tuple[str, click.Option]]:
    """(command, option) for every option with a checked type, found by introspection so
    that options added later are fuzzed too. bench parses its own lists: fuzzed separately."""
    from redisbal.ops.cli import cli

    ctx = click.Context(cli)
    out = []
    for name in cli.list_commands(ctx):
        cmd = cli.get_command(ctx, name)
        if name == "bench" or cmd is None:
            continue
        for p in cmd.params:
            if not isinstance(p, click.Option) or p.is_flag or p.name == "redis_url":
                continue
            if isinstance(p.type, click.IntRange | click.FloatRange | click.Choice) or p.name in (
                "deployment",
                "expect",
                "slow",
                "id_prefix",
                "coordinator_id",
            ):
                out.append((name, p))
    return out


CLI_OPTIONS = _cli_options()


def bad_option_value(p: click.Option) -> st.SearchStrategy[str]:
    t = p.type
    junk = st.sampled_from(["", "abc", "1e3x", " ", "{x}", "é", "0x1g"])
    if isinstance(t, click.IntRange):
        lo = -(10**30) if t.min is None else t.min
        hi = 10**30 if t.max is None else t.max
        return st.one_of(
            junk,
            st.sampled_from(["1.5", "1,0"]),
            st.integers(max_value=lo - 1).map(str),
            st.integers(min_value=hi + 1).map(str),
        )
    if isinstance(t, click.FloatRange):
        outside = []
        if t.min is not None:
            outside.append(st.floats(max_value=t.min, exclude_max=not t.min_open).map(repr))
        if t.max is not None:
            outside.append(st.floats(min_value=t.max, exclude_min=not t.max_open).map(repr))
        return st.one_of(junk, st.sampled_from(["nan", "inf", "-inf", "NaN"]), *outside)
    if isinstance(t, click.Choice):
        return st.one_of(junk, any_text).filter(lambda s: s.lower() not in t.choices)
    if p.name in ("deployment", "id_prefix", "coordinator_id"):
        pattern = (
            bad_name if p.name != "id_prefix" else st.sampled_from(["{", "a b", "é", "x" * 70])
        )
        return pattern.filter(lambda s: s != "" and not s.startswith("-"))
    if p.name == "expect":
        return st.sampled_from(["0", "4097", "a,a", "{x}", "a b,c", "é"])
    if p.name == "slow":
        return st.sampled_from(["3", "3:", ":2", "3:0", "3:101", "3:abc", "{x}:2", "3:nan"])
    raise AssertionError(p.name)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_cli_rejects_bad_option_values(redis_url: str, r: redis.Redis, data: st.DataObject) -> None:
    """Every checked option: exit status 2 (usage), a message naming the option, no
    traceback, and nothing stored (the command never got as far as Redis)."""
    from click.testing import CliRunner

    from redisbal.ops.cli import cli

    command, opt = data.draw(st.sampled_from(CLI_OPTIONS), label="option")
    strategy = bad_option_value(opt)
    if getattr(opt, "_flag_needs_value", False):  # optional value (status --watch): click
        strategy = strategy.filter(lambda v: not v.startswith("-"))  # reads "-x" as an option
    value = data.draw(strategy, label="value")
    deployment = "clifuzz"
    args = [command, "--redis-url", redis_url]
    if opt.name != "deployment":
        args += ["--deployment", deployment]
    args += [f"{opt.opts[0]}={value}"]
    if opt.name != "duration" and any(
        p.name == "duration" for p in cli.get_command(click.Context(cli), command).params
    ):  # type: ignore[union-attr]
        args += ["--duration", "0.5"]  # if a bad value got through, do not run for long
    result = CliRunner().invoke(cli, args)
    out = result.output
    assert result.exit_code == 2, f"{args!r}: exit {result.exit_code}\n{out}\n{result.exception!r}"
    assert isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in out
    names = [o.lstrip("-") for o in opt.opts] + [opt.name or ""]
    assert any(n and n in out for n in names) or "expected engine" in out, (
        f"the error does not name {opt.opts[0]}: {out}"
    )
    assert not list(r.scan_iter(match=f"redisbal:{{{deployment}}}:*"))


@pytest.mark.parametrize(
    "url",
    [
        "redis://user:s3cret@127.0.0.1:notaport/0",
        "redis+sentinel://user:s3cret@127.0.0.1:26379",
        "ftp://user:s3cret@host/",
        "redis+sentinel://:s3cret@h:1/svc?db=x",
        "redis+cluster://:s3cret@h:1,h2",
    ],
)
def test_cli_bad_redis_url_is_a_usage_error_without_the_password(url: str) -> None:
    from click.testing import CliRunner

    from redisbal.ops.cli import cli

    for command in ("coordinator", "status", "engine-sim"):
        result = CliRunner().invoke(
            cli,
            [command, "--redis-url", url, "--duration", "0.1"]
            if command != "status"
            else [command, "--redis-url", url],
        )
        assert result.exit_code == 2, result.output
        assert "redis-url" in result.output and "s3cret" not in result.output, result.output


def test_cli_float_options_reject_nan() -> None:
    from click.testing import CliRunner

    from redisbal.ops.cli import cli

    for bad in ("nan", "inf", "-inf"):
        result = CliRunner().invoke(
            cli, ["engine-sim", "--redis-url", "redis://127.0.0.1:1/0", "--base-step-ms", bad]
        )
        assert result.exit_code == 2 and "base-step-ms" in result.output, result.output


def test_unknown_report_field_is_refused_by_name(target: Target, redis_url: str) -> None:
    """An unknown field is a TypeError naming it (Python's own check), before any I/O."""
    rep = Reporter(redis_url, target.keys.deployment, "e0", heartbeat=False, register=False)
    try:
        before = target.state()
        with pytest.raises(TypeError, match="queue_depth"):
            rep.report(Counts(step=99, waiting=1, running=1, queue_depth=3))  # type: ignore[call-arg]
        assert rep.flush(5)
        assert target.state() == before
    finally:
        rep.close(leave=False)
