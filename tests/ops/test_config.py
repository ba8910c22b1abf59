"""Coordinator settings have one home (redisbal/config.py): the CLI's options and
CoordinatorConfig take their defaults and bounds from it."""

from __future__ import annotations

import click
import pytest
import redis
from click.testing import CliRunner
from support.helpers import Barrier

from redisbal.config import LEASE_TTL, SETTINGS, CoordinatorConfig
from redisbal.keys import DeploymentKeys
from redisbal.ops.cli import cli


@pytest.fixture
def bar(r: redis.Redis, keys: DeploymentKeys) -> Barrier:
    return Barrier(r, keys)


def _options() -> dict[str, click.Option]:
    cmd = cli.get_command(click.Context(cli), "coordinator")
    assert cmd is not None
    return {p.name: p for p in cmd.params if isinstance(p, click.Option) and p.name}


@pytest.mark.parametrize("name", [*SETTINGS, "lease_ttl_ms"])
def test_cli_option_defaults_and_bounds_come_from_config(name: str) -> None:
    setting = LEASE_TTL if name == "lease_ttl_ms" else SETTINGS[name]
    opt = _options()[name]
    assert opt.default == setting.default == getattr(CoordinatorConfig(), name)
    assert isinstance(opt.type, click.IntRange)
    assert (opt.type.min, opt.type.max) == (setting.lo, setting.hi)


@pytest.mark.parametrize("name", [*SETTINGS, "lease_ttl_ms"])
def test_config_refuses_each_bound_plus_one(name: str) -> None:
    setting = LEASE_TTL if name == "lease_ttl_ms" else SETTINGS[name]
    for bad in (setting.lo - 1, setting.hi + 1):
        kw = {name: bad}
        if name == "dead_after_ms" and bad < CoordinatorConfig().stall_ms:
            kw["stall_ms"] = 1  # so that the bound, not stall < dead_after, is what fails
        with pytest.raises(ValueError, match=name):
            CoordinatorConfig(**kw).check()  # type: ignore[arg-type]
    CoordinatorConfig(**{name: setting.lo if name != "dead_after_ms" else 300}).check()  # type: ignore[arg-type]


def test_lease_ttl_floor_is_checked_by_the_coordinator_and_the_cli() -> None:
    from redisbal.ops.coordinator import Coordinator

    with pytest.raises(ValueError, match="lease_ttl_ms must be a whole number of ms in 200"):
        Coordinator("redis://127.0.0.1:1", "d", lease_ttl_ms=199)
    r = CliRunner().invoke(
        cli, ["coordinator", "--redis-url", "redis://127.0.0.1:1", "--lease-ttl-ms", "199"]
    )
    assert r.exit_code == 2 and "--lease-ttl-ms" in r.output and "Traceback" not in r.output


@pytest.mark.parametrize("name", list(SETTINGS))
def test_the_lua_checks_the_same_bounds(bar: Barrier, name: str) -> None:
    """The scripts take their defaults and bounds from config.py (a generated include):
    configure accepts each bound and refuses one past it, like CoordinatorConfig."""
    s = SETTINGS[name]
    bar.configure(**{name: s.lo})
    bar.configure(**{name: s.hi})
    for bad in (s.lo - 1, s.hi + 1):
        with pytest.raises(redis.ResponseError, match=f"bad {name}"):
            bar.configure(**{name: bad})


def test_the_lua_lease_refuses_a_ttl_below_the_floor(bar: Barrier) -> None:
    def lease(ttl: int) -> object:
        return bar.scripts.call("lease", "c1", ttl, "acquire")

    lease(LEASE_TTL.lo)
    with pytest.raises(redis.ResponseError, match="bad ttl_ms"):
        lease(LEASE_TTL.lo - 1)


def test_a_setting_names_its_unit_in_errors_and_help(bar: Barrier) -> None:
    """compact_from counts engines: its messages and --help say so, the times say ms."""
    with pytest.raises(ValueError, match="compact_from must be a whole number of engines in 0"):
        CoordinatorConfig(compact_from=-1).check()
    with pytest.raises(ValueError, match="stall_ms must be a whole number of ms in 1"):
        CoordinatorConfig(stall_ms=0).check()
    with pytest.raises(redis.ResponseError, match=r"bad compact_from: -1 \(whole engines in 0"):
        bar.configure(compact_from=-1)
    with pytest.raises(redis.ResponseError, match=r"bad stall_ms: 0 \(whole ms in 1"):
        bar.configure(stall_ms=0)
    opts = _options()
    assert opts["compact_from"].metavar == "ENGINES" and opts["stall_ms"].metavar == "MS"
    out = CliRunner().invoke(cli, ["coordinator", "--help"]).output
    assert "--compact-from ENGINES" in out and "--stall-ms MS" in out
