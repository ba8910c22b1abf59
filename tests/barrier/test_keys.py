"""Invariant 7 (cluster-safe) and the name checks that guard every key.

Statically: every key of a deployment hashes to one slot, and no Lua file
builds a key name (each redis.call names a key only through KEYS, via the
deployment table ``d`` that lua/includes/deployment.lua fills from KEYS).
Dynamically, on a real server: MONITOR shows every command the scripts
issue, and COMMAND GETKEYS says which of its arguments are keys; each must be
one of the KEYS the script was given. And the scripts
run through register_script (EVALSHA), recovering from SCRIPT FLUSH.
"""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path

import pytest
import redis
from redis.crc import key_slot
from support.helpers import Barrier, script_sha, text

from redisbal.barrier.loader import GENERATED, NUM_KEYS, SCRIPT_NAMES, include_order, library
from redisbal.keys import DeploymentKeys, InvalidName, check_name

pytestmark = pytest.mark.servers

LUA_DIR = Path(str(resources.files("redisbal.barrier") / "lua"))

# -- names ----------------------------------------------------------------------------------------

GOOD_NAMES = ["0", "llama", "a.b-c_d", "Z" * 64, "9-x"]
BAD_NAMES: list[object] = [
    "",
    "a b",
    "a{b",
    "a}b",
    "{a}",
    "x" * 65,
    "-lead",
    ".lead",
    "_lead",
    "a:b",
    "a\nb",
    "a*",
    "é",
    b"bytes",
    7,
    None,
]


@pytest.mark.parametrize("name", GOOD_NAMES)
def test_good_names_pass(name: str) -> None:
    assert check_name(name, "engine_id") == name
    assert DeploymentKeys(name).deployment == name


@pytest.mark.parametrize("name", BAD_NAMES)
def test_bad_names_raise_and_build_no_key(name: object) -> None:
    with pytest.raises(InvalidName) as exc:
        check_name(name, "engine_id")
    assert "engine_id" in str(exc.value) and repr(name) in str(exc.value)
    with pytest.raises(InvalidName, match="deployment"):
        DeploymentKeys(name)  # type: ignore[arg-type]


# -- one slot ---------------------------------------------------------------------------------


@pytest.mark.parametrize("deployment", GOOD_NAMES)
def test_every_key_of_a_deployment_shares_one_hash_slot(deployment: str) -> None:
    keys = DeploymentKeys(deployment)
    every = [
        *keys.script_keys(),
        *keys.all_keys(),
        keys.channel,
    ]
    slot = key_slot(f"{{{deployment}}}".encode())
    for k in every:
        assert k.startswith(f"redisbal:{{{deployment}}}:"), k
        assert key_slot(k.encode()) == slot, f"{k} is not in slot {slot}"
    assert len(set(keys.script_keys())) == len(keys.script_keys()), "two script keys collide"


def test_all_keys_covers_every_stored_key(r: redis.Redis, keys: DeploymentKeys) -> None:
    """Cleanup and dumps rely on all_keys(): after a busy sequence, nothing else exists."""
    bar = Barrier(r, keys)
    bar.configure()
    bar.register("e0", "e1")
    bar.report("e0", 1, 1, 1)
    bar.report("e1", 1, 1, 1)
    bar.report("e1", 0, 1, 1)  # stale counter
    bar.scripts.call("lease", "c1", 1000, "acquire")
    bar.force("0")
    bar.leave("e1")
    stored = {text(k) for k in r.scan_iter(match=f"redisbal:{{{keys.deployment}}}:*")}
    assert stored and stored <= set(keys.all_keys())


# -- Lua never builds a key -----------------------------------------------------------------------


def _lua_files() -> dict[str, str]:
    """Every Lua file of the package, by its path under lua/, and the generated
    includes (lua_source.GENERATED), which must obey the same rules."""
    files = {
        p.relative_to(LUA_DIR).as_posix(): p.read_text(encoding="utf-8")
        for p in sorted(LUA_DIR.rglob("*.lua"))
    }
    return {**files, **{path: make() for path, make in GENERATED.items()}}


