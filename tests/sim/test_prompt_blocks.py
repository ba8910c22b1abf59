"""Prompt text to prefix-cache blocks (the HTTP engines' tokens), and loadgen's
conversation-shaped prompts that share their history."""

from __future__ import annotations

import subprocess
import sys

from redisbal.sim.load_plan import Planned, output_text, session_prompts
from redisbal.sim.prefix_cache import text_blocks


def test_a_shared_text_prefix_shares_exactly_its_whole_blocks() -> None:
    head = "abcd" * 160  # 160 tokens of 4 characters: 10 blocks of 16
    a = text_blocks(head + "x" * 200)
    b = text_blocks(head + "y" * 200)
    assert len(a) == len(b) == (640 + 200) // 64
    assert a[:10] == b[:10]
    assert not set(a[10:]) & set(b[10:])  # chained: nothing after the first difference


def test_blocks_are_chained_and_only_whole_blocks_count() -> None:
    block = "q" * 64
    assert text_blocks(block * 3)[0] == text_blocks(block)[0]
    assert len(set(text_blocks(block * 3))) == 3  # equal chunks, different positions
    assert text_blocks("q" * 63) == ()
    assert text_blocks("z" + block * 2)[:1] != text_blocks(block * 2)[:1]


def test_blocks_are_the_same_in_another_process() -> None:
    text = "some prompt text " * 50
    code = f"from redisbal.sim.prefix_cache import text_blocks;print(list(text_blocks({text!r})))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(list(text_blocks(text)))


def test_session_prompts_repeat_the_history_and_share_system_prompts() -> None:
    planned = [
        Planned(0.0, 300, 5, "a", system=1, system_tokens=100),
        Planned(0.1, 200, 3, "b", system=1, system_tokens=100),
        Planned(0.2, 50, 4, None),
        Planned(1.0, 420, 7, "a", system=1, system_tokens=100),
    ]
    session_prompts(planned, seed=3)
    a1, b1, solo, a2 = (p.text for p in planned)
    assert a1 is not None and b1 is not None and solo is not None and a2 is not None
    assert [len(t) for t in (a1, b1, solo, a2)] == [1200, 800, 200, 1680]
    assert a1[:400] == b1[:400] and a1[400:420] != b1[400:420]  # the system prompt only
    assert a2.startswith(a1 + output_text(5))  # history: the prompt and its answer
    again = [Planned(p.t, p.prompt_tokens, p.output_tokens, p.key, p.system, p.system_tokens)
             for p in planned]  # fmt: skip
    session_prompts(again, seed=3)
    assert [p.text for p in again] == [a1, b1, solo, a2]  # the same for every policy
    session_prompts(again, seed=4)
    assert again[0].text != a1 and again[0].text is not None and again[0].text[:400] == a1[:400]
