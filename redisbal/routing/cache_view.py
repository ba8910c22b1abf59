"""What the engines cache, as every router sees it: chained block hashes and anchors.

An engine with prefix caching (vLLM's automatic prefix caching, SGLang's radix cache)
keeps the KV blocks of prompts it computed and reuses them for a later prompt that
starts with the same tokens. vLLM tells what it caches in KV events (BlockStored,
BlockRemoved, AllBlocksCleared), each stored block with its token ids. Its own block
hashes depend on its configuration and seed, so nothing outside the engine can make
them: the events are read beside the engine, and each stored block is named anew by
:func:`chain_hashes` over its token ids. A router names a request's blocks the same
way from the request's tokens, so the two meet without the engine's hash function.

To keep the view small, only every ``ANCHOR_STRIDE``-th block of a chain is kept (its
*anchors*): a prompt's match with an engine is its deepest anchor the engine holds,
so the view is exact to ``ANCHOR_STRIDE x block_size`` tokens and a fraction of the
size. A block hash covers every token before it, so holding an anchor means having
held the whole prefix up to it (an engine that evicted a block in the middle of a
chain but kept its tail is read as holding the prefix: an overestimate the engines'
leaf-first eviction makes rare).

This module is pure (no I/O): the one home of the hashes and of the view's record
format. The events are read and the view written beside the engines by
``redisbal.integrations.kv_events``; routers read it back (docs/DESIGN.md).
"""

from __future__ import annotations

import hashlib
import itertools
import struct
import zlib
from collections.abc import Container, Iterable, Mapping, Sequence
from typing import Any

from redisbal.errors import InvalidArgument

BLOCK_TOKENS = 16  # tokens per KV block: vLLM's default block size
ANCHOR_STRIDE = 4  # every 4th block of a chain is an anchor: the view is exact to 64 tokens
ROOT = b"\x00" * 8  # the parent of a chain's first block
# engine-sim's tokenizer (``sim_token_ids``): one token is this many characters of text;
# also the gateway's estimate of a prompt's size without a tokenizer (English text)
CHARS_PER_TOKEN = 4
SIM_VOCAB = 131072  # engine-sim's token ids are below this (a real vocabulary's size)
# what a router learns of an engine's cache from its routes by default (the gateway's
# --prefix-cache-tokens): 512k tokens, a large GPU's KV cache
LEARNED_TOKENS = 1 << 19


