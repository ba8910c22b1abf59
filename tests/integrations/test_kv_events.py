"""vLLM's KV-event wire format and one engine's tracker (pure logic)."""

from __future__ import annotations

import struct

import msgpack
import pytest

from redisbal.errors import InvalidArgument, InvalidName, MalformedData
from redisbal.integrations.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineTracker,
    EventBatch,
    decode_batch,
    decode_message,
    encode_message,
    make_sources,
)
from redisbal.routing.cache_view import anchors, chain_hashes

TOKENS = list(range(1000, 1000 + 16 * 12))  # 12 blocks of 16


def stored(hashes: list[int], parent: int | None, first_block: int) -> BlockStored:
    n = len(hashes)
    return BlockStored(hashes, parent, TOKENS[first_block * 16 : (first_block + n) * 16], 16)


def batch(*events: object) -> EventBatch:
    return EventBatch(1.5, list(events), 0)  # type: ignore[arg-type]


# -- the wire format ---------------------------------------------------------------------------


def test_a_batch_round_trips() -> None:
    b = EventBatch(
        12.25,
        [
            BlockStored([1, b"\x02" * 32], None, list(range(32)), 16, None, "GPU"),
            BlockRemoved([7, 8], "GPU"),
            AllBlocksCleared(),
        ],
        3,
    )
    frames = encode_message(b"kv-events", 41, b)
    assert frames[0] == b"kv-events" and frames[1] == (41).to_bytes(8, "big")
    seq, got = decode_message(frames)
    assert seq == 41 and got == b


def test_a_message_laid_out_as_vllm_sends_it() -> None:
    """Built by hand from the documented layout, with the fields newer releases append
    (lora_name, extra_keys) and a BlockRemoved's group index: they are ignored."""
    tokens = list(range(16))
    payload = msgpack.packb(
        [
            1733.5,
            [
                ["BlockStored", [-5, 9], None, tokens * 2, 16, None, "GPU", None, [None, None]],
                ["BlockRemoved", [-5], "GPU", 0],
                ["AllBlocksCleared"],
                ["SomethingNew", 1, 2],
            ],
            0,
        ]
    )
    seq, b = decode_message([b"", struct.pack(">q", 7), payload])
    assert seq == 7 and b.data_parallel_rank == 0 and b.unknown == 1
    assert b.events == [
        BlockStored([-5, 9], None, tokens * 2, 16, None, "GPU"),
        BlockRemoved([-5], "GPU"),
        AllBlocksCleared(),
    ]


def test_the_map_layout_is_read_too() -> None:
    payload = msgpack.packb(
        {
            "ts": 1.0,
            "events": [
                {
                    "type": "BlockStored",
                    "block_hashes": [b"\x01" * 32],
                    "parent_block_hash": None,
                    "token_ids": list(range(16)),
                    "block_size": 16,
                    "lora_id": None,
                    "medium": "GPU",
                },
                {"type": "BlockRemoved", "block_hashes": [b"\x01" * 32], "medium": "GPU"},
            ],
        }
    )
    b = decode_batch(payload)
    assert [type(e).__name__ for e in b.events] == ["BlockStored", "BlockRemoved"]
    assert b.data_parallel_rank is None


@pytest.mark.parametrize(
    "frames",
    [
        [b"", b"\x00" * 8],  # two frames
        [b"", b"\x00" * 4, msgpack.packb([1.0, []])],  # a short seq
        [b"", b"\x00" * 8, b"\xc1"],  # not msgpack
        [b"", b"\x00" * 8, msgpack.packb("hello")],
        [b"", b"\x00" * 8, msgpack.packb([1.0, [["BlockStored", [1], None, [1, 2], 16]]])],
        [b"", b"\x00" * 8, msgpack.packb([1.0, [["BlockStored", ["x"], None, [], 16]]])],
        [b"", b"\x00" * 8, msgpack.packb([1.0, [["BlockRemoved", None]]])],
        [b"", b"\x00" * 8, msgpack.packb([1.0, [42]])],
    ],
)
def test_malformed_messages_raise_one_error_kind(frames: list[bytes]) -> None:
    with pytest.raises(MalformedData):
        decode_message(frames)


# -- the tracker -------------------------------------------------------------------------------


def own(n: int) -> list[int]:
    return chain_hashes(TOKENS[: n * 16])


def test_stored_blocks_are_named_by_their_tokens_and_anchored() -> None:
    t = EngineTracker("e0")
    t.apply(batch(stored([101, 102, 103], None, 0), stored([104, 105, 106, 107, 108], 103, 3)))
    d = t.take()
    assert d is not None and d.cleared  # a new tracker knows nothing: cleared first
    assert d.added == set(anchors(own(8))) and len(d.added) == 2
    assert t.take() is None


