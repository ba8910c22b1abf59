"""The Lua loader (``--- @include`` resolution) and the record format's two homes.

The include resolution runs on made-up files (a dict stands in for the package
data); the record format is checked against what the real scripts store.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import redis
from support.helpers import Barrier, text

from redisbal.barrier.loader import (
    SCRIPT_NAMES,
    LuaSourceError,
    include_order,
    includes_of,
    library,
    read_lua,
    script_source,
)
from redisbal.barrier.record import Record, ReportLine, format_record, parse_record
from redisbal.keys import DeploymentKeys

pytestmark = pytest.mark.servers


def _reader(files: dict[str, str]) -> Callable[[str], str]:
    def read(path: str) -> str:
        if path not in files:
            raise LuaSourceError(f"lua/{path} is missing")
        return files[path]

    return read


def test_includes_come_once_each_after_what_they_include() -> None:
    files = {
        "op.lua": '--- @include "b"\n--- @include "a"\nbody',
        "other.lua": '--- @include "c"\n--- @include "a"\n',
        "includes/a.lua": "-- a, no includes",
        "includes/b.lua": '--- @include "a"\n--- @include "c"\n',
        "includes/c.lua": '--- @include "a"\n',
    }
    assert includes_of(files["op.lua"]) == ["b", "a"]
    order = include_order(["op.lua", "other.lua"], _reader(files))
    assert order == ["includes/a.lua", "includes/c.lua", "includes/b.lua"]


@pytest.mark.parametrize(
    ("files", "message"),
    [
        (
            {"op.lua": '--- @include "gone"\n'},
            "lua/includes/gone.lua is missing (included by lua/op.lua)",
        ),
        (
            {
                "op.lua": '--- @include "a"\n',
                "includes/a.lua": '--- @include "b"\n',
                "includes/b.lua": '--- @include "a"\n',
            },
            "include cycle: lua/includes/a.lua -> lua/includes/b.lua -> lua/includes/a.lua",
        ),
        (
            {"op.lua": '--- @include "a"\n', "includes/a.lua": '--- @include "a"\n'},
            "include cycle: lua/includes/a.lua -> lua/includes/a.lua",
        ),
    ],
    ids=["missing", "cycle", "self"],
)
def test_a_missing_include_or_a_cycle_is_a_clear_error(files: dict[str, str], message: str) -> None:
    with pytest.raises(LuaSourceError) as exc:
        include_order(["op.lua"], _reader(files))
    assert str(exc.value) == message


def test_sources_hold_each_include_once_and_every_operation() -> None:
    every = include_order([f"{n}.lua" for n in SCRIPT_NAMES])
    name, source = library()
    assert source.startswith(f"#!lua name={name}\n")
    for path in every:
        assert source.count(f"-- lua/{path}\n") == 1, path
    for op in SCRIPT_NAMES:
        assert f"redis.register_function('{name}_{op}', op_{op})" in source
        eval_source = script_source(op)
        assert eval_source.endswith(read_lua(f"{op}.lua") + "\n")
        for path in include_order([f"{op}.lua"]):
            assert eval_source.count(f"-- lua/{path}\n") == 1, (op, path)
    with pytest.raises(KeyError, match="unknown script"):
        script_source("nope")


# -- the record format: lua/includes/record.lua writes, redisbal/barrier/record.py reads ----


def test_python_reads_and_writes_the_records_the_scripts_store(
    r: redis.Redis, keys: DeploymentKeys
) -> None:
    bar = Barrier(r, keys)
    bar.configure()
    bar.register("e0", "e1")
    for step in (1, 2):
        bar.report("e0", step, 3, 4, kv="0.5", adm="1,2")
        bar.report("e1", step, 5, 6)
    bar.report("e0", 3, 7, 8)  # past the published step 2: keeps 2 behind it
    bar.register("e2")  # after the first snapshot: provisional
    stored = {text(k): text(v) for k, v in r.hgetall(keys.reports).items()}
    registered = parse_record(stored["e2"])
    assert registered.flag == "p" and registered.latest is None and registered.due_ms > 0
    e0 = parse_record(stored["e0"])
    assert e0.flag == "b" and e0.scores == [3, 2]
    assert e0.latest is not None and e0.latest.counts() == {
        "wave": 0,
        "step": 3,
        "waiting": 7,
        "running": 8,
        "kv": None,
        "t": e0.latest.ms,
    }
    assert e0.reports[1].counts()["adm"] == [1, 2] and e0.reports[1].counts()["kv"] == 0.5
    for raw in (stored["e0"], stored["e1"], stored["e2"]):
        assert format_record(parse_record(raw)) == raw


def test_record_round_trip_and_refusals() -> None:
    rec = Record("p", 17, (ReportLine(2**32 + 5, 1000, '{"wave":1}'), ReportLine(3, 999, "{}")))
    assert format_record(rec) == 'p17\n4294967301\t1000\t{"wave":1}\n3\t999\t{}'
    assert parse_record(format_record(rec)) == rec
    assert (rec.reports[0].wave, rec.reports[0].step) == (1, 5)
    assert parse_record(b"b") == Record("b", 0, ())
    for bad in ("", "x12", "b12\n1\t2", "b12\nx\t2\t{}", "b1 2"):
        with pytest.raises(ValueError):
            parse_record(bad)