def _strip_comments(src: str) -> str:
    src = re.sub(r"--\[\[.*?\]\]", "", src, flags=re.S)
    return re.sub(r"--[^\n]*", "", src)


def _calls(src: str) -> list[list[str]]:
    """Arguments (top-level, as source text) of every redis.call(...) in src."""
    out = []
    for m in re.finditer(r"redis\.call\(", src):
        depth, i, args, cur = 1, m.end(), [], ""
        quote = None
        while depth:
            ch = src[i]
            if quote:
                cur += ch
                if ch == quote and src[i - 1] != "\\":
                    quote = None
            elif ch in "'\"":
                quote = ch
                cur += ch
            elif ch == "(":
                depth += 1
                cur += ch
            elif ch == ")":
                depth -= 1
                if depth:
                    cur += ch
            elif ch == "," and depth == 1:
                args.append(cur.strip())
                cur = ""
            else:
                cur += ch
            i += 1
        args.append(cur.strip())
        out.append(args)
    return out


def test_lua_names_keys_only_through_keys() -> None:
    files = _lua_files()
    operations = [f"{n}.lua" for n in SCRIPT_NAMES]
    # every file is an operation or an include that some operation uses
    assert set(files) == {*operations, *include_order(operations)}
    # KEYS are bound once, in deployment.lua: KEYS[i] becomes the field d.<name> of the
    # deployment table, after a check that it is the key DeploymentKeys names so
    deployment = _strip_comments(files["includes/deployment.lua"])
    suffixes = re.search(r"local KEY_SUFFIXES = \{([^}]*)\}", deployment)
    assert suffixes is not None
    keys = DeploymentKeys("d")
    expected = [keys.key(s) for s in re.findall(r"'([\w-]+)'", suffixes.group(1))]
    assert expected == keys.script_keys() and len(expected) == NUM_KEYS
    assert "if keys[i] ~= expected then return nil" in deployment
    bound = {int(i): f for f, i in re.findall(r"(\w+) = keys\[(\d+)\]", deployment)}
    assert sorted(bound) == list(range(1, NUM_KEYS + 1))
    for i, field in bound.items():
        assert getattr(keys, field) == keys.script_keys()[i - 1], f"{field} is KEYS[{i}]"
    assert len(re.findall(r"\bkeys\[", deployment)) == NUM_KEYS + 1  # the check, the fields
    key_var = r"d\.(?:" + "|".join(bound.values()) + ")"
    n_calls = 0
    for name, raw in files.items():
        src = _strip_comments(raw)
        if name in operations:  # KEYS only goes to open_deployment, which checks them
            assert re.findall(r"\bKEYS\b", src) == ["KEYS"], name
            assert "local d, err = open_deployment(KEYS, ARGV, " in src, name
        else:
            assert not re.search(r"\bKEYS\b", src), f"{name} reads KEYS"
        # d is the deployment table: never rebound, no field set outside deployment.lua
        rebinds = re.findall(r"\bd(?:\.\w+|\[.*?\])?\s*=(?!=)[^\n]*", src)
        assert not rebinds, f"{name} rebinds d: {rebinds}"
        for args in _calls(src):
            n_calls += 1
            cmd = args[0].strip("'\"").upper()
            if cmd == "TIME":
                assert len(args) == 1
                continue
            assert len(args) >= 2 and re.fullmatch(key_var, args[1]), (
                f"{name}: redis.call({', '.join(args)}) names a key not taken from KEYS"
            )
            if cmd == "DEL":
                assert all(re.fullmatch(key_var, a) for a in args[1:]), args
    assert n_calls > 30  # the parser found the calls


