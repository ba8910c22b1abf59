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


def holders_of(view: CacheView) -> dict[int, set[str]]:
    """The inverse map as the per-engine sets say it should be."""
    want: dict[int, set[str]] = {}
    for eid, held in view.engines.items():
        for a in held:
            want.setdefault(a, set()).add(eid)
    return want


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
    assert view.holders == holders_of(view) == {3: {"e1"}, 6: {"e1"}, 8: {"e2"}}


def test_a_router_learns_its_routes_least_recently_routed_forgotten() -> None:
    """Without a told view, an engine holds the anchors of the requests routed to it, as
    far as the router knows; past ``learn`` anchors the least recently routed go."""
    a = chain_hashes(list(range(16 * 8)))  # two anchors: a[3], a[7]
    b = chain_hashes([5] * 16 * 4)  # one: b[3]
    c = chain_hashes([9] * 16 * 4)
    view = CacheView(learn=3)
    view.learn_route("e0", a[:2])  # no whole anchor: nothing learned
    assert view.engines == {} and view.holders == {}
    view.learn_route("e0", a)
    view.learn_route("e1", a[:4])
    assert view.matched_blocks("e0", anchors(a)) == 8
    assert view.matched_blocks("e1", anchors(a)) == 4
    view.learn_route("e0", b)
    view.learn_route("e0", a[:4])  # a[3] routed again: now the most recent
    view.learn_route("e0", c)  # a fourth anchor: the least recently routed (a[7]) goes
    assert view.engines["e0"] == {a[3], b[3], c[3]}
    assert view.matched_blocks("e0", anchors(a)) == 4
    assert view.holders == holders_of(view)
    assert view.holders[a[3]] == {"e0", "e1"} and a[7] not in view.holders
    # a chain is forgotten from its leaves, as engines evict: its root is kept longest
    short = CacheView(learn=1)
    short.learn_route("e0", a)
    assert short.engines["e0"] == {a[3]}


def test_an_engines_own_word_replaces_what_was_learned_of_it() -> None:
    a = chain_hashes(list(range(16 * 8)))
    view = CacheView(learn=100)
    view.learn_route("e0", a)
    view.learn_route("e1", a)
    assert view.learning(["e0", "e1"])
    view.replace("e0", [a[3]])  # its KV events: it holds the first anchor only
    assert view.learning(["e0", "e1"]) and not view.learning(["e0"])
    view.learn_route("e0", a)  # a told engine is not learned
    assert view.engines["e0"] == {a[3]}
    view.apply("e1", added=[99])  # a first change told of e1: the learned view goes
    assert view.engines["e1"] == {99} and view.told == {"e0", "e1"}
    view.drop("e0")  # its told view expired: learned again from here
    view.learn_route("e0", a[:4])
    assert view.engines["e0"] == {a[3]} and view.told == {"e1"}
    view.learn_route("e2", a)
    view.drop_told()  # the reader reads every told view again: learned views stay
    assert set(view.engines) == {"e0", "e2"}
    view.keep_learned({"e2"})  # e0 left the deployment
    assert set(view.engines) == {"e2"}
    assert view.holders == holders_of(view)


def test_learning_is_off_by_default_and_its_bound_is_checked() -> None:
    view = CacheView()
    view.learn_route("e0", chain_hashes(list(range(64))))
    assert view.engines == {} and not view.learning(["e0"])
    for bad in (-1, 1.5, True, "8"):
        with pytest.raises(InvalidArgument, match="learn must be"):
            CacheView(learn=bad)  # type: ignore[arg-type]


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
