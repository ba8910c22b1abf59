"""The Lua scripts, loaded from package data and registered on a client.

Each ``lua/<name>_<nkeys>.lua`` file is one operation; ``lua/common.lua`` is
prepended to each, so the shared barrier logic exists once in source and each
script stays a single atomic EVALSHA. ``register_script`` makes redis-py send
EVALSHA and reload the script by itself after NOSCRIPT (SCRIPT FLUSH, restart,
failover), so callers never see that error.
"""

from __future__ import annotations

from functools import cache
from importlib import resources
from typing import Any

from redisbal.keys import DeploymentKeys

SCRIPT_NAMES = (
    "report",
    "leave",
    "register",
    "reap",
    "force",
    "configure",
    "new_epoch",
    "lease",
)
NUM_KEYS = 7


@cache
def script_source(name: str) -> str:
    """Full source of one script: common.lua followed by the operation itself."""
    if name not in SCRIPT_NAMES:
        raise KeyError(f"unknown script {name!r}; known: {', '.join(SCRIPT_NAMES)}")
    lua = resources.files("redisbal") / "lua"
    common = (lua / "common.lua").read_text(encoding="utf-8")
    body = (lua / f"{name}_{NUM_KEYS}.lua").read_text(encoding="utf-8")
    return f"{common}\n{body}"


class Scripts:
    """The registered scripts of one client (sync or asyncio; calls return what the
    client's script objects return: a value, or an awaitable of it)."""

    def __init__(self, client: Any, keys: DeploymentKeys, pubcmd: str = "PUBLISH") -> None:
        self.keys = keys
        self.pubcmd = pubcmd
        self._keys = keys.script_keys()
        self._scripts = {name: client.register_script(script_source(name)) for name in SCRIPT_NAMES}

    def call(self, name: str, *args: str | int | float, client: Any = None) -> Any:
        """Run script ``name`` with ARGV = deployment, publish command, *args. ``client``
        runs it on another client or a pipeline (EVALSHA queued, NOSCRIPT handled)."""
        argv = [self.keys.deployment, self.pubcmd, *args]
        return self._scripts[name](keys=self._keys, args=argv, client=client)
