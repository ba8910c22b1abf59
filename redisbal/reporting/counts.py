"""One engine's counts at one step (``Counts``), checked when made: what a reporter
hands to its sender, and the one place the report's fields are listed."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from redisbal.barrier.snapshot import MAX_COUNT, check_total
from redisbal.errors import InvalidReport as InvalidReport

__all__ = ["MODES", "Counts", "InvalidReport"]

MAX_STEP = 2**32 - 1
MAX_WAVE = 2**20 - 1
MAX_CLIENTS = 4096
MODES = ("lockstep", "tick")


def _count(name: str, value: object, hi: int = MAX_COUNT) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidReport(f"{name} must be a whole number, got {value!r}")
    if not 0 <= value <= hi:
        raise InvalidReport(f"{name} must be in 0..{hi}, got {value}")
    return value


class _CountsFields(NamedTuple):
    step: int | None = None
    waiting: int = 0
    running: int = 0
    wave: int = 0
    kv_usage: float | None = None
    admitted: Sequence[int] | None = None  # kept as a tuple
    progress: bool = True
    admitted_total: int | None = None


_new_counts = _CountsFields.__new__


class Counts(_CountsFields):
    """One engine's counts at one step, checked when made (InvalidReport names the
    field): what a reporter hands to its sender. ``step`` and ``wave`` tag a lockstep
    report (None in tick mode: the server assigns the tick); ``admitted`` holds, per
    router client index, how many routed requests the engine has taken in;
    ``admitted_total``, what an engine that cannot count per router can say: all the
    requests it has taken in since its process began (finished + waiting + running);
    ``progress=False`` says the engine's loop did not move since its last report.
    Immutable (a named tuple: ``_replace`` makes a changed copy, checked again)."""

    __slots__ = ()

    def __new__(cls, *args: Any, **kwargs: Any) -> Counts:
        self = _new_counts(cls, *args, **kwargs)
        step, waiting, running, wave, kv, adm, progress, total = self
        # the usual case in one expression; the checks one by one name a bad field
        if not (
            type(waiting) is int
            and type(running) is int
            and type(wave) is int
            and 0 <= waiting <= MAX_COUNT
            and 0 <= running <= MAX_COUNT
            and 0 <= wave <= MAX_WAVE
            and (step is None or (type(step) is int and 0 <= step <= MAX_STEP))
        ):
            if step is not None:
                _count("step", step, MAX_STEP)
            _count("wave", wave, MAX_WAVE)
            _count("waiting", waiting)
            _count("running", running)
        if kv is not None and not (type(kv) is float and 0.0 <= kv <= 1.0):
            if isinstance(kv, bool) or not isinstance(kv, int | float):
                raise InvalidReport(f"kv_usage must be a number in [0, 1], got {kv!r}")
            if not (math.isfinite(kv) and 0.0 <= kv <= 1.0):
                raise InvalidReport(f"kv_usage must be in [0, 1], got {kv!r}")
        if total is not None:
            check_total(total, InvalidReport)
        if adm is not None:
            if (
                isinstance(adm, str | bytes)
                or not isinstance(adm, Sequence)
                or len(adm) > MAX_CLIENTS
            ):
                raise InvalidReport(f"admitted must be a list of at most {MAX_CLIENTS} counts")
            for i, a in enumerate(adm):
                _count(f"admitted[{i}]", a, 10**15 - 1)
            if not isinstance(adm, tuple):
                return _new_counts(
                    cls, step, waiting, running, wave, kv, tuple(adm), progress, total
                )
        return self

    @classmethod
    def _make(cls, iterable: Any) -> Counts:  # type: ignore[override]  # _replace: checked
        return cls(*iterable)

    @classmethod
    def of(cls, counts: Counts | Mapping[str, Any]) -> Counts:
        """``counts`` as Counts: a mapping of its fields is checked (InvalidReport)."""
        if isinstance(counts, Counts):
            return counts
        if not isinstance(counts, Mapping) or set(counts) - set(cls._fields):
            raise InvalidReport(f"counts must be Counts or a mapping of {', '.join(cls._fields)}")
        return cls(**counts)

    def argv(self, mode: str) -> list[str]:
        """ARGV 5..10 of lua/report.lua, the admitted total when there is one (ARGV 13)
        and the progress flag, last, for ``mode``."""
        step, waiting, running, wave, kv, adm, progress, total = self
        if mode == "lockstep":
            if step is None:
                raise InvalidReport("step is required in lockstep mode (or use mode='tick')")
            wave_s, step_s = str(wave), str(step)
        elif step is not None:
            raise InvalidReport("step must not be given in tick mode: the server assigns the tick")
        else:
            wave_s, step_s = "0", "tick"
        args = [
            wave_s,
            step_s,
            str(waiting),
            str(running),
            "" if kv is None else f"{kv:.4f}",
            "" if adm is None else ",".join(map(str, adm)),
            "1" if progress else "0",
        ]
        if total is not None:
            args.insert(6, str(total))
        return args
