"""scripts/chaos.py's sums of what the engines did (their ledgers) and what the client
got: a request executed twice, sent whole twice, or delivered twice are three things."""

from __future__ import annotations

from types import ModuleType

from support.scripts import load_script


def load() -> ModuleType:
    return load_script("chaos")


def test_twice_is_told_apart_by_who_saw_it() -> None:
    c = load()
    stall = c.Fault("engine_stall", at=0.0, hold=10.0, target="e0", started=100.0, ended=110.0)
    ledgers = {
        # r1: e0 finished it, stalled, and saw the gateway leave; e1 did it again
        # r2: e0 sent its whole answer as the gateway gave up on it: the engine cannot
        #     tell, the client got e1's answer alone
        # r3: one engine, one answer
        "e0": [
            (101.0, "arrive", "r1"),
            (101.0, "finish", "r1"),
            (104.0, "abort", "r1"),
            (105.0, "finish", "r2"),
        ],
        "e1": [(104.1, "finish", "r1"), (108.0, "finish", "r2"), (109.0, "finish", "r3")],
    }
    results = [c.Result(f"r{i}", "g0", 100.0, ok=True, answers=1) for i in (1, 2, 3)]
    s = c.served(results, ledgers, [stall])
    assert s["executions"] == 5 and s["executed_twice"] == 2
    assert s["executed_twice_by_fault"] == {"engine_stall": 1, "no engine fault": 1}
    assert s["executed_twice_when"] == [
        {"id": "r1", "fault": "engine_stall", "engine": "e0", "reached_into_fault_s": 1.0,
         "finished_after_s": 0.0, "given_up_after_s": 3.0}
    ]  # fmt: skip
    assert s["sent_whole_twice"] == 1 and s["delivered_twice"] == 0
    # an answer whose chunks carry two engines' answer ids is one delivered twice
    results[2].answers = 2
    assert c.served(results, ledgers, [stall])["delivered_twice"] == 1


def test_a_gateways_probe_is_counted_apart_from_the_request_it_copies() -> None:
    """A probe is a copy of a request routed elsewhere (its own ledger events): the
    probed engine finishing it besides the engine that answered is no request executed
    twice, and the probe reaching a faulty engine is no decision to it."""
    c = load()
    stall = c.Fault("engine_stall", at=0.0, hold=10.0, target="e0", started=100.0, ended=110.0)
    ledgers = {
        "e0": [(102.0, "probe_reach", "r1"), (102.0, "probe_arrive", "r1"),
               (102.5, "probe_finish", "r1"), (105.0, "probe_abort", "r1")],
        "e1": [(102.0, "reach", "r1"), (102.0, "arrive", "r1"), (102.4, "finish", "r1")],
    }  # fmt: skip
    results = [c.Result("r1", "g0", 102.0, ok=True, answers=1)]
    s = c.served(results, ledgers, [stall])
    assert s["executions"] == 1 and s["executed_twice"] == 0
    assert s["probe_executions"] == 1 and s["executed_not_answered"] == 0
    c.reached_while_faulty(results, ledgers, [stall])
    assert stall.decisions == 0
