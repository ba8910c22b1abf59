"""The package's layering as a user meets it: `import redisbal` stays light, the
operator CLI never imports the tooling, and the lazily registered commands are
listed as they will run."""

from __future__ import annotations

import inspect
import subprocess
import sys

import click
import click.testing
import pytest

from redisbal.ops.cli import EXTERNAL_COMMANDS, cli, load_command

TOOLING = ("redisbal.sim", "redisbal.bench", "matplotlib")


def _loaded_after(code: str) -> list[str]:
    """Modules of interest imported by ``code`` in a fresh interpreter."""
    probe = (
        f"{code}\nimport sys\n"
        "print('\\n'.join(sorted(m for m in sys.modules "
        f"if m.startswith({(*TOOLING, 'click')!r}))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    return out.stdout.split()


def test_import_redisbal_loads_no_cli_and_no_tooling() -> None:
    assert _loaded_after("import redisbal") == []


@pytest.mark.parametrize(
    "argv", [["--help"], ["status", "--help"], ["status", "--redis-url", "redis://127.0.0.1:1"]]
)
def test_operator_commands_import_no_tooling(argv: list[str]) -> None:
    code = (
        "from click.testing import CliRunner\nfrom redisbal.ops.cli import cli\n"
        f"r = CliRunner().invoke(cli, {argv!r})\nassert r.exception is None or "
        "isinstance(r.exception, SystemExit), r.output"
    )
    loaded = _loaded_after(code)
    assert not [m for m in loaded if m.startswith(TOOLING)], loaded


@pytest.mark.parametrize("name", sorted(EXTERNAL_COMMANDS))
def test_listed_summary_is_the_commands_own(name: str) -> None:
    """`redisbal --help` shows EXTERNAL_COMMANDS' summary without importing the command;
    it must be the first paragraph of the command's help."""
    cmd = load_command(name)
    assert cmd.name == name
    first = inspect.cleandoc(cmd.help or "").split("\n\n")[0].replace("\n", " ")
    assert EXTERNAL_COMMANDS[name][1] == first


def test_every_command_is_listed_and_runs_its_help() -> None:
    runner = click.testing.CliRunner()
    listing = runner.invoke(cli, ["--help"]).output
    for name in ["coordinator", "status", "load-functions", *EXTERNAL_COMMANDS]:
        assert f"\n  {name} " in listing, name
        r = runner.invoke(cli, [name, "--help"])
        assert r.exit_code == 0 and "--redis-url" in r.output, (name, r.output)