def _unescape(arg: str) -> str:
    return re.sub(
        r"\\(x[0-9a-fA-F]{2}|.)",
        lambda m: (
            chr(int(m.group(1)[1:], 16))
            if m.group(1).startswith("x")
            else {"n": "\n", "r": "\r", "t": "\t", "a": "\a", "b": "\b"}.get(m.group(1), m.group(1))
        ),
        arg,
    )


def test_scripts_touch_only_their_keys_on_a_real_server(
    r: redis.Redis, keys: DeploymentKeys, redis_url: str
) -> None:
    """Run every script through its interesting paths under MONITOR; every key any
    Lua-issued command touches must be one of the script's KEYS."""
    mon_client = redis.Redis.from_url(redis_url)
    monitor = mon_client.monitor()
    monitor.__enter__()
    try:
        bar = Barrier(r, keys)
        bar.configure()
        bar.register("e0", "e1", "e2")
        for step in (1, 2):
            for e in ("e0", "e1", "e2"):
                bar.report(e, step, step, step, kv="0.5", adm="1,2")
            bar.configure(compact_from=0)  # step 1 full, the rest compact
        bar.report("e0", 1, 0, 0)  # stale
        many = [
            "e0",
            "0",
            "3",
            "0",
            "0",
            "",
            "",
            "-",
            "1",
            "e2",
            "0",
            "3",
            "1",
            "1",
            "",
            "",
            "-",
            "1",
        ]
        bar.scripts.call("report_many", bar.epoch, 2, *many)
        bar.report("e0", 3, 0, 0)
        bar.report("e1", "tick", 0, 0)
        bar.force("0")
        bar.suspect("e0")
        bar.scripts.call("recovered", "e0", "-")
        bar.leave("e2")
        bar.expire_now("e1")
        bar.reap()
        lease = bar.scripts.call("lease", "c1", 1000, "acquire")
        bar.reap(fence=str(int(lease[1])))
        bar.scripts.call("lease", "c1", 1000, "release")
        bar.scripts.call("new_epoch", "e2")
        r.echo("end-of-test")
        lua_cmds: list[list[str]] = []
        ran = set()  # script shas (EVALSHA) or function names (FCALL)
        ours = False  # the Lua lines that follow belong to one of this test's calls
        while True:
            line = text(monitor.connection.read_response())
            args = [_unescape(a) for a in re.findall(r'"((?:[^"\\]|\\.)*)"', line)]
            if args == ["ECHO", "end-of-test"]:
                break
            if "[0 lua]" in line:
                if ours:  # a script runs atomically: its commands follow its EVALSHA
                    lua_cmds.append(args)
            else:
                # other clients of a shared server (REDISBAL_REDIS_URL) are not ours
                n_keys = int(args[2]) if len(args) > 2 and args[2].isdigit() else 0
                ours = args[:1] in (["EVALSHA"], ["FCALL"])
                ours = ours and args[3 : 3 + n_keys] == keys.script_keys()
                if ours:
                    ran.add(args[1])
    finally:
        monitor.__exit__(None, None, None)
        mon_client.close()
    scripts = bar.scripts
    if scripts.mode == "functions":
        assert ran == {scripts.function_name(n) for n in SCRIPT_NAMES}, "not every function ran"
    else:
        assert ran == {script_sha(n) for n in SCRIPT_NAMES}, "not every script ran"
    allowed = set(keys.script_keys())
    seen_cmds = set()
    for args in lua_cmds:
        cmd = args[0].upper()
        seen_cmds.add(cmd)
        if cmd == "TIME":
            continue
        if cmd in ("PUBLISH", "SPUBLISH"):
            assert args[1] == keys.channel
            continue
        touched = {text(k) for k in r.command_getkeys(*args)}
        assert touched and touched <= allowed, f"{args[:3]} touches {touched - allowed}"
    assert {"HSET", "ZADD", "PUBLISH", "SET", "DEL", "ZREM", "HDEL"} <= seen_cmds


