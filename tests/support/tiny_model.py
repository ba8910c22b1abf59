"""A tiny Llama with random weights and a word-level tokenizer, made on disk.

Enough for vLLM to load, serve and stream (it says nothing sensible): no hub, no
download, a few seconds on a CPU. Needs ``transformers``, ``tokenizers`` and ``torch``
(all three come with vLLM). CPU attention in vLLM refuses small head sizes, hence
a head size of 64.

    python tests/support/tiny_model.py DIR      # then: vllm ... --model DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

WORDS = [f"w{i}" for i in range(200)] + ["hello", "world", "tell", "me", "a", "story"]
SPECIAL = ["<unk>", "<s>", "</s>", "<pad>"]


def make_tiny_model(out: Path, max_len: int = 512, bos: bool = False) -> Path:
    """Write the model and its tokenizer to ``out`` (created); returns ``out``.
    ``max_len``: the longest sequence it takes (vLLM's ``--max-model-len`` at most).
    ``bos``: the tokenizer puts ``<s>`` before every prompt, as Llama's does (its
    tokenizer.json's post-processor adds it)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(dict.fromkeys(SPECIAL + WORDS))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        add_bos_token=bos,
    )
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,  # head size 64
        num_key_value_heads=2,
        max_position_embeddings=max_len,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
    )
    LlamaForCausalLM(config).save_pretrained(out)
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/support/tiny_model.py DIR")
    print(make_tiny_model(Path(sys.argv[1])))
