"""A request's prompt as the engines' prefix caches name it: its token blocks' chained
hashes (``redisbal.routing.cache_view.chain_hashes``), for the default policy to match
with what the engines hold (``--prefix-tokens``).

``off`` (the default): no hashes. ``text``: the prompt text's own blocks (64
characters each, ``text_hashes``) of its prompt text (the completions prompt, or the
chat messages' contents one after the other: ``prompt_text``): they name a prompt for
a router matching it with its own routes, any engine and chat alike, and match no KV
event. ``sim``: engine-sim's tokens (4 characters each, ``sim_token_ids``) of the same
text, exactly what the simulated engines cache, so they match engine-sim's KV events
too. A path to a Hugging Face ``tokenizer.json``: that tokenizer (the ``tokenizers``
package, loaded at start), on completions only: a text prompt is encoded with its
special tokens as vLLM's completions endpoint does, a prompt of token ids taken as
given. Chat requests are not hashed with a real tokenizer: vLLM tokenizes the chat
template's rendering, role markers between the contents, which the gateway does not
make, so their hashes would match no KV event.

Kept cheap, since it runs on every request: only whole anchors' pieces are hashed (a
match is found at anchors only: ``ANCHOR_STRIDE`` blocks, 64 tokens), at most the
leading ``MAX_PREFIX_TOKENS``; without a router learning its routes, the walk stops at
the first anchor no engine holds (the policy reads nothing past it: ``EVERY`` walks
on); and each piece's hashes are remembered by its parent and its text or tokens
(``ChainMemo``), so the prefixes that many requests share (the ones worth matching)
are hashed once, not per request."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Container, Hashable, Iterable, Mapping, Sequence
from typing import Any

from redisbal.errors import InvalidArgument
from redisbal.routing.cache_view import (
    ANCHOR_STRIDE,
    BLOCK_TOKENS,
    CHARS_PER_TOKEN,
    chain_hashes,
    prompt_text,
    sim_token_ids,
    text_hashes,
)

MAX_PREFIX_TOKENS = 8192  # leading tokens hashed at most
PIECE_TOKENS = ANCHOR_STRIDE * BLOCK_TOKENS  # one anchor's blocks: what is hashed at once
# a real tokenizer is given at most this many characters per token hashed: English
# text averages about 4, code and other scripts fewer; whatever is cut goes unmatched
CHARS_PER_REAL_TOKEN = 8
MEMO_PIECES = 8192  # pieces remembered: 512k tokens of distinct prefixes, a few MB

# (body, chat, the anchors some engine holds) -> the prompt's leading blocks' hashes,
# up to its first anchor no engine holds; () when there are none
BlockHasher = Callable[[Mapping[str, Any], bool, Container[int]], tuple[int, ...]]


class _Every(Container[int]):
    """Holds every anchor: hash a whole prompt (for a router learning its routes)."""

    def __contains__(self, anchor: object) -> bool:
        return True


EVERY: Container[int] = _Every()


class ChainMemo:
    """A chain's hashes, one anchor's piece at a time, each piece's remembered by its
    parent (the hash before it) and its content: a prefix seen before costs a lookup
    per 64 tokens. Least recently used pieces are forgotten past ``size``."""

    def __init__(self, size: int = MEMO_PIECES) -> None:
        self.size = size
        self.pieces: OrderedDict[tuple[int | None, Hashable], tuple[int, ...]] = OrderedDict()

    def chain(
        self,
        pieces: Iterable[Hashable],
        hash_piece: Callable[[Any, int | None], Sequence[int]],
        held: Container[int],
    ) -> tuple[int, ...]:
        """The blocks' hashes of ``pieces`` (each one anchor's worth, hashed by
        ``hash_piece`` from its parent's hash), in order, up to and including the
        first anchor not in ``held``."""
        memo, out = self.pieces, list[int]()
        parent: int | None = None
        for piece in pieces:
            key = (parent, piece)
            got = memo.get(key)
            if got is None:
                got = memo[key] = tuple(hash_piece(piece, parent))
                if len(memo) > self.size:
                    memo.popitem(last=False)
            else:
                memo.move_to_end(key)
            out.extend(got)
            parent = got[-1]  # the piece's anchor
            if parent not in held:
                break  # no engine holds it: nothing deeper can match
        return tuple(out)


class TextBlocks:
    """A request's blocks named by its prompt text itself (``text_hashes``): its
    leading whole anchors' pieces (256 characters each), chat or completions. Matches
    what a router learned from its own routes, not KV events."""

    matches_kv_events = False  # (so the gateway reads no KV-events views for them)

    def __init__(self, max_tokens: int = MAX_PREFIX_TOKENS, memo: int = MEMO_PIECES) -> None:
        self.memo = ChainMemo(memo)
        self.max_tokens = max_tokens

    @staticmethod
    def hash_piece(piece: str, parent: int | None) -> Sequence[int]:
        return text_hashes(piece, parent)

    def __call__(
        self, body: Mapping[str, Any], chat: bool, held: Container[int]
    ) -> tuple[int, ...]:
        text = prompt_text(body, chat)
        step = PIECE_TOKENS * CHARS_PER_TOKEN
        end = min(len(text), self.max_tokens * CHARS_PER_TOKEN) // step * step
        pieces = (text[i : i + step] for i in range(0, end, step))
        return self.memo.chain(pieces, self.hash_piece, held)


class SimBlocks(TextBlocks):
    """engine-sim's blocks of a request: its text's pieces hashed as the simulated
    engines name what they cache (engine-sim's tokens), so they match its KV events."""

    matches_kv_events = True

    @staticmethod
    def hash_piece(piece: str, parent: int | None) -> Sequence[int]:
        return chain_hashes(sim_token_ids(piece), parent=parent)


class TokenizerBlocks:
    """A Hugging Face tokenizer's blocks of completions requests (the module doc)."""

    matches_kv_events = True

    def __init__(
        self, path: str, max_tokens: int = MAX_PREFIX_TOKENS, memo: int = MEMO_PIECES
    ) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise InvalidArgument(
                "--prefix-tokens with a tokenizer.json needs the tokenizers package: "
                "pip install 'redisbal[tokenizers]'"
            ) from None
        try:
            self.tokenizer = Tokenizer.from_file(path)
        except Exception as exc:  # (its errors are plain Exceptions from Rust)
            why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise InvalidArgument(f"cannot read the tokenizer {path}: {why}") from None
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        self.max_tokens = max_tokens
        self.memo = ChainMemo(memo)

    def ids(self, body: Mapping[str, Any], chat: bool) -> list[int]:
        """The prompt's leading token ids that are safe to hash ([] for none)."""
        if chat:
            return []
        prompt = body.get("prompt")
        n = self.max_tokens
        if isinstance(prompt, str):
            cut = n * CHARS_PER_REAL_TOKEN
            ids: list[int] = self.tokenizer.encode(prompt[:cut], add_special_tokens=True).ids[:n]
            if len(prompt) > cut:  # the last tokens may straddle the cut: drop their block
                ids = ids[: max(0, len(ids) - BLOCK_TOKENS)]
            return ids
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt[:n]):
            return prompt[:n]  # token ids, as given
        return []  # a batch of prompts, or nothing to hash

    def __call__(
        self, body: Mapping[str, Any], chat: bool, held: Container[int]
    ) -> tuple[int, ...]:
        ids = self.ids(body, chat)
        pieces = (
            tuple(ids[i : i + PIECE_TOKENS])
            for i in range(0, len(ids) // PIECE_TOKENS * PIECE_TOKENS, PIECE_TOKENS)
        )
        try:
            return self.memo.chain(pieces, _chain_of_ids, held)
        except InvalidArgument:  # token ids out of range: the engine refuses them
            return ()


def _chain_of_ids(ids: Sequence[int], parent: int | None) -> Sequence[int]:
    return chain_hashes(ids, parent=parent)


def block_hasher(spec: str, max_tokens: int = MAX_PREFIX_TOKENS) -> BlockHasher | None:
    """What ``--prefix-tokens`` makes: None for ``off``, the text's own blocks for
    ``text``, engine-sim's tokens for ``sim``, else a tokenizer read from the path
    (InvalidArgument if it cannot be); hashing at most ``max_tokens`` leading tokens
    (``--prefix-max-tokens``)."""
    if spec == "off":
        return None
    if spec == "text":
        return TextBlocks(max_tokens)
    if spec == "sim":
        return SimBlocks(max_tokens)
    return TokenizerBlocks(spec, max_tokens)
