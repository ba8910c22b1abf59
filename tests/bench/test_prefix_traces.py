"""Traces where placement decides the hit rate (redisbal.bench.prefix_traces, through
scripts/session_trace.py prefixes / agentic): deterministic per seed, no session key
sent, the sizes asked for, and prompt texts that share whole 64-character chunks (the
engines' 16-token blocks) exactly where they share a prefix."""

from __future__ import annotations

import itertools
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import orjson
import pytest

from redisbal.bench.loadgen import request_body
from redisbal.bench.prefix_traces import (
    AgentShape,
    PrefixShape,
    agentic_lines,
    next_prompt_tokens,
    prefix_lines,
)
from redisbal.sim.load_plan import Planned, output_text, read_trace, session_prompts
from redisbal.sim.prefix_cache import BLOCK_TOKENS, text_blocks

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
OPTS = {"model": "m", "stream": True, "ignore_eos": True, "chat": True}


def _shared_blocks(a: str, b: str) -> int:
    n = 0
    for x, y in zip(text_blocks(a), text_blocks(b), strict=False):
        if x != y:
            break
        n += 1
    return n


def _write(tmp: Path, lines: list[dict[str, Any]]) -> list[Planned]:
    """The lines as loadgen replays them: read back from a trace file, prompts built."""
    path = tmp / "t.jsonl"
    path.write_bytes(b"".join(orjson.dumps(d) + b"\n" for d in lines))
    planned = read_trace(str(path))
    session_prompts(planned, seed=1)
    return planned


