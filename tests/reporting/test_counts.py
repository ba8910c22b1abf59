"""``Counts``: one engine's counts, checked once when made, as every reporter takes them."""

from __future__ import annotations

import pytest

from redisbal import Counts, InvalidReport


def test_counts_are_checked_when_made_and_name_the_field() -> None:
    for kwargs, field in (
        ({"waiting": -1}, "waiting"),
        ({"running": 1.5}, "running"),
        ({"step": True}, "step"),
        ({"step": 2**32}, "step"),
        ({"wave": 2**20}, "wave"),
        ({"kv_usage": 1.5}, "kv_usage"),
        ({"kv_usage": float("nan")}, "kv_usage"),
        ({"admitted": "12"}, "admitted"),
        ({"admitted": [1, -2]}, r"admitted\[1\]"),
        ({"admitted_total": -1}, "admitted_total must be in"),
        ({"admitted_total": 10**15}, "admitted_total must be in"),
        ({"admitted_total": 2.0}, "admitted_total must be a whole number"),
        ({"admitted_total": True}, "admitted_total must be a whole number"),
    ):
        with pytest.raises(InvalidReport, match=field):
            Counts(**kwargs)  # type: ignore[arg-type]


def test_counts_are_frozen_and_keep_admitted_as_a_tuple() -> None:
    c = Counts(3, 1, 2, admitted=[4, 5])
    assert c.admitted == (4, 5)
    with pytest.raises(AttributeError):
        c.waiting = 9  # type: ignore[misc]
    assert c == Counts(3, 1, 2, admitted=(4, 5))
    with pytest.raises(InvalidReport, match="running"):
        c._replace(running=-1)


def test_argv_is_what_lua_report_takes_in_each_mode() -> None:
    c = Counts(7, 1, 2, wave=3, kv_usage=0.5, admitted=[0, 4], progress=False)
    assert c.argv("lockstep") == ["3", "7", "1", "2", "0.5000", "0,4", "0"]
    assert Counts(None, 1, 2).argv("tick") == ["0", "tick", "1", "2", "", "", "1"]
    # the admitted total, when there is one, before the progress flag (kept last)
    assert Counts(None, admitted_total=9).argv("tick")[-2:] == ["9", "1"]
    with pytest.raises(InvalidReport, match="step is required"):
        Counts(None).argv("lockstep")
    with pytest.raises(InvalidReport, match="tick mode"):
        Counts(1).argv("tick")


def test_of_takes_counts_or_a_mapping_of_their_fields() -> None:
    c = Counts(1, 2, 3)
    assert Counts.of(c) is c
    assert Counts.of({"step": 1, "waiting": 2, "running": 3}) == c
    with pytest.raises(InvalidReport, match="mapping of step"):
        Counts.of({"step": 1, "queue": 2})
    with pytest.raises(InvalidReport, match="mapping of step"):
        Counts.of([1, 2, 3])  # type: ignore[arg-type]
