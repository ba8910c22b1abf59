"""``--prefix-tokens``: a request's prompt blocks, as the engines' caches name them
(redisbal.gateway.prefix). engine-sim's tokens, and a real Hugging Face tokenizer made
on disk here (a word-level one: no download)."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.cli import run_cli
from tokenizers import Tokenizer, models, pre_tokenizers

from redisbal.errors import InvalidArgument
from redisbal.gateway.prefix import MAX_PREFIX_TOKENS, block_hasher, sim_blocks
from redisbal.routing.cache_view import chain_hashes, sim_token_ids

WORDS = [f"w{i}" for i in range(50)]


@pytest.fixture
def tokenizer_json(tmp_path: Path) -> str:
    vocab = {w: i for i, w in enumerate(["[UNK]", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return str(path)


def test_sim_blocks_are_the_chain_of_engine_sims_tokens() -> None:
    text = "You are a helpful assistant. " * 40
    got = sim_blocks({"prompt": text}, chat=False)
    assert got == tuple(chain_hashes(sim_token_ids(text))) and len(got) == len(text) // 64
    turns = [{"role": "system", "content": text[:600]}, {"role": "user", "content": text[600:]}]
    assert sim_blocks({"messages": turns}, chat=True) == got  # contents one after the other
    assert sim_blocks({"prompt": "short"}, chat=False) == ()


def test_sim_blocks_stop_at_the_bound() -> None:
    text = "abcd" * (MAX_PREFIX_TOKENS + 1000)
    got = sim_blocks({"prompt": text}, chat=False)
    assert len(got) == MAX_PREFIX_TOKENS // 16
    assert got == tuple(chain_hashes(sim_token_ids(text[: MAX_PREFIX_TOKENS * 4])))


def test_a_tokenizer_hashes_completions_prompts_as_the_engine_tokenizes_them(
    tokenizer_json: str,
) -> None:
    hasher = block_hasher(tokenizer_json)
    assert hasher is not None
    text = " ".join(WORDS[i % 50] for i in range(100))
    want = tuple(chain_hashes([1 + i % 50 for i in range(100)]))
    assert hasher({"prompt": text}, False) == want and len(want) == 6
    assert hasher({"prompt": [1 + i % 50 for i in range(100)]}, False) == want  # token ids
    assert hasher({"messages": [{"role": "user", "content": text}]}, True) == ()
    assert hasher({"prompt": [text, text]}, False) == ()  # a batch: no one prompt
    assert hasher({"prompt": [-1] * 32}, False) == ()  # ids the engine would refuse


def test_a_prompt_past_the_bound_loses_the_block_the_cut_may_have_split(
    tokenizer_json: str,
) -> None:
    hasher = block_hasher(tokenizer_json)
    assert hasher is not None
    text = " ".join(WORDS[i % 50] for i in range(MAX_PREFIX_TOKENS * 3))
    got = hasher({"prompt": text}, False)
    assert 0 < len(got) < MAX_PREFIX_TOKENS // 16
    ids = [1 + i % 50 for i in range(MAX_PREFIX_TOKENS * 3)]
    assert got == tuple(chain_hashes(ids[: len(got) * 16]))


def test_off_makes_nothing_and_a_bad_tokenizer_is_one_clear_error(tmp_path: Path) -> None:
    assert block_hasher("off") is None
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(InvalidArgument, match="cannot read the tokenizer"):
        block_hasher(str(bad))
    out = run_cli("gateway", "--prefix-tokens", str(tmp_path / "missing.json"))
    assert out.returncode == 2
    assert "--prefix-tokens" in out.stderr and "cannot read the tokenizer" in out.stderr
    assert "Traceback" not in out.stderr