def _script(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, str(SCRIPTS / "session_trace.py"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)


# -- prefixes ---------------------------------------------------------------------------------


def test_prefix_trace_is_the_same_per_seed_and_sized_as_asked() -> None:
    lines = prefix_lines(40.0, 30.0, seed=3)
    assert lines == prefix_lines(40.0, 30.0, seed=3)
    assert lines != prefix_lines(40.0, 30.0, seed=4)
    assert 1000 < len(lines) < 1400  # Poisson 40/s over 30 s: sd 35
    assert all("key" not in d and "thread" not in d and "user" not in d for d in lines)
    lengths = {d["system"]: d["system_tokens"] for d in lines}
    assert len({(d["system"], d["system_tokens"]) for d in lines}) == len(lengths)  # one each
    assert set(lengths) <= set(range(48)) and len(lengths) >= 40
    assert all(2048 <= n <= 6144 for n in lengths.values())
    suffixes = [d["prompt_tokens"] - d["system_tokens"] for d in lines]
    assert min(suffixes) >= 1 and max(suffixes) <= 8 * 64 + 1
    assert 40 < sum(suffixes) / len(suffixes) < 90  # lognormal, mean 64
    # heavy-tailed popularity: the most asked prefix carries far more than 1/48
    top = Counter(d["system"] for d in lines).most_common(1)[0][1]
    assert top > 0.12 * len(lines)


def test_prefix_popularity_is_zipf_and_uniform_at_zero() -> None:
    flat = Counter(d["system"] for d in prefix_lines(200.0, 30.0, 1, PrefixShape(zipf=0.0)))
    assert max(flat.values()) < 2 * min(flat.values())  # 125 each on average
    steep = Counter(d["system"] for d in prefix_lines(200.0, 30.0, 1, PrefixShape(zipf=1.0)))
    counts = sorted(steep.values(), reverse=True)
    assert counts[0] > 5 * counts[9]  # rank 1 against rank 10: 10x in expectation


def test_prefix_prompts_share_exactly_the_prefixes_whole_blocks(tmp_path: Path) -> None:
    planned = _write(tmp_path, prefix_lines(20.0, 10.0, seed=2))
    by_prefix: dict[int, list[Planned]] = defaultdict(list)
    for p in planned:
        assert p.text is not None and len(p.text) == 4 * p.prompt_tokens
        assert request_body(p, OPTS).keys() == {"model", "max_tokens", "stream", "ignore_eos",
                                                "messages"}  # fmt: skip
        assert p.system is not None
        by_prefix[p.system].append(p)
    pairs = [ps[:2] for ps in by_prefix.values() if len(ps) >= 2]
    assert len(pairs) >= 5
    for a, b in pairs:
        assert a.text is not None and b.text is not None
        assert _shared_blocks(a.text, b.text) == a.system_tokens // BLOCK_TOKENS
    ks = sorted(by_prefix)
    one, other = by_prefix[ks[0]][0].text, by_prefix[ks[1]][0].text
    assert one is not None and other is not None and _shared_blocks(one, other) == 0


# -- agentic ----------------------------------------------------------------------------------


def test_agentic_trace_is_the_same_per_seed_and_sized_as_asked() -> None:
    shape = AgentShape()
    lines = agentic_lines(4.0, 30.0, seed=5)
    assert lines == agentic_lines(4.0, 30.0, seed=5)
    assert lines != agentic_lines(4.0, 30.0, seed=6)
    assert all("key" not in d and "user" not in d for d in lines)
    assert [d["t"] for d in lines] == sorted(d["t"] for d in lines)
    calls: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for d in lines:
        calls[str(d["thread"])].append(d)
    assert 80 < len(calls) < 160  # Poisson 4/s over 30 s: sd 11
    turns = [len(c) for c in calls.values()]
    assert max(turns) <= shape.turns_max and 4 < sum(turns) / len(turns) < 8
    grown = 0
    for chain in calls.values():
        first = chain[0]
        assert first["prompt_tokens"] > first["system_tokens"]
        for prev, nxt in itertools.pairwise(chain):
            assert prev["system"] == nxt["system"]
            history = next_prompt_tokens(prev["prompt_tokens"], prev["output_tokens"], 0)
            assert shape.tool_range[0] <= nxt["prompt_tokens"] - history <= shape.tool_range[1]
            assert nxt["t"] > prev["t"]
            grown += 1
        assert all(d["prompt_tokens"] <= shape.max_prompt for d in chain)
    assert grown > 200


def test_agentic_calls_resend_the_history_and_send_no_user(tmp_path: Path) -> None:
    lines = agentic_lines(3.0, 10.0, seed=1)
    planned = _write(tmp_path, lines)
    chains: dict[str, list[Planned]] = defaultdict(list)
    for p in planned:
        assert p.key is None and p.thread is not None
        assert "user" not in request_body(p, OPTS)
        chains[p.thread].append(p)
    checked = 0
    for chain in chains.values():
        for prev, nxt in itertools.pairwise(chain):
            assert prev.text is not None and nxt.text is not None
            history = prev.text + output_text(prev.output_tokens)
            assert nxt.text.startswith(history)  # the whole history, then the tool result
            # the engine cached the previous call's prompt and answer: all of it hits
            assert _shared_blocks(history, nxt.text) == len(text_blocks(history))
            checked += 1
    assert checked > 50
    # two agents on one scaffold share its whole blocks and nothing past them
    firsts: dict[int, list[Planned]] = defaultdict(list)
    for chain in chains.values():
        assert chain[0].system is not None
        firsts[chain[0].system].append(chain[0])
    a, b = next(ps[:2] for ps in firsts.values() if len(ps) >= 2)
    assert a.text is not None and b.text is not None
    assert _shared_blocks(a.text, b.text) == a.system_tokens // BLOCK_TOKENS


def test_next_prompt_counts_the_answer_text_the_engines_stream() -> None:
    assert next_prompt_tokens(100, 0, 50) == 150
    assert next_prompt_tokens(100, 3, 0) == 100 + -(-len(output_text(3)) // 4)
    assert next_prompt_tokens(100, 20, 7) * 4 >= 400 + len(output_text(20)) + 28


# -- at the boundary --------------------------------------------------------------------------


def test_trace_lines_with_a_key_and_a_thread_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    line = {"t": 0, "prompt_tokens": 5, "output_tokens": 1, "key": "a", "thread": "a"}
    path.write_bytes(orjson.dumps(line) + b"\n")
    with pytest.raises(Exception, match=r"bad\.jsonl:1: a line has a key or a thread, not both"):
        read_trace(str(path))
    path.write_bytes(orjson.dumps(line | {"key": None, "thread": 7}) + b"\n")
    with pytest.raises(Exception, match="thread must be a string"):
        read_trace(str(path))


@pytest.mark.parametrize(
    ("shape", "words"),
    [
        (PrefixShape(prefixes=0), "--prefixes 0"),
        (PrefixShape(prefix_range=(3000, 2000)), "--prefix-min 3000"),
        (PrefixShape(zipf=-1), "--zipf"),
        (AgentShape(turns_mean=20), "--turns-mean"),
        (AgentShape(tool_range=(500, 100)), "--tool-min"),
        (AgentShape(max_prompt=1000), "--max-prompt"),
    ],
)
def test_bad_shapes_are_one_line_errors(shape: PrefixShape | AgentShape, words: str) -> None:
    make = prefix_lines if isinstance(shape, PrefixShape) else agentic_lines
    with pytest.raises(ValueError, match=words) as err:
        make(1.0, 1.0, 1, shape)  # type: ignore[arg-type]
    assert "\n" not in str(err.value)


def test_script_writes_both_traces_and_says_bad_options_in_one_line(tmp_path: Path) -> None:
    for kind, rate in (("prefixes", "10"), ("agentic", "2")):
        out = tmp_path / f"{kind}.jsonl"
        got = _script(kind, "--rate", rate, "--duration", "5", "--seed", "2", "-o", str(out))
        assert got.returncode == 0, got.stderr
        assert "0 keys" in got.stderr
        again = _script(kind, "--rate", rate, "--duration", "5", "--seed", "2")
        assert again.stdout.encode() == out.read_bytes()  # the same file for every policy
        assert read_trace(str(out))
    bad = _script("agentic", "--rate", "2", "--tool-min", "900", "--tool-max", "100")
    assert bad.returncode == 2 and "agentic: --tool-min/--tool-max" in bad.stderr
    assert "Traceback" not in bad.stderr
