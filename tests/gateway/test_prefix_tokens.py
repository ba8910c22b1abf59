"""``--prefix-tokens``: a request's prompt blocks, as the engines' caches name them
(redisbal.gateway.prefix). The text's own blocks, engine-sim's tokens, and a real
Hugging Face tokenizer made on disk here (a word-level one: no download); whole
anchors only, up to the first no engine holds."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.cli import run_cli
from tokenizers import Tokenizer, models, pre_tokenizers

from redisbal.errors import InvalidArgument
from redisbal.gateway.prefix import (
    EVERY,
    MAX_PREFIX_TOKENS,
    SimBlocks,
    TextBlocks,
    block_hasher,
)
from redisbal.routing.cache_view import anchors, chain_hashes, sim_token_ids, text_hashes

WORDS = [f"w{i}" for i in range(50)]


def whole_anchors(ids: list[int]) -> tuple[int, ...]:
    """The chain of ``ids`` cut to its last anchor."""
    return tuple(chain_hashes(ids[: len(ids) // 64 * 64]))


@pytest.fixture
def tokenizer_json(tmp_path: Path) -> str:
    vocab = {w: i for i, w in enumerate(["[UNK]", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return str(path)


def test_sim_blocks_are_the_chain_of_engine_sims_tokens_to_the_last_anchor() -> None:
    text = "You are a helpful assistant. " * 40  # 1160 characters: 290 tokens
    sim = SimBlocks()
    got = sim({"prompt": text}, False, EVERY)
    assert got == whole_anchors(sim_token_ids(text)) and len(got) == 16
    assert got == tuple(chain_hashes(sim_token_ids(text)))[:16]
    turns = [{"role": "system", "content": text[:600]}, {"role": "user", "content": text[600:]}]
    assert sim({"messages": turns}, True, EVERY) == got  # the contents one after the other
    assert SimBlocks()({"messages": turns}, True, EVERY) == got  # (not from the memo)
    assert sim({"prompt": "short"}, False, EVERY) == ()


def test_text_blocks_are_the_chain_of_the_texts_own_64_character_blocks() -> None:
    """``text``: a prompt named by its text itself, chat or completions alike; not
    engine-sim's tokens (those match KV events), and each block covers all before it."""
    text = "You are a helpful assistant. " * 40  # 1160 characters: 18 blocks, 4 anchors
    hasher = block_hasher("text")
    assert isinstance(hasher, TextBlocks)
    # so the gateway reads no KV-events views with it (sim's match engine-sim's events)
    assert not hasher.matches_kv_events and SimBlocks.matches_kv_events
    got = hasher({"prompt": text}, False, EVERY)
    assert got == tuple(text_hashes(text[:1024])) and len(got) == 16
    assert text_hashes(text[512:1024], parent=got[7]) == list(got[8:])
    turns = [{"role": "system", "content": text[:600]}, {"role": "user", "content": text[600:]}]
    assert TextBlocks()({"messages": turns}, True, EVERY) == got
    assert got != SimBlocks()({"prompt": text}, False, EVERY)
    other = text[:700] + "X" + text[701:]  # one character changed in block 11
    assert hasher({"prompt": other}, False, EVERY)[:10] == got[:10]
    assert set(hasher({"prompt": other}, False, EVERY)[10:]).isdisjoint(got)


def test_the_walk_stops_at_the_first_anchor_no_engine_holds() -> None:
    text = "abcdefgh" * 1000  # 2000 tokens: 31 anchors
    full = SimBlocks()({"prompt": text}, False, EVERY)
    held = set(anchors(full)[:2])
    got = SimBlocks()({"prompt": text}, False, held)
    assert got == full[:12]  # two anchors held, the third not: nothing past it
    assert SimBlocks()({"prompt": text}, False, set()) == full[:4]


def test_sim_blocks_stop_at_the_bound() -> None:
    text = "abcd" * (MAX_PREFIX_TOKENS + 1000)
    got = SimBlocks()({"prompt": text}, False, EVERY)
    assert len(got) == MAX_PREFIX_TOKENS // 16
    assert got == tuple(chain_hashes(sim_token_ids(text[: MAX_PREFIX_TOKENS * 4])))


def test_the_bound_is_an_option() -> None:
    text = "abcd" * 4096
    hasher = block_hasher("sim", 1000)
    assert hasher is not None and len(hasher({"prompt": text}, False, EVERY)) == 60


def test_the_memo_forgets_the_least_recently_used_pieces() -> None:
    sim = SimBlocks(memo=4)
    a, b = "a" * 256 * 3, "b" * 256 * 3
    want = sim({"prompt": a}, False, EVERY)
    sim({"prompt": b}, False, EVERY)
    assert len(sim.memo.pieces) == 4  # a's last two pieces went
    assert sim({"prompt": a}, False, EVERY) == want


def test_a_tokenizer_hashes_completions_prompts_as_the_engine_tokenizes_them(
    tokenizer_json: str,
) -> None:
    hasher = block_hasher(tokenizer_json)
    assert hasher is not None
    text = " ".join(WORDS[i % 50] for i in range(200))
    want = whole_anchors([1 + i % 50 for i in range(200)])
    assert hasher({"prompt": text}, False, EVERY) == want and len(want) == 12
    ids = [1 + i % 50 for i in range(200)]
    assert hasher({"prompt": ids}, False, EVERY) == want  # token ids, as given
    assert hasher({"messages": [{"role": "user", "content": text}]}, True, EVERY) == ()
    assert hasher({"prompt": [text, text]}, False, EVERY) == ()  # a batch: no one prompt
    assert hasher({"prompt": [-1] * 64}, False, EVERY) == ()  # ids the engine would refuse


def test_a_prompt_past_the_bound_loses_the_block_the_cut_may_have_split(
    tokenizer_json: str,
) -> None:
    hasher = block_hasher(tokenizer_json)
    assert hasher is not None
    text = " ".join(WORDS[i % 50] for i in range(MAX_PREFIX_TOKENS * 3))
    got = hasher({"prompt": text}, False, EVERY)
    assert 0 < len(got) < MAX_PREFIX_TOKENS // 16
    ids = [1 + i % 50 for i in range(MAX_PREFIX_TOKENS * 3)]
    assert got == tuple(chain_hashes(ids[: len(got) * 16])) and len(got) % 4 == 0


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