def learned_anchors(tokens: int) -> int:
    """Anchors a router learns per engine to remember ``tokens`` of its prompts."""
    return -(-tokens // (ANCHOR_STRIDE * BLOCK_TOKENS))


def sim_token_ids(text: str) -> list[int]:
    """engine-sim's token ids of ``text``: one per ``CHARS_PER_TOKEN`` characters (at
    least one), each ``crc32(chunk) % SIM_VOCAB``. The same text gives the same ids and
    two prompts sharing a prefix share its ids, as with a real tokenizer; a router
    hashes a request's blocks from them as the simulated engines name theirs."""
    c = CHARS_PER_TOKEN
    n = max(1, len(text) // c)
    crc32 = zlib.crc32
    data = text.encode("utf-8", "surrogatepass")
    if len(data) == len(text):  # ASCII: a character is a byte, and bytes slice faster
        return [crc32(data[i : i + c]) % SIM_VOCAB for i in range(0, n * c, c)]
    return [crc32(text[i * c : (i + 1) * c].encode()) % SIM_VOCAB for i in range(n)]


def prompt_text(body: Mapping[str, Any], chat: bool) -> str:
    """A request body's prompt as one text, as engine-sim reads it: the completions
    ``prompt`` (a list's items joined), or the chat ``messages``' contents one after
    the other (no chat template: a conversation's next turn starts with the previous
    one)."""
    if chat:
        msgs = body.get("messages") or []
        return "".join(str(m.get("content", "")) for m in msgs if isinstance(m, dict))
    p = body.get("prompt", "")
    return "".join(str(x) for x in p) if isinstance(p, list) else str(p)


def chain_hashes(
    token_ids: Sequence[int], block_size: int = BLOCK_TOKENS, parent: int | None = None
) -> list[int]:
    """Chained hashes of the full blocks of ``token_ids``: block i's hash covers its
    tokens and the hash of block i-1 (``parent`` for the first, or the root), 64-bit
    unsigned, blake2b, so every process makes the same. A partial last block has none
    (engines cache full blocks only)."""
    if block_size < 1:
        raise InvalidArgument(f"block_size must be >= 1, got {block_size}")
    out: list[int] = []
    h = ROOT if parent is None else parent.to_bytes(8, "big")
    full = len(token_ids) // block_size
    pack = struct.Struct(f"<{block_size}I").pack
    try:
        for i in range(full):
            block = pack(*token_ids[i * block_size : (i + 1) * block_size])
            h = hashlib.blake2b(h + block, digest_size=8).digest()
            out.append(int.from_bytes(h, "big"))
    except struct.error as exc:
        raise InvalidArgument(f"token ids must be whole numbers in [0, 2**32): {exc}") from None
    return out


def text_hashes(text: str, parent: int | None = None) -> list[int]:
    """Chained hashes of the whole blocks of ``text`` itself, a block being as many
    characters as a block of engine-sim's tokens (64): for a router that matches
    prompts with its own routes, where any name of a prompt's text serves, at a
    fraction of tokenizing it. They match no engine's KV events."""
    c = BLOCK_TOKENS * CHARS_PER_TOKEN
    out: list[int] = []
    h = ROOT if parent is None else parent.to_bytes(8, "big")
    for i in range(len(text) // c):
        chunk = text[i * c : (i + 1) * c].encode("utf-8", "surrogatepass")
        h = hashlib.blake2b(h + chunk, digest_size=8).digest()
        out.append(int.from_bytes(h, "big"))
    return out


def is_anchor(depth: int, stride: int = ANCHOR_STRIDE) -> bool:
    """Whether the block at ``depth`` (1 = a chain's first block) is an anchor."""
    return depth % stride == 0


def anchors(hashes: Sequence[int], stride: int = ANCHOR_STRIDE) -> list[int]:
    """The anchors of a chain given as its blocks' hashes, shallowest first."""
    return list(hashes[stride - 1 :: stride])


class CacheView:
    """Every engine's anchors, as one router holds them: engine id -> set of anchors,
    and its inverse, anchor -> the engines holding it (``holders``), so that a router
    finds who holds a request's prefix in a few lookups whatever the number of engines.

    Two sources, one per engine, the engine's own word first:

    - *told*: what the engine's KV events say it holds, filled from Redis by the
      router's reader through ``replace``, ``apply`` and ``drop``;
    - *learned*: without such a view, the anchors of the requests this router sent
      it (``learn``, when ``learn`` > 0 anchors per engine): a model of its cache, as
      the peers' cache-aware routers keep, the least recently routed forgotten past
      ``learn`` anchors. An engine's first told view replaces what was learned of it.

    ``matched_blocks`` answers how much of a request's prefix an engine holds. Change
    the sets only through these methods: they keep both maps in step."""

    __slots__ = ("engines", "holders", "learn", "learned", "stride", "told")

    def __init__(self, stride: int = ANCHOR_STRIDE, learn: int = 0) -> None:
        if isinstance(learn, bool) or not isinstance(learn, int) or learn < 0:
            raise InvalidArgument(f"learn must be a whole number >= 0, got {learn!r}")
        self.stride = stride
        self.learn = learn
        self.engines: dict[str, set[int]] = {}
        self.holders: dict[int, set[str]] = {}
        self.told: set[str] = set()  # engines whose view came from their KV events
        # per engine not told: its learned anchors, least recently routed first
        self.learned: dict[str, dict[int, None]] = {}

    def _unhold(self, engine_id: str, gone: Iterable[int]) -> None:
        holders = self.holders
        for a in gone:
            ids = holders.get(a)
            if ids is not None:
                ids.discard(engine_id)
                if not ids:
                    del holders[a]

    def _hold(self, engine_id: str, new: Iterable[int]) -> None:
        holders = self.holders
        for a in new:
            ids = holders.get(a)
            if ids is None:
                holders[a] = {engine_id}
            else:
                ids.add(engine_id)

    def replace(self, engine_id: str, held: Iterable[int]) -> None:
        """Set an engine's anchors (a full record read from Redis)."""
        self.drop(engine_id)
        self.told.add(engine_id)
        new = self.engines[engine_id] = set(held)
        self._hold(engine_id, new)

    def apply(
        self,
        engine_id: str,
        added: Iterable[int] = (),
        removed: Iterable[int] = (),
        cleared: bool = False,
    ) -> None:
        """Apply one change an engine made (in the order it made them): ``cleared``
        first, then ``removed``, then ``added``."""
        if cleared or engine_id not in self.told:  # (what was learned of it goes)
            self.drop(engine_id)
            self.told.add(engine_id)
        held = self.engines.get(engine_id)
        if held is None:
            held = self.engines[engine_id] = set()
        gone = held.intersection(removed)
        held.difference_update(gone)
        self._unhold(engine_id, gone)
        new = set(added).difference(held)
        held.update(new)
        self._hold(engine_id, new)

    def drop(self, engine_id: str) -> None:
        """Forget an engine (it left the deployment, or its told view expired)."""
        self.told.discard(engine_id)
        self.learned.pop(engine_id, None)
        held = self.engines.pop(engine_id, None)
        if held:
            self._unhold(engine_id, held)

    def drop_told(self) -> None:
        """Forget every told view (the reader reads them all again)."""
        for engine_id in list(self.told):
            self.drop(engine_id)

    def learning(self, engine_ids: Iterable[str]) -> bool:
        """Whether a route to one of ``engine_ids`` may be learned: learning is on and
        some of them has no told view (else prompts need hashing only as deep as a
        told view holds)."""
        return bool(self.learn) and not self.told.issuperset(engine_ids)

    def keep_learned(self, engine_ids: Container[str]) -> None:
        """Forget what was learned of engines not in ``engine_ids`` (they left)."""
        for engine_id in [e for e in self.learned if e not in engine_ids]:
            self.drop(engine_id)

    def learn_route(self, engine_id: str, blocks: Sequence[int]) -> list[int]:
        """This router sent ``engine_id`` a request whose prompt's leading block hashes
        are ``blocks``: the engine will hold its anchors, as far as this router knows.
        Returns the anchors learned (root first; what the other routers are told), none
        while learning is off or the engine's own view is told."""
        if not self.learn or engine_id in self.told:
            return []
        req = anchors(blocks, self.stride)
        self.learn_anchors(engine_id, req)
        return req

    def learn_anchors(self, engine_id: str, req: Sequence[int]) -> None:
        """``engine_id`` was sent a request whose prompt's anchors are ``req`` (root
        first), by this router or, as told, by another. A no-op while learning is off or
        the engine's own view is told."""
        limit = self.learn
        if not limit or not req or engine_id in self.told:
            return
        lru = self.learned.get(engine_id)
        if lru is None:
            lru = self.learned[engine_id] = {}
            self.engines[engine_id] = set()
        held, new = self.engines[engine_id], []
        # deepest first: the root ends most recent, so a chain is forgotten from its
        # leaves, as engines evict (a request's last blocks are freed first)
        for a in reversed(req):
            if a in lru:
                del lru[a]
            else:
                new.append(a)
            lru[a] = None  # the most recently routed, last
        held.update(new)
        self._hold(engine_id, new)
        if len(lru) > limit:
            old = list(itertools.islice(lru, len(lru) - limit))
            for a in old:
                del lru[a]
            held.difference_update(old)
            self._unhold(engine_id, old)

    def matched_blocks(self, engine_id: str, request_anchors: Sequence[int]) -> int:
        """How many leading blocks of the request the engine holds: its deepest anchor
        among ``request_anchors`` (shallowest first) x the stride; 0 if none."""
        held = self.engines.get(engine_id)
        if not held:
            return 0
        for i in range(len(request_anchors) - 1, -1, -1):
            if request_anchors[i] in held:
                return (i + 1) * self.stride
        return 0


def pack_hashes(hashes: Iterable[int]) -> bytes:
    """Hashes as Redis stores them: 8 bytes each, big-endian, one after the other."""
    return b"".join(h.to_bytes(8, "big") for h in hashes)


def unpack_hashes(data: bytes) -> list[int]:
    """The inverse of :func:`pack_hashes`; a trailing partial hash is ignored."""
    n = len(data) // 8
    return list(struct.unpack(f">{n}Q", data[: n * 8]))
