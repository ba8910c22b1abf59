"""The cache view's hashes and matching (pure logic)."""

from __future__ import annotations

import pytest

from redisbal.errors import InvalidArgument
from redisbal.routing.cache_view import (
    SIM_VOCAB,
    CacheView,
    anchors,
    chain_hashes,
    pack_hashes,
    prompt_text,
    sim_token_ids,
    unpack_hashes,
)


def test_chain_hashes_cover_every_token_before_them() -> None:
    a = chain_hashes(list(range(64)))
    b = chain_hashes(list(range(48)) + [7] * 16)
    assert len(a) == 4 and a[:3] == b[:3] and a[3] != b[3]
    c = chain_hashes([1, *range(1, 64)])
    assert all(x != y for x, y in zip(a, c, strict=True))  # block 0 differs: all differ


def test_chain_continues_from_a_parent() -> None:
    whole = chain_hashes(list(range(64)))
    tail = chain_hashes(list(range(32, 64)), parent=whole[1])
    assert tail == whole[2:]


def test_partial_blocks_have_no_hash_and_bad_ids_are_refused() -> None:
    assert chain_hashes(list(range(15))) == []
    assert len(chain_hashes(list(range(31)))) == 1
    with pytest.raises(InvalidArgument):
        chain_hashes([-1] * 16)
    with pytest.raises(InvalidArgument):
        chain_hashes([1] * 16, block_size=0)


def test_anchors_and_matching() -> None:
    hashes = chain_hashes(list(range(16 * 12)))
    req = anchors(hashes)
    assert req == [hashes[3], hashes[7], hashes[11]]
    view = CacheView()
    assert view.matched_blocks("e0", req) == 0
    view.apply("e0", added=[hashes[3], hashes[7]])
    assert view.matched_blocks("e0", req) == 8
    view.apply("e0", removed=[hashes[7]])
    assert view.matched_blocks("e0", req) == 4
    view.apply("e0", added=[hashes[11]], cleared=True)
    assert view.engines["e0"] == {hashes[11]}
    view.replace("e1", [hashes[3]])
    view.drop("e0")
    assert view.matched_blocks("e0", req) == 0 and view.matched_blocks("e1", req) == 4


def test_holders_follow_every_change() -> None:
    """The inverse map (anchor -> engines) says what the per-engine sets say, after
    adds, removals, clears, replacements and drops."""
    view = CacheView()
    view.apply("e0", added=[1, 2, 3])
    view.apply("e1", added=[2, 3, 4])
    view.apply("e0", added=[5], removed=[1, 9])
    view.replace("e1", [3, 6])
    view.apply("e2", added=[6, 7])
    view.apply("e2", added=[8], cleared=True)
    view.drop("e0")
    view.drop("nobody")
    want: dict[int, set[str]] = {}
    for eid, held in view.engines.items():
        for a in held:
            want.setdefault(a, set()).add(eid)
    assert view.holders == want == {3: {"e1"}, 6: {"e1"}, 8: {"e2"}}


def test_packed_hashes_round_trip() -> None:
    hashes = chain_hashes(list(range(16 * 5)))
    data = pack_hashes(hashes)
    assert len(data) == 40 and unpack_hashes(data) == hashes
    assert unpack_hashes(data + b"\x01\x02") == hashes


def test_sim_token_ids_are_a_prefix_preserving_4_character_tokenization() -> None:
    a = sim_token_ids("abcdefgh" * 10)
    b = sim_token_ids("abcdefgh" * 10 + "more text here")
    assert len(a) == 20
    assert b[: len(a)] == a and len(b) == 23
    assert len(sim_token_ids("")) == 1 and len(sim_token_ids("ab")) == 1
    assert all(0 <= t < SIM_VOCAB for t in b)
    assert sim_token_ids("abcd") != sim_token_ids("abce")


def test_prompt_text_is_the_prompt_or_the_messages_contents_in_turn() -> None:
    assert prompt_text({"prompt": "hello"}, chat=False) == "hello"
    assert prompt_text({"prompt": ["ab", "cd"]}, chat=False) == "abcd"
    turns = [{"role": "system", "content": "be brief. "}, {"role": "user", "content": "hi"}]
    assert prompt_text({"messages": turns}, chat=True) == "be brief. hi"
    longer = prompt_text({"messages": [*turns, {"role": "assistant", "content": "yo"}]}, True)
    assert longer.startswith(prompt_text({"messages": turns}, chat=True))
    assert prompt_text({"messages": "nonsense"}, chat=True) == ""
