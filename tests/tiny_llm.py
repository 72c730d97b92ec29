"""A tiny causal LM saved as a transformers folder, for tests of the LLM loaders and CLI:
a seeded random Llama (2 layers, hidden 64, 4 heads / 2 KV heads: RoPE, RMSNorm, GQA,
SwiGLU) with a byte-level BPE tokenizer trained on a few sentences (vocab 300, built with
the ``tokenizers`` package, nothing downloaded) and a small chat template."""
from __future__ import annotations

import pathlib

import torch

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
TEXT = ["What is the capital of France? The capital of France is Paris.",
        "Hello world, the quick brown fox jumps over the lazy dog. café naïve 東京"]


def tiny_tokenizer(chat: bool = True):
    """A byte-level BPE ``PreTrainedTokenizerFast`` of 300 tokens: ``<s>`` 0, ``</s>`` 1
    (eos), ``<|user|>`` 2, ``<|assistant|>`` 3; with ``chat`` a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(TEXT * 3, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>", "<|user|>", "<|assistant|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>")
    if chat:
        tok.chat_template = CHAT_TEMPLATE
    return tok


def save_tiny_llama(folder, chat: bool = True, seed: int = 0) -> pathlib.Path:
    """Write the tiny Llama and its tokenizer to ``folder`` (created); returns it."""
    from transformers import LlamaConfig, LlamaForCausalLM
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = tiny_tokenizer(chat)
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, bos_token_id=0, eos_token_id=1,
                      pad_token_id=1)
    LlamaForCausalLM(cfg).eval().save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder
