"""The Lua operations as Redis runs them: one EVAL source per operation, and one
Redis 7 function library holding them all.

``lua/<operation>.lua`` is one operation: a header (what it does, KEYS, ARGV,
returns, errors), then a body that reads ``KEYS`` and ``ARGV``. What operations
share lives in small files in ``lua/includes/``, pulled in by lines
``--- @include "<name>"`` at the top of a file (an include may include others).
Building a source puts each include once, after the includes it names itself,
then the operation: a missing include or a cycle is a :class:`LuaSourceError`
naming the files. Includes only define constants and functions, so they can run
once when a library loads, where nothing may read KEYS or call Redis.

- **EVAL source** of an operation: its includes, then its body (``KEYS`` and
  ``ARGV`` are the script's globals).
- **Function library** ``redisbal_<hash>``: every include of every operation,
  once, then each operation's body as ``local function op_<name>(KEYS, ARGV)``,
  registered as ``redisbal_<hash>_<name>``, so the same text runs in both modes.
  The hash of the text is in the name: two redisbal versions never clash.

The files are package data, read with importlib.resources; see docs/DESIGN.md
for the barrier they implement. One include is generated instead of read:
``settings``, the deployment settings' defaults and bounds and the lease TTL's
bounds from :mod:`redisbal.config`, so the Lua and the Python check the same
numbers from one home.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterable
from functools import cache
from importlib import resources

from redisbal.config import LEASE_TTL, SETTINGS
from redisbal.errors import LuaSourceError as LuaSourceError

# The operations, each lua/<name>.lua; scripts.Scripts.call takes these names.
SCRIPT_NAMES = (
    "report",
    "report_many",
    "leave",
    "register",
    "reap",
    "force",
    "configure",
    "new_epoch",
    "lease",
    "suspect",
    "recovered",
)
NUM_KEYS = 7  # every operation gets the deployment's seven keys (keys.script_keys())

INCLUDE_DIR = "includes"
INCLUDE_RE = re.compile(r'^--- @include "([A-Za-z0-9_]+)"[ \t]*$', re.M)


def settings_lua() -> str:
    """The ``settings`` include, generated from redisbal/config.py."""
    rows = "".join(
        f"  {name} = {{default = {s.default}, lo = {s.lo}, hi = {s.hi}, unit = '{s.unit}'}},\n"
        for name, s in SETTINGS.items()
    )
    return (
        "-- settings: generated from redisbal/config.py by redisbal/barrier/loader.py\n"
        "-- (defaults, inclusive bounds and units); edit config.py, not this text\n"
        f"local SETTINGS = {{\n{rows}}}\n"
        f"local LEASE_TTL = {{lo = {LEASE_TTL.lo}, hi = {LEASE_TTL.hi}}}\n"
    )


GENERATED = {f"{INCLUDE_DIR}/settings.lua": settings_lua}


def read_lua(path: str) -> str:
    """The text of ``lua/<path>`` in the installed package (or a generated include)."""
    if path in GENERATED:
        return GENERATED[path]()
    try:
        return (resources.files("redisbal.barrier") / "lua" / path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise LuaSourceError(f"lua/{path} is missing") from None


def include_path(name: str) -> str:
    return f"{INCLUDE_DIR}/{name}.lua"


def includes_of(text: str) -> list[str]:
    """The include names a file asks for, in the order of its ``--- @include`` lines."""
    return INCLUDE_RE.findall(text)


def include_order(roots: Iterable[str], read: Callable[[str], str] = read_lua) -> list[str]:
    """Paths of every include the files ``roots`` need, each once, every include
    after those it includes (depth first, in the order of the include lines)."""
    order: list[str] = []
    done: set[str] = set()

    def visit(path: str, chain: tuple[str, ...]) -> None:
        """chain: the files whose include lines led to path, outermost first."""
        try:
            text = read(path)
        except LuaSourceError:
            if not chain:
                raise
            raise LuaSourceError(f"lua/{path} is missing (included by lua/{chain[-1]})") from None
        stack = (*chain, path)
        for name in includes_of(text):
            inc = include_path(name)
            if inc in stack:
                loop = (*stack[stack.index(inc) :], inc)
                raise LuaSourceError("include cycle: " + " -> ".join(f"lua/{p}" for p in loop))
            if inc not in done:
                visit(inc, stack)
        if chain:  # an include (a root is an operation)
            done.add(path)
            order.append(path)

    for root in roots:
        visit(root, ())
    return order


def _check(name: str) -> None:
    if name not in SCRIPT_NAMES:
        raise KeyError(f"unknown script {name!r}; known: {', '.join(SCRIPT_NAMES)}")


def _piece(path: str, read: Callable[[str], str]) -> str:
    """One file, headed by its path so that a Lua error's line leads to the file."""
    return f"-- lua/{path}\n{read(path)}\n"


@cache
def script_source(name: str) -> str:
    """EVAL source of one operation: its includes, then its own file."""
    _check(name)
    root = f"{name}.lua"
    return "".join(_piece(p, read_lua) for p in (*include_order([root]), root))


@cache
def library() -> tuple[str, str]:
    """(name, source) of the function library holding every operation (Redis >= 7.0)."""
    roots = [f"{n}.lua" for n in SCRIPT_NAMES]
    parts = [_piece(p, read_lua) for p in include_order(roots)]
    for name in SCRIPT_NAMES:
        body = _piece(f"{name}.lua", read_lua)
        parts.append(f"local function op_{name}(KEYS, ARGV)\n{body}end\n")
    code = "".join(parts)
    lib = "redisbal_" + hashlib.sha1(code.encode()).hexdigest()[:12]
    regs = "".join(f"redis.register_function('{lib}_{name}', op_{name})\n" for name in SCRIPT_NAMES)
    return lib, f"#!lua name={lib}\n{code}{regs}"
