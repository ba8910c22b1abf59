"""A request's prompt as the engines' prefix caches name it: its token blocks' chained
hashes (``redisbal.routing.cache_view.chain_hashes``), for the default policy to match
with what the engines hold (``--prefix-tokens``).

``off`` (the default): no hashes. ``sim``: engine-sim's tokens (4 characters each,
``sim_token_ids``) of its prompt text (the completions prompt, or the chat messages'
contents one after the other: ``prompt_text``), exactly what the simulated engines
cache. A path to a Hugging Face ``tokenizer.json``: that tokenizer (the ``tokenizers``
package, loaded at start), on completions only: a text prompt is encoded with its
special tokens as vLLM's completions endpoint does, a prompt of token ids taken as
given. Chat requests are not hashed with a real tokenizer: vLLM tokenizes the chat
template's rendering, role markers between the contents, which the gateway does not
make, so their hashes would match nothing.

Only the leading ``max_tokens`` (8192) tokens are hashed: a match deeper than that
saves little more than one that deep, and the cost stays bounded (tens of
microseconds for ``sim``) whatever the prompt's length."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from redisbal.errors import InvalidArgument
from redisbal.routing.cache_view import (
    BLOCK_TOKENS,
    CHARS_PER_TOKEN,
    chain_hashes,
    prompt_text,
    sim_token_ids,
)

MAX_PREFIX_TOKENS = 8192  # leading tokens hashed at most
# a real tokenizer is given at most this many characters per token hashed: English
# text averages about 4, code and other scripts fewer; whatever is cut goes unmatched
CHARS_PER_REAL_TOKEN = 8
MODES = ("off", "sim")

# (body, chat) -> the prompt's leading blocks' hashes; () when there are none
BlockHasher = Callable[[Mapping[str, Any], bool], tuple[int, ...]]


def sim_blocks(
    body: Mapping[str, Any], chat: bool, max_tokens: int = MAX_PREFIX_TOKENS
) -> tuple[int, ...]:
    """engine-sim's blocks of a request: its prompt text's leading ``max_tokens``
    tokens, hashed as the simulated engines name what they cache."""
    text = prompt_text(body, chat)
    if len(text) < BLOCK_TOKENS * CHARS_PER_TOKEN:
        return ()  # not one whole block
    return tuple(chain_hashes(sim_token_ids(text[: max_tokens * CHARS_PER_TOKEN])))


class TokenizerBlocks:
    """A Hugging Face tokenizer's blocks of completions requests (the module doc)."""

    def __init__(self, path: str, max_tokens: int = MAX_PREFIX_TOKENS) -> None:
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

    def __call__(self, body: Mapping[str, Any], chat: bool) -> tuple[int, ...]:
        if chat:
            return ()
        prompt = body.get("prompt")
        n = self.max_tokens
        if isinstance(prompt, str):
            cut = n * CHARS_PER_REAL_TOKEN
            ids = self.tokenizer.encode(prompt[:cut], add_special_tokens=True).ids[:n]
            if len(prompt) > cut:  # the last tokens may straddle the cut: drop their block
                ids = ids[: max(0, len(ids) - BLOCK_TOKENS)]
        elif isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt[:n]):
            ids = prompt[:n]  # token ids, as given
        else:
            return ()  # a batch of prompts, or nothing to hash
        try:
            return tuple(chain_hashes(ids))
        except InvalidArgument:  # token ids out of range: the engine refuses them
            return ()


def block_hasher(spec: str) -> BlockHasher | None:
    """What ``--prefix-tokens`` makes: None for ``off``, engine-sim's tokens for
    ``sim``, else a tokenizer read from the path (InvalidArgument if it cannot be)."""
    if spec == "off":
        return None
    if spec == "sim":
        return sim_blocks
    return TokenizerBlocks(spec)