def test_an_engine_block_may_hold_several_of_ours() -> None:
    t = EngineTracker("e0", block_size=16)
    t.apply(batch(BlockStored([1, 2], None, TOKENS[: 4 * 32], 64)))  # 2 blocks of 64 tokens
    assert set(t.anchors) == set(anchors(own(8)))
    bad = EngineTracker("e1", block_size=48)  # 64 is no multiple of 48: skipped
    bad.apply(batch(BlockStored([1, 2], None, TOKENS[: 4 * 32], 64)))
    assert not bad.anchors and bad.stats.skipped == 2


def test_an_unknown_parent_skips_the_blocks_and_their_children() -> None:
    t = EngineTracker("e0")
    t.take()
    t.apply(batch(stored([104, 105, 106, 107], 103, 3), stored([108], 107, 7)))
    assert not t.anchors and t.take() is None and t.stats.skipped == 5


def test_a_removed_block_takes_its_descendants_along() -> None:
    t = EngineTracker("e0")
    t.apply(batch(stored([101, 102, 103, 104, 105, 106, 107, 108], None, 0)))
    t.take()
    t.apply(batch(BlockRemoved([106], "GPU")))
    d = t.take()
    assert d is not None and d.removed == {own(8)[7]} and not d.added  # block 8's anchor
    t.apply(batch(BlockRemoved([101], "GPU")))  # the root: every block below it goes
    d = t.take()
    assert d is not None and d.removed == {own(4)[3]} and not t.blocks and not t.anchors


def test_stored_again_is_not_counted_twice() -> None:
    t = EngineTracker("e0")
    t.apply(batch(stored([101, 102, 103, 104], None, 0)))
    t.apply(batch(stored([101, 102, 103, 104], None, 0)))
    t.apply(batch(BlockRemoved([104], "GPU")))
    assert not t.anchors


def test_two_engine_blocks_with_one_name_hold_it_until_both_go() -> None:
    """The engine's hashes may differ where ours agree (extra keys, a salt)."""
    t = EngineTracker("e0")
    t.apply(batch(stored([1, 2, 3, 4], None, 0), stored([11, 12, 13, 14], None, 0)))
    assert len(t.anchors) == 1
    t.apply(batch(BlockRemoved([4], "GPU")))
    assert len(t.anchors) == 1
    t.apply(batch(BlockRemoved([14], "GPU")))
    assert not t.anchors


def test_other_media_and_lora_blocks_are_not_ours() -> None:
    t = EngineTracker("e0")
    t.apply(batch(BlockStored([1, 2, 3, 4], None, TOKENS[:64], 16, None, "CPU")))
    t.apply(batch(BlockStored([1, 2, 3, 4], None, TOKENS[:64], 16, 3, "GPU")))
    assert not t.anchors and t.stats.skipped == 8
    t.apply(batch(stored([1, 2, 3, 4], None, 0), BlockRemoved([1], "CPU")))
    assert len(t.anchors) == 1  # the GPU copy stays


def test_all_blocks_cleared_clears_the_view() -> None:
    t = EngineTracker("e0")
    t.apply(batch(stored([1, 2, 3, 4], None, 0)))
    t.take()
    t.apply(batch(AllBlocksCleared(), stored([11, 12, 13, 14, 15, 16, 17, 18], None, 0)))
    d = t.take()
    assert d is not None and d.cleared and d.added == set(anchors(own(8)))


def test_sequence_numbers_tell_gaps_and_restarts() -> None:
    t = EngineTracker("e0")
    assert [t.check_seq(s) for s in (5, 6, 7, 9, 10, 0, 1)] == [
        "first",
        "next",
        "next",
        "gap",
        "next",
        "restart",
        "next",
    ]


def test_anchors_are_bounded_oldest_stored_first() -> None:
    t = EngineTracker("e0", max_anchors=2)
    t.apply(batch(stored(list(range(1, 13)), None, 0)))  # 3 anchors
    assert list(t.anchors) == anchors(own(12))[1:]
    d = t.take()
    assert d is not None and d.added == set(anchors(own(12))[1:])
    t.apply(batch(BlockRemoved([4], "GPU")))  # the dropped anchor's block: nothing to say
    d = t.take()
    assert d is not None and d.removed == set(anchors(own(12))[1:]) and not t.anchors


def test_bad_sources_are_refused_with_one_line() -> None:
    assert make_sources(["e0=tcp://h:5557"], ["e0=tcp://h:5558"])[0].replay == "tcp://h:5558"
    for bad in (["e0"], ["e0=http://h:1"], ["e0=tcp://h"], ["e0=tcp://*:5557"], ["e0=x", "e0=y"]):
        with pytest.raises(InvalidArgument):
            make_sources(bad)
    with pytest.raises(InvalidName):
        make_sources(["e 0=tcp://h:5557"])
    with pytest.raises(InvalidArgument, match="no --source"):
        make_sources(["e0=tcp://h:5557"], ["e1=tcp://h:5558"])
