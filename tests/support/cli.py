"""The ``redisbal`` command as a user runs it: a process of its own, with an
environment free of the developer's REDISBAL_ settings."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping

import pytest

# the console script of the interpreter running the tests (the venv's own)
REDISBAL = os.path.join(os.path.dirname(sys.executable), "redisbal")


def scrubbed_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment without any REDISBAL_ or OTEL_ variable, plus
    ``extra``: the shared options and the gateway's tracing read those variables, and a
    developer's own must not change what a command does under test."""
    env = {k: v for k, v in os.environ.items() if not _ours(k)}
    return {**env, **(extra or {})}


def scrub_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    """``scrubbed_env`` for a command run in this process (click's CliRunner): every
    REDISBAL_ and OTEL_ variable unset for the one test."""
    for name in [k for k in os.environ if _ours(k)]:
        monkeypatch.delenv(name)


def _ours(name: str) -> bool:
    return name.startswith(("REDISBAL_", "OTEL_"))


def run_cli(
    *args: str, env: Mapping[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """``redisbal ARGS`` run to its end in a scrubbed environment (plus ``env``), its
    output captured as text."""
    return subprocess.run(
        [REDISBAL, *args], capture_output=True, text=True, timeout=timeout, env=scrubbed_env(env)
    )
