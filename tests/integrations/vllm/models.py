"""Tiny random-weight Llama models made at test time (no hub is reachable), with a word-level
tokenizer so ``vllm serve`` can take text prompts.

``initializer_range`` is large so the logits are far from uniform: corrupted KV changes the
generated tokens (the tests check that they can see bad KV)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

VOCAB = 1024


@dataclass(frozen=True)
class TinyLlama:
    layers: int = 2
    hidden: int = 256
    intermediate: int = 512
    heads: int = 4
    kv_heads: int = 4
    head_dim: int = 64
    max_positions: int = 8192
    seed: int = 0

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes


def make_model(directory: Path, spec: TinyLlama = TinyLlama()) -> Path:
    """Write a random Llama (seeded) and its tokenizer into ``directory``; returns it."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(spec.seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_positions,
        initializer_range=0.2,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    LlamaForCausalLM(config).save_pretrained(directory)
    words = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(directory)
    return directory


def words(token_ids: list[int]) -> str:
    """The text that the tokenizer above turns into ``token_ids``."""
    return " ".join(f"w{t}" for t in token_ids)
