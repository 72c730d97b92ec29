"""LLM generation on the graph engine (#27): an application above the engine, beside
`opencann.dynamo`.

- `arch`: a transformers config read into `LLMArch` (GPT-2, Llama, Mistral, Qwen2), or
  one ValueError line naming the unsupported piece (`read_arch`);
- `builder`: `DecoderLM`, the model rewritten over a preallocated KV cache with the
  ``opencann::kv_cache_update`` / ``opencann::decode_attention`` custom ops, sharing the
  transformers model's parameters.
"""
from .arch import LLMArch, read_arch
from .builder import DecoderLM

__all__ = ["DecoderLM", "LLMArch", "read_arch"]