# -- register_script / NOSCRIPT ---------------------------------------------------------------


def test_scripts_are_registered_and_recover_from_script_flush(
    r: redis.Redis, keys: DeploymentKeys
) -> None:
    bar = Barrier(r, keys, use_functions=False)
    shas = [script_sha(n) for n in SCRIPT_NAMES]  # each operation's own source, cached

    def stat(cmd: str) -> int:
        return int(r.info("commandstats").get(f"cmdstat_{cmd}", {}).get("calls", 0))

    eval_before = stat("eval")
    bar.configure()
    bar.register("e0")
    assert bar.report("e0", 1, 1, 1)[0] == "accepted"
    r.script_flush()
    assert r.script_exists(*shas) == [False] * len(shas)
    evalsha_before = stat("evalsha")
    # every script still works after the flush (NOSCRIPT reloads it by itself)
    assert bar.report("e0", 2, 1, 1)[0] == "accepted"
    assert bar.register("e1") == 1
    bar.reap()
    bar.force("0")
    assert bar.suspect("e0")[0] == "capped"  # (one engine that reported: never marked)
    assert bar.scripts.call("recovered", "e0", "-")[0] == b"healthy"
    bar.leave("e1")
    bar.configure()
    bar.scripts.call("lease", "c1", 1000, "acquire")
    bar.scripts.call("new_epoch", "e9")
    bar.scripts.call("report_many", bar.epoch, 1, "e0", "0", "3", "1", "1", "", "", "-", "1")
    assert r.script_exists(*shas) == [True] * len(shas)
    assert stat("evalsha") - evalsha_before >= 2 * len(shas)  # NOSCRIPT, then the retry
    assert stat("eval") == eval_before, "scripts must run through EVALSHA, not EVAL"


def test_functions_on_redis_7_reload_after_the_library_is_gone(
    r: redis.Redis, keys: DeploymentKeys
) -> None:
    """Redis >= 7 runs the operations as one function library through FCALL, and
    loads it again when it is gone (FUNCTION DELETE / FLUSH, a restart without
    persistence); 6.2 has no functions and gets EVALSHA. Same results either way."""

    def stat(cmd: str) -> int:
        return int(r.info("commandstats").get(f"cmdstat_{cmd}", {}).get("calls", 0))

    bar = Barrier(r, keys)
    assert bar.scripts.mode == "probe"
    bar.configure()
    bar.register("e0")
    major = int(text(r.info("server")["redis_version"]).split(".")[0])
    if major < 7:
        assert bar.scripts.mode == "scripts"
        assert bar.report("e0", 1, 1, 1)[0] == "accepted"
        return
    assert bar.scripts.mode == "functions"
    lib = library()[0]
    listed = [dict(zip(x[::2], x[1::2], strict=True)) for x in r.function_list(library=lib)]
    assert [text(x[b"library_name"]) for x in listed] == [lib]
    evalsha_before = stat("evalsha")
    assert bar.report("e0", 1, 1, 1) == ("accepted", 1, 0, 1)
    r.function_delete(lib)
    fcall_before = stat("fcall")
    assert bar.report("e0", 2, 1, 1) == ("accepted", 2, 0, 2)  # Function not found -> load
    assert stat("fcall") - fcall_before == 2  # the miss, then the retry
    assert bar.register("e1") == 1
    bar.reap()
    bar.force("0")
    bar.leave("e1")
    bar.scripts.call("lease", "c1", 1000, "acquire")
    bar.scripts.call("new_epoch", "e9")
    assert stat("evalsha") == evalsha_before, "Redis 7 runs the functions, not EVALSHA"
    assert bar.scripts.mode == "functions"
    # an error raised by the function itself is the caller's, not a reason to reload
    with pytest.raises(redis.ResponseError, match="redisbal: bad waiting"):
        bar.report("e0", 3, -1, 1)
    assert bar.scripts.mode == "functions"
