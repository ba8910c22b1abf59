"""A simulated engine's prefix cache: block hashes with LRU eviction.

An engine with automatic prefix caching (vLLM's, SGLang's radix cache) keeps the
KV blocks of prompts it has computed and reuses them for a later prompt that
starts with the same tokens. Blocks are identified by chained hashes (a block's
hash covers every token before it), so the reusable part of a prompt is the
longest run of its leading blocks found in the cache. The model: a bounded
number of blocks, least recently used out first; a hit refreshes the blocks it
used. Blocks of running requests are not pinned (a simplification: a real
engine cannot evict a block in use; with capacity near the KV size the blocks
evicted first are the idle ones anyway).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

from redisbal.errors import InvalidArgument
from redisbal.routing.cache_view import BLOCK_TOKENS, CHARS_PER_TOKEN


class PrefixCache:
    """Bounded LRU set of block hashes."""

    __slots__ = ("blocks", "capacity")

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise InvalidArgument(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        self.capacity = capacity_blocks
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self.blocks)

    def __contains__(self, block: int) -> bool:
        return block in self.blocks

    def match(self, blocks: Sequence[int]) -> int:
        """How many leading blocks of ``blocks`` are cached (the longest cached prefix);
        the blocks matched become the most recently used."""
        cached = self.blocks
        n = 0
        for b in blocks:
            if b not in cached:
                break
            n += 1
        for b in blocks[:n]:
            cached.move_to_end(b)
        return n

    def insert(self, blocks: Sequence[int]) -> None:
        """Add (or refresh) ``blocks``, evicting the least recently used beyond capacity."""
        cached = self.blocks
        for b in blocks:
            if b in cached:
                cached.move_to_end(b)
            else:
                cached[b] = None
        while len(cached) > self.capacity:
            cached.popitem(last=False)


_BLOCK_CHARS = CHARS_PER_TOKEN * BLOCK_TOKENS


def text_blocks(text: str) -> tuple[int, ...]:
    """Chained hashes of the full 16-token blocks of a prompt's text, a token being
    4 characters (the HTTP engines count prompt tokens as characters / 4): two texts
    share exactly as many leading blocks as they share whole 64-character chunks of
    prefix, as the simulator's token streams do. blake2b, so every process (engine,
    gateway, test) gets the same hashes."""
    out = []
    h = b""
    for i in range(len(text) // _BLOCK_CHARS):
        chunk = text[i * _BLOCK_CHARS : (i + 1) * _BLOCK_CHARS].encode("utf-8", "surrogatepass")
        h = hashlib.blake2b(h + chunk, digest_size=8).digest()
        out.append(int.from_bytes(h, "big", signed=True))
    return tuple(out)
